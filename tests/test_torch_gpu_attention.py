"""The torch kernel's GPU paths (runtime/attention/kernels.py), on CPU: the one-call varlen path
through a stand-in for `torch.nn.attention.varlen.varlen_attn` that computes what its contract says
(bottom-right causal per segment), the signature differences between torch releases, the dispatch
(dropout and deterministic mode keep the per-segment path), SDPA's `causal_lower_right` for a
segment with a KV prefix, and the backend choice that counts torch as fused only where the varlen
call runs. The kernels themselves are checked on a GPU by `slimpack selftest` and
benchmarks/gpu_anchors.py (section bottom_right)."""
import pytest
import torch

from megatron_slimpack.apps.selftest.attention_checks import masked_softmax_attention
from megatron_slimpack.runtime.attention import backend_probe, kernels
from test_attention_options import varlen_inputs

SEGMENTS = [(7, 5), (0, 9), (3, 1)]  # (KV prefix, queries): continued slices and a whole document


def reference(q, k, v, cu_q, cu_kv, scale):
    """Bottom-right causal attention per segment, [Tq, H, D], at softmax scale `scale`."""
    out = masked_softmax_attention(q * (scale * q.shape[-1] ** 0.5), k, v, cu_q, cu_kv)
    return out.reshape(q.shape)


def stand_in(signature: str, calls: list):
    """A varlen_attn with one release's keywords: "window" (window_size, enable_gqa, scale) or
    "is_causal" (is_causal only: no GQA, no scale)."""
    def check_common(q, k, cu_q, cu_k, max_q, max_k):
        assert cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32
        assert isinstance(max_q, int) and isinstance(max_k, int)

    if signature == "window":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                        enable_gqa=False):
            check_common(query, key, cu_seq_q, cu_seq_k, max_q, max_k)
            assert window_size == (-1, 0)
            assert enable_gqa == (key.shape[1] != query.shape[1])
            calls.append("window")
            return reference(query, key, value, cu_seq_q, cu_seq_k, scale or query.shape[-1] ** -0.5)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False):
            check_common(query, key, cu_seq_q, cu_seq_k, max_q, max_k)
            assert is_causal and key.shape[1] == query.shape[1]  # K/V heads repeated by the caller
            calls.append("is_causal")
            return reference(query, key, value, cu_seq_q, cu_seq_k, query.shape[-1] ** -0.5)
    return varlen_attn


@pytest.mark.parametrize("signature", ["window", "is_causal"])
def test_the_varlen_call_matches_the_per_segment_kernel_in_either_signature(monkeypatch, signature):
    calls: list = []
    monkeypatch.setattr(kernels, "_torch_varlen_function", lambda: stand_in(signature, calls))
    monkeypatch.setattr(kernels, "torch_varlen_runs_on", lambda device, dtype: True)
    scale = 0.21  # not head_dim ** -0.5: the scale must reach the kernel (or q)
    q, k, v, cu_q, cu_kv, max_q, max_kv = varlen_inputs(SEGMENTS, heads=4, groups=2, dim=8)
    got = kernels.torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, 0.0)
    assert calls == [signature]
    monkeypatch.setattr(kernels, "torch_varlen_runs_on", lambda device, dtype: False)
    want = kernels.torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, 0.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Gradients flow through the varlen call too (the stand-in is differentiable like the real one).
    got.sum().backward()
    assert q.grad is not None and k.grad is not None and v.grad is not None


def test_dropout_and_deterministic_mode_keep_the_per_segment_path(monkeypatch):
    calls: list = []
    monkeypatch.setattr(kernels, "_torch_varlen_function", lambda: stand_in("window", calls))
    monkeypatch.setattr(kernels, "torch_varlen_runs_on", lambda device, dtype: True)
    q, k, v, cu_q, cu_kv, max_q, max_kv = varlen_inputs(SEGMENTS)
    kernels.torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, None, 0.0, deterministic=True)
    torch.manual_seed(0)
    kernels.torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, None, 0.1)
    assert calls == []  # varlen_attn takes no dropout, and its backward accumulates dQ with atomics
    kernels.torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, None, 0.0)
    assert calls == ["window"]


def test_the_varlen_call_needs_a_gpu_half_precision_and_the_function():
    assert not kernels.torch_varlen_runs_on("cpu", torch.bfloat16)
    if torch.cuda.is_available():
        assert not kernels.torch_varlen_runs_on("cuda", torch.float32)  # the probe's fp32 reference


def test_sdpa_lower_right_gives_bottom_right_causal_attention_with_gqa():
    q, k, v, cu_q, cu_kv, _, _ = varlen_inputs([(11, 6)], heads=4, groups=2, dim=8)
    got = kernels.lower_right_attention(q, k, v, 0.3, 0.0)
    want = reference(q, k, v, cu_q, cu_kv, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.sum().backward()
    assert k.grad is not None and float(k.grad[:11].abs().sum()) > 0  # the prefix keys are seen


# ---- backend choice --------------------------------------------------------------------------
def test_auto_on_a_gpu_picks_the_torch_kernel_where_it_is_fused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_installed", lambda package: False)
    monkeypatch.setattr(kernels, "torch_fused_on_gpu", lambda: True)
    assert kernels.resolve_backend("auto") == "torch"
    monkeypatch.setattr(kernels, "torch_fused_on_gpu", lambda: False)
    with pytest.raises(kernels.NoFusedAttentionBackend, match="torch.nn.attention.varlen"):
        kernels.resolve_backend("auto")


def test_the_probe_takes_the_torch_kernel_only_where_it_is_fused_for_the_dtype(monkeypatch, megatron_cpu):
    from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention
    from megatron_slimpack.runtime.model import tiny_config

    config = tiny_config(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2)
    monkeypatch.setattr(backend_probe, "available_backends", lambda: ["torch"])

    def build(name):
        return SlicedDotProductAttention(config, layer_number=1, attn_mask_type=None, backend=name)

    monkeypatch.setattr(backend_probe, "torch_varlen_runs_on", lambda device, dtype: dtype == torch.float32)
    choice = backend_probe.choose_backend(config, torch.device("cpu"), build)
    assert choice.backend == "torch" and choice.passed_over == {}
    monkeypatch.setattr(backend_probe, "torch_varlen_runs_on", lambda device, dtype: False)
    with pytest.raises(backend_probe.NoFusedAttentionBackend, match="per-segment path"):
        backend_probe.choose_backend(config, torch.device("cpu"), build)
