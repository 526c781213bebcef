"""Attention options on every backend, on CPU: the torch kernel's blockwise path (no dense mask)
against a dense-mask reference, the softmax scale and deterministic mode reaching the kernels,
named refusals of sliding windows, softmax variants and unfused attention (module construction,
Megatron argument validation, the backend probe), the probe's verdict cached per shape class,
fp32 accumulation of K/V prefix gradients, and CUDA-event timing."""
import argparse
import sys
import types

import pytest
import torch

from megatron_slimpack.runtime.attention import backend_probe, kernels
from megatron_slimpack.runtime.attention.kernels import prefix_causal_attention, torch_kernel


def dense_reference(q, k, v, cu_q, cu_kv, scale):
    """softmax(q k^T * scale + bottom-right causal mask) v per segment, with an explicit query x key mask."""
    bounds_q, bounds_kv = cu_q.tolist(), cu_kv.tolist()
    outputs = []
    for i in range(len(bounds_q) - 1):
        qs, ks = q[bounds_q[i]:bounds_q[i + 1]], k[bounds_kv[i]:bounds_kv[i + 1]]
        vs = v[bounds_kv[i]:bounds_kv[i + 1]]
        lq, lk, repeat = qs.shape[0], ks.shape[0], qs.shape[1] // ks.shape[1]
        kk, vv = ks.repeat_interleave(repeat, dim=1), vs.repeat_interleave(repeat, dim=1)
        scores = torch.einsum("qhd,khd->hqk", qs, kk) * scale
        visible = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        outputs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vv))
    return torch.cat(outputs)


def varlen_inputs(segments, heads=4, groups=2, dim=8, dtype=torch.float32, seed=0):
    """segments: (KV prefix, queries) each; returns (q, k, v, cu_q, cu_kv, max_q, max_kv), q/k/v leaves."""
    generator = torch.Generator().manual_seed(seed)
    q_lens = [n for _, n in segments]
    kv_lens = [p + n for p, n in segments]

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).to(dtype).requires_grad_()

    return (leaf(sum(q_lens), heads, dim), leaf(sum(kv_lens), groups, dim), leaf(sum(kv_lens), groups, dim),
            kernels.cu_seqlens(q_lens, "cpu"), kernels.cu_seqlens(kv_lens, "cpu"), max(q_lens), max(kv_lens))


# ---- the torch kernel, block by block ------------------------------------------------------------
# "split": the CPU's two fused blocks combined by log-sum-exp; (query, key) tile sizes: the tiled
# online softmax that runs on other devices and with dropout.
BLOCKWISE_PATHS = ["split", (256, 1024), (8, 16), (5, 7)]


def use_path(monkeypatch, path):
    if path != "split":
        monkeypatch.setattr(kernels, "_cpu_flash_ops", lambda: None)
        monkeypatch.setattr(kernels, "QUERY_BLOCK", path[0])
        monkeypatch.setattr(kernels, "KEY_BLOCK", path[1])


@pytest.mark.parametrize("path", BLOCKWISE_PATHS)
def test_blockwise_torch_kernel_equals_the_dense_mask_reference(monkeypatch, path):
    use_path(monkeypatch, path)
    q, k, v, cu_q, cu_kv, max_q, max_kv = varlen_inputs([(37, 29), (0, 50), (3, 1), (64, 33)])
    grad = torch.randn(q.shape[0], q.shape[1], v.shape[-1])
    got = torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, 0.3, 0.0)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    want = dense_reference(q, k, v, cu_q, cu_kv, 0.3)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5)


def test_deterministic_mode_off_the_cpu_runs_every_segment_as_tiles(monkeypatch):
    """On a GPU, deterministic mode keeps SDPA's GPU backward out: every segment runs the tiles
    (forced here on the CPU), with the same result."""
    q, k, v, cu_q, cu_kv, max_q, max_kv = varlen_inputs([(0, 20), (13, 9)])
    want = torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, 0.3, 0.0)
    assert not kernels._tiles_everywhere(torch.device("cpu"), True)
    assert kernels._tiles_everywhere(torch.device("cuda"), True)
    assert not kernels._tiles_everywhere(torch.device("cuda"), False)
    monkeypatch.setattr(kernels, "_tiles_everywhere", lambda device, deterministic: deterministic)
    calls = []
    monkeypatch.setattr(kernels, "segment_attention", lambda *args: calls.append(args))
    got = torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, 0.3, 0.0, deterministic=True)
    assert calls == []
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("path", ["split", (16, 64)])
def test_blockwise_torch_kernel_builds_no_query_by_key_mask(monkeypatch, path):
    """No SDPA call gets a mask, and nothing of query x key size is saved for backward: a slice
    of 64 queries with 448 prefix keys saves its inputs, output and log-sum-exp only."""
    use_path(monkeypatch, path)
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording_sdpa(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording_sdpa)
    lq, lk = 64, 512
    q, k, v, cu_q, cu_kv, max_q, max_kv = varlen_inputs([(lk - lq, lq), (0, 40)])
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, 0.25, 0.0)
    out.sum().backward()
    assert all(mask is None for mask in masks) and masks
    assert max(saved) < lq * lk  # the old kernel saved the lq x lk mask


def test_blockwise_attention_gradients_with_dropout():
    """Dropout masks are drawn per tile and redrawn identically in backward: gradcheck in fp64."""
    q, k, v, *_ = varlen_inputs([(9, 6)], heads=2, groups=1, dim=3, dtype=torch.float64)

    def attend(q, k, v):
        torch.manual_seed(7)
        return prefix_causal_attention(q, k, v, 0.5, 0.3, query_block=4, key_block=5)

    assert torch.autograd.gradcheck(attend, (q, k, v))
    torch.testing.assert_close(attend(q, k, v), attend(q, k, v))
    assert not torch.allclose(attend(q, k, v), prefix_causal_attention(q, k, v, 0.5, 0.0))


@pytest.mark.parametrize("path", ["split", (64, 128)])
def test_blockwise_attention_in_bf16_is_close_to_fp32(monkeypatch, path):
    use_path(monkeypatch, path)
    q, k, v, *_ = varlen_inputs([(300, 100)], dtype=torch.float32)
    want = prefix_causal_attention(q, k, v, 0.35)
    grad = torch.randn(want.shape)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    low = [x.detach().bfloat16().requires_grad_() for x in (q, k, v)]
    got = prefix_causal_attention(*low, 0.35)
    got_grads = torch.autograd.grad(got, low, grad.bfloat16())
    assert got.dtype == torch.bfloat16 and all(g.dtype == torch.bfloat16 for g in got_grads)
    for g, w in zip([got, *got_grads], [want, *want_grads]):
        assert float((g.float() - w).norm() / w.norm()) < 1e-2


# ---- softmax scale and deterministic mode reach the kernels --------------------------------------
def _config(**overrides):
    from megatron_slimpack.runtime.model import tiny_config

    return tiny_config(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, **overrides)


def _module(backend="torch", **overrides):
    from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention

    config = _config(**overrides)
    return SlicedDotProductAttention(config, layer_number=1, attn_mask_type=None, backend=backend,
                                     softmax_scale=config.softmax_scale)


def test_softmax_scale_is_honoured_by_the_torch_kernel(megatron_cpu):
    module = _module(softmax_scale=0.37)
    q, k, v, cu_q, cu_kv, max_q, max_kv = varlen_inputs([(11, 7), (0, 9)], dim=16)
    out = module._attend(q, k, v, cu_q, cu_kv, max_q, max_kv)
    want = dense_reference(q, k, v, cu_q, cu_kv, 0.37)
    torch.testing.assert_close(out, want.reshape(out.shape), atol=2e-6, rtol=1e-5)


def test_the_probe_compares_against_the_modules_own_softmax_scale(megatron_cpu):
    """A module with a non-default scale agrees with the reference at that scale (not 1/sqrt(d))."""
    module = _module(softmax_scale=0.05)
    assert backend_probe.probe(module, torch.float32, heads=4, groups=2, head_dim=16, device="cpu") is None


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """A stand-in `flash_attn` package that records the keyword arguments of its varlen call."""
    calls = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_kv, max_q, max_kv, **kwargs):
        calls.append(kwargs)
        return torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, kwargs["softmax_scale"], kwargs["dropout_p"])

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    return calls


@pytest.mark.parametrize("deterministic", [False, True])
def test_flash_gets_the_softmax_scale_and_deterministic_mode(fake_flash_attn, deterministic, megatron_cpu):
    module = _module("flash", softmax_scale=0.21, deterministic_mode=deterministic)
    q, k, v, cu_q, cu_kv, max_q, max_kv = varlen_inputs([(5, 4)], dim=16)
    module._attend(q, k, v, cu_q, cu_kv, max_q, max_kv)
    assert fake_flash_attn[-1]["softmax_scale"] == 0.21
    assert fake_flash_attn[-1]["deterministic"] is deterministic
    assert fake_flash_attn[-1]["causal"] is True


# ---- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, message", [
    ({"window_size": (64, 0)}, "window_size=.*remove --window-size"),
    ({"softmax_type": "off-by-one"}, "softmax_type='off-by-one'.*use --softmax-type vanilla"),
    ({"softmax_type": "learnable"}, "softmax_type='learnable'"),
])
def test_unsupported_attention_options_are_refused_when_the_module_is_built(overrides, message, megatron_cpu):
    from megatron_slimpack.errors import SlimPackError

    with pytest.raises(kernels.UnsupportedAttentionOption, match=message) as refused:
        _module(**overrides)
    assert isinstance(refused.value, SlimPackError)


def megatron_attention_parser() -> argparse.ArgumentParser:
    """Megatron's attention flags as it spells them, and the ones validation always needs."""
    from megatron_slimpack.megatron import add_slimpack_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--window-size", type=lambda text: tuple(int(x) for x in text.strip("()").split(",")),
                        default=None)
    parser.add_argument("--softmax-type", choices=["vanilla", "off-by-one", "learnable"], default="vanilla")
    parser.add_argument("--deterministic-mode", action="store_true")
    parser.add_argument("--attention-backend", default="auto")
    return add_slimpack_args(parser)


@pytest.mark.parametrize("argv, message", [
    (("--window-size", "(128,0)"), r"--window-size \(128, 0\): .*remove --window-size"),
    (("--softmax-type", "off-by-one"), "--softmax-type off-by-one: .*use --softmax-type vanilla"),
    (("--softmax-type", "learnable"), "--softmax-type learnable"),
    (("--attention-backend", "unfused"), "--attention-backend unfused: .*use --attention-backend auto"),
])
def test_unsupported_attention_flags_are_refused_at_validation(argv, message):
    from megatron_slimpack.errors import SlimPackError
    from megatron_slimpack.megatron import SlimPackArgumentError, validate_slimpack_args

    args = megatron_attention_parser().parse_args(["--slimpack", "--calculate-per-token-loss", *argv])
    with pytest.raises(SlimPackArgumentError, match=message) as refused:
        validate_slimpack_args(args)
    assert isinstance(refused.value, SlimPackError)


def test_deterministic_mode_with_transformer_engine_needs_its_environment(monkeypatch):
    from megatron_slimpack.megatron import SlimPackArgumentError, validate_slimpack_args
    from megatron_slimpack.megatron import args as args_module

    args = megatron_attention_parser().parse_args(["--slimpack", "--calculate-per-token-loss",
                                                   "--deterministic-mode"])
    monkeypatch.setattr(args_module, "_transformer_engine_installed", lambda: True)
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", raising=False)
    with pytest.raises(SlimPackArgumentError, match="export NVTE_ALLOW_NONDETERMINISTIC_ALGO=0"):
        validate_slimpack_args(args)
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    validate_slimpack_args(args)  # honoured: TE reads the variable, flash-attn gets deterministic=True
    monkeypatch.setattr(args_module, "_transformer_engine_installed", lambda: False)
    monkeypatch.delenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO")
    validate_slimpack_args(args)
    validate_slimpack_args(megatron_attention_parser().parse_args(["--slimpack", "--calculate-per-token-loss"]))


class UnfusedStandIn(torch.nn.Module):
    """A module shaped like Transformer Engine's DotProductAttention that runs its unfused backend."""

    def __init__(self):
        super().__init__()
        self.unfused_attention = torch.nn.Identity()
        self.softmax_scale = 16 ** -0.5

    def _attend(self, q, k, v, cu_q, cu_kv, max_q, max_kv, bounds=None):
        self.unfused_attention(q)
        return torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, self.softmax_scale, 0.0).reshape(q.shape[0], -1)


def test_transformer_engines_unfused_path_is_refused_and_passed_over(monkeypatch, megatron_cpu):
    from megatron_slimpack.runtime.attention.core import refuse_unfused_attention

    module = UnfusedStandIn()
    refuse_unfused_attention(module)
    q, k, v, cu_q, cu_kv, max_q, max_kv = varlen_inputs([(5, 4)], dim=16)
    with pytest.raises(kernels.UnfusedAttentionError, match="unfused attention.*Install cuDNN >= 9.6"):
        module._attend(q, k, v, cu_q, cu_kv, max_q, max_kv)
    monkeypatch.setattr(backend_probe, "available_backends", lambda: ["te", "torch"])
    with pytest.raises(backend_probe.NoFusedAttentionBackend, match="te: UnfusedAttentionError"):
        backend_probe.choose_backend(_config(), torch.device("cpu"), lambda name: module)


def test_auto_on_a_gpu_with_only_the_torch_kernel_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_installed", lambda package: False)
    monkeypatch.setattr(kernels, "torch_fused_on_gpu", lambda: False)  # no varlen_attn (or an older GPU)
    with pytest.raises(kernels.NoFusedAttentionBackend, match="'auto' on a GPU.*Install flash-attn >= 2.1"):
        kernels.resolve_backend("auto")
    assert kernels.resolve_backend("torch") == "torch"  # asked for by name: it runs


# ---- the probe's verdict per shape class -------------------------------------------------------
def test_the_probe_runs_once_per_shape_class(monkeypatch, megatron_cpu):
    from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention

    monkeypatch.setattr(backend_probe, "_verdicts", {})
    monkeypatch.setattr(backend_probe, "available_backends", lambda: ["flash", "torch"])
    monkeypatch.setitem(kernels.KERNELS, "flash", torch_kernel)
    built = []

    def build(config):
        def make(name):
            built.append(name)
            return SlicedDotProductAttention(_config(), layer_number=1, attn_mask_type=None, backend=name)
        return make

    cpu = torch.device("cpu")
    # Models of one class share the verdict (sequence lengths are no part of it: the probe's
    # case has its own); tp=2 with 8 heads / 4 groups is tp=1's 4 / 2.
    for config in (_config(), _config(ffn_hidden_size=256), _config(init_method_std=0.01)):
        assert backend_probe.probed_backend(config, cpu, build(config)) == "flash"
    from megatron_slimpack.runtime.model import tiny_config

    wide = tiny_config(num_layers=1, hidden_size=128, num_attention_heads=8, num_query_groups=4,
                       kv_channels=16, tensor_model_parallel_size=2)
    assert backend_probe.shape_class(wide, cpu) == backend_probe.shape_class(_config(), cpu)
    assert backend_probe.probed_backend(wide, cpu, build(wide)) == "flash"
    assert built == ["flash"]
    assert backend_probe.probed_shape_classes() == {"float32, 4 heads / 2 groups per rank, head dim 16, cpu": "flash"}
    # Another dtype is another class: probed again, and a refusal is remembered and repeated.
    monkeypatch.setitem(kernels.KERNELS, "flash", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("no")))
    bf16 = _config(bf16=True, params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    for _ in range(2):
        with pytest.raises(backend_probe.NoFusedAttentionBackend, match="bfloat16.*flash: RuntimeError: no"):
            backend_probe.probed_backend(bf16, cpu, build(bf16))
    assert built == ["flash", "flash"]


# ---- fp32 accumulation of K/V prefix gradients -------------------------------------------------
def test_prefix_gradients_accumulate_in_fp32_across_many_slices():
    """One stored slice read by 256 later slices in bf16: the gradient it receives equals the fp32
    sum of their gradients to within one bf16 rounding, far closer than summing in bf16."""
    from megatron_slimpack.runtime.attention.kv_store import KVStore, stored_and_prefixed

    torch.manual_seed(0)
    store, layer, length, later = KVStore(), 1, 6, 256
    key = torch.randn(length, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    value = torch.randn(length, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    own_keys, own_values = stored_and_prefixed(store, layer, key, value, [0, length], [0], [0], [True])
    grads = [torch.randn(length, 2, 8).bfloat16() * (1 + i % 7) for i in range(later)]
    for grad in grads:  # each later slice: [prefix + 2 own tokens], gradient `grad` on the prefix rows
        mine = torch.zeros(2, 2, 8, dtype=torch.bfloat16, requires_grad=True)
        keys, values = stored_and_prefixed(store, layer, mine, mine, [0, 2], [0], [length], [False])
        ((keys[:length].float() * grad.float()).sum() + values.float().sum() * 0).backward()
    (own_keys.float().sum() * 0 + own_values.float().sum() * 0).backward()
    exact = torch.stack([g.double() for g in grads]).sum(0)
    bf16_sum = torch.zeros_like(grads[0])
    for grad in grads:
        bf16_sum = bf16_sum + grad
    error = float((key.grad.double() - exact).norm() / exact.norm())
    bf16_error = float((bf16_sum.double() - exact).norm() / exact.norm())
    assert key.grad.dtype == torch.bfloat16 and len(store) == 0
    assert error < 4e-3 and error < bf16_error / 4


def test_kv_store_counts_its_fp32_gradient_accumulators():
    from megatron_slimpack.runtime.attention.kv_store import KVStore, read_prefix

    store = KVStore()
    entry = store.put(0, 1, 0, torch.randn(4, 2, 8, dtype=torch.bfloat16), torch.randn(4, 2, 8, dtype=torch.bfloat16))
    assert store.nbytes() == 2 * 64 * 2
    key, value = read_prefix(entry)
    (key.float().sum() + value.float().sum()).backward()
    assert entry.grad_key.dtype == torch.float32 and entry.key.grad is None
    assert store.nbytes() == 2 * 64 * 2 + 2 * 64 * 4


# ---- CUDA-event timing --------------------------------------------------------------------------
def test_timeline_uses_the_host_clock_without_a_gpu():
    from megatron_slimpack.runtime.pipeline.timing import EventStamp, Timeline

    timeline = Timeline(gather=False)
    timeline.start(rank=0, stage=0)
    assert timeline.clock == ("cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "host")
    host = Timeline(gather=False, clock="host")
    host.start(rank=0, stage=0)
    stamp = host.now()
    assert not isinstance(stamp, EventStamp) and stamp >= 0
    with pytest.raises(ValueError, match="clock"):
        Timeline(clock="wall")


def test_timeline_resolves_cuda_event_stamps_once(monkeypatch):
    """With the CUDA clock every stamp is an event; gather() waits for the device once and turns
    the stamps into event times (here: stand-in events 5 ms apart)."""
    from megatron_slimpack.runtime.pipeline import timing

    class Event:
        made = 0

        def __init__(self):
            self.at_ms = 5.0 * Event.made
            Event.made += 1

        def elapsed_time(self, other):
            return other.at_ms - self.at_ms

    waits = []
    monkeypatch.setattr(timing, "_new_event", Event)
    monkeypatch.setattr(timing, "_wait_for_device", lambda: waits.append(1))
    timeline = timing.Timeline(gather=False, clock="cuda")
    timeline.start(rank=0, stage=0)
    start = timeline.now()
    assert isinstance(start, timing.EventStamp)
    timeline.record("F", 0, start, timeline.now())
    timeline.record("B", 0, timeline.now(), timeline.now())
    timeline.gather()
    assert waits == [1]
    assert [(r.start, r.end) for r in timeline.records] == [(0.005, 0.010), (0.015, 0.020)]
    assert timeline.iteration_time_s == pytest.approx(0.020)
