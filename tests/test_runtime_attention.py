"""Backends, layer spec and the CPU compatibility layer."""
import pytest
import torch

from megatron_slimpack.runtime.attention import core as attention
from megatron_slimpack.runtime.attention import kernels
from megatron_slimpack.runtime.attention.kernels import BackendUnavailable, resolve_backend, torch_kernel


def test_torch_kernel_is_bottom_right_causal():
    torch.manual_seed(0)
    lq, lk, heads, groups, dim = 5, 12, 4, 2, 8
    q, k, v = torch.randn(lq, heads, dim), torch.randn(lk, groups, dim), torch.randn(lk, groups, dim)
    out = torch_kernel(q, k, v, torch.tensor([0, lq]), torch.tensor([0, lk]), lq, lk, dim ** -0.5, 0.0)
    # explicit reference: query i is key position lk - lq + i and sees keys [0, lk - lq + i]
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * dim ** -0.5
    visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
    probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    torch.testing.assert_close(out, torch.einsum("hqk,khd->qhd", probs, vv))


def test_backend_choice():
    assert resolve_backend("auto") in kernels.available_backends()
    assert resolve_backend("torch") == "torch"
    with pytest.raises(ValueError, match="unknown attention backend"):
        resolve_backend("cudnn")
    for name, package in (("te", "transformer_engine"), ("flash", "flash_attn")):
        if not kernels._installed(package):
            with pytest.raises(BackendUnavailable, match=package):
                resolve_backend(name)


def test_layer_spec_swaps_only_core_attention(megatron_cpu):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = attention.slimpack_layer_spec("torch")
    stock = get_gpt_layer_local_spec(normalization="RMSNorm")
    core = spec.submodules.self_attention.submodules.core_attention
    assert core.module is attention.SlicedDotProductAttention and core.params == {"backend": "torch"}
    assert spec.submodules.mlp == stock.submodules.mlp
    assert stock.submodules.self_attention.submodules.core_attention is not core  # stock spec untouched


def test_compat_is_idempotent_and_undoable(megatron_cpu):
    from megatron.core.tensor_parallel import random as mp_random

    from megatron_slimpack.runtime import compat

    if not compat.needed():
        pytest.skip("a GPU is present: no compatibility layer")
    tracker = mp_random.get_cuda_rng_tracker()
    assert compat.apply() and mp_random.get_cuda_rng_tracker() is tracker  # second apply: no-op
    compat.undo()
    try:
        assert not compat.is_applied()
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()
    finally:
        compat.apply()
        mp_random._CUDA_RNG_STATE_TRACKER = tracker  # keep the test run's seeded streams
    assert str(torch.cuda.current_device()) == "cpu"


def test_flash_attn_before_2_1_is_not_offered(monkeypatch):
    """flash-attn < 2.1 aligns causal masks top-left: it must never be chosen."""
    import importlib.metadata

    for text, usable in (("2.0.9", False), ("2.1.0", True), ("2.8.3.post1", True), ("1.0.4", False)):
        monkeypatch.setattr(importlib.metadata, "version", lambda name, text=text: text)
        assert kernels.flash_version_ok() is usable
    monkeypatch.setattr(kernels, "_installed", lambda package: True)
    monkeypatch.setattr(kernels, "te_attention_importable", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "2.0.4")
    assert kernels.available_backends() == ["torch"]
    with pytest.raises(BackendUnavailable, match="flash-attn >= 2.1"):
        resolve_backend("flash")


def test_attention_dropout_draws_from_the_model_parallel_rng_stream(megatron_cpu):
    """With dropout, the kernel runs inside Megatron's RNG tracker fork (a per-TP-rank stream), so
    the default generator is left alone and the masks follow the tracker's state."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    from megatron_slimpack.runtime.model import tiny_config

    module = attention.SlicedDotProductAttention(tiny_config(attention_dropout=0.5), 1, None)
    module.train()
    q, k, v = torch.randn(6, 4, 16), torch.randn(6, 4, 16), torch.randn(6, 4, 16)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    tracker = get_cuda_rng_tracker()
    with tracker.fork():
        pass  # make sure the stream exists
    saved_stream, saved_default = tracker.get_states(), torch.get_rng_state()
    first = module._attend(q, k, v, cu, cu, 6, 6)
    assert torch.equal(torch.get_rng_state(), saved_default)  # the default generator was not used
    assert not all(torch.equal(a, b) for a, b in zip(tracker.get_states().values(), saved_stream.values()))
    tracker.set_states(saved_stream)
    assert torch.equal(module._attend(q, k, v, cu, cu, 6, 6), first)  # same stream state, same masks
    module.eval()
    assert torch.equal(torch.get_rng_state(), saved_default)
