"""Pick the fused attention backend that runs, not merely the one that imports.

A backend can import and still fail on this machine: Transformer Engine's THD
`padding_causal_bottom_right` needs cuDNN >= 9.6 on sm90+ (lengths aligned to 64 before 9.7) or
its flash path, neither runs fp32, and a flash-attn build may not match the GPU. TE may also fall
back to its unfused attention, which allocates the full score matrix (core.py refuses it as it
would run: `UnfusedAttentionError`). So with `backend="auto"` on a GPU, each available fused
backend (TE, flash-attn varlen), fastest first, runs one tiny sliced case (a segment with a KV
prefix and one without, lengths not multiples of 64, the model's dtype, heads per TP rank and
query groups, the module's softmax scale), forward and backward, against the torch kernel in
fp32. The first that runs fused and agrees is used; the reasons the others were passed over are
logged. The torch kernel is the reference; on a GPU it is a candidate, last, only where it is fused
(PyTorch's own varlen flash attention: bf16/fp16 on sm80+, `kernels.torch_varlen_runs_on`), and
then probed like the others against its fp32 per-segment SDPA path. Where no fused backend passes,
`NoFusedAttentionBackend` says why and what to install.

The verdict is cached per shape class (`ShapeClass`: dtype, heads and query groups per TP rank,
head dim, device), not per sequence length: the kernels take any lengths, and probing per length
would re-probe (and rebuild cuDNN graphs) as MicroPacks change shape.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from .kernels import (
    FUSED_INSTALL_HINT,
    NoFusedAttentionBackend,
    available_backends,
    cu_seqlens,
    torch_kernel,
    torch_varlen_runs_on,
)

log = logging.getLogger("megatron_slimpack.attention")

# (KV prefix, queries) per segment: a continued slice and a whole short document, not 64-aligned.
PROBE_SEGMENTS = ((37, 29), (0, 50))
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


FUSED_BACKENDS = ("te", "flash")  # always fused; torch only where `torch_varlen_runs_on`


@dataclass(frozen=True)
class ShapeClass:
    """What a backend's verdict depends on: not the sequence lengths (any lengths run alike)."""

    dtype: torch.dtype
    heads: int    # query heads per TP rank
    groups: int   # K/V groups per TP rank
    head_dim: int
    device: str

    def describe(self) -> str:
        dtype = str(self.dtype).replace("torch.", "")
        return f"{dtype}, {self.heads} heads / {self.groups} groups per rank, head dim {self.head_dim}, {self.device}"


@dataclass
class BackendChoice:
    backend: str
    passed_over: dict = field(default_factory=dict)  # backend -> why it was not used

    def describe(self) -> str:
        reasons = "; ".join(f"{name}: {why}" for name, why in self.passed_over.items())
        return f"attention backend {self.backend}" + (f" (passed over: {reasons})" if reasons else "")


def _probe_inputs(heads: int, groups: int, head_dim: int, device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q_lens = [queries for _, queries in PROBE_SEGMENTS]
    kv_lens = [prefix + queries for prefix, queries in PROBE_SEGMENTS]

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device)

    tensors = (rand(sum(q_lens), heads, head_dim), rand(sum(kv_lens), groups, head_dim),
               rand(sum(kv_lens), groups, head_dim), rand(sum(q_lens), heads * head_dim))
    return tensors, cu_seqlens(q_lens, device), cu_seqlens(kv_lens, device), max(q_lens), max(kv_lens)


def _forward_backward(attend, tensors, dtype):
    q, k, v, grad = (t.to(dtype).detach().requires_grad_(i < 3) for i, t in enumerate(tensors))
    out = attend(q, k, v)
    out.reshape(grad.shape).backward(grad)
    return [out.reshape(grad.shape).float(), q.grad.float(), k.grad.float(), v.grad.float()]


def probe(module, dtype: torch.dtype, heads: int, groups: int, head_dim: int, device) -> Optional[str]:
    """None if `module._attend` (a SlimPack core attention) agrees with the fp32 torch kernel on
    the probe case in `dtype`, forward and backward; otherwise why not."""
    tensors, cu_q, cu_kv, max_q, max_kv = _probe_inputs(heads, groups, head_dim, device)
    try:
        got = _forward_backward(lambda q, k, v: module._attend(q, k, v, cu_q, cu_kv, max_q, max_kv), tensors, dtype)
    except Exception as error:  # any failure means "do not use this backend"
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".strip()
    scale = getattr(module, "softmax_scale", None) or head_dim ** -0.5
    want = _forward_backward(lambda q, k, v: torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, 0.0),
                             tensors, torch.float32)
    names = ("output", "dq", "dk", "dv")
    for name, g, w in zip(names, got, want):
        deviation = float((g - w).norm() / w.norm().clamp_min(1e-30))
        if not deviation <= TOLERANCE.get(dtype, 3e-2):
            return f"{name} differs from the torch reference by {deviation:.1e} (relative) at {dtype}"
    return None


def heads_per_rank(config) -> tuple[int, int]:
    """(query heads, K/V groups) one TP rank's core attention sees. With fewer groups than TP
    ranks, megatron-core gives every rank one group (replicated) and its share of the heads."""
    tp = getattr(config, "tensor_model_parallel_size", 1) or 1
    groups = config.num_query_groups or config.num_attention_heads
    return config.num_attention_heads // tp, max(1, groups // tp)


def shape_class(config, device) -> ShapeClass:
    """The shape class of `config`'s attention on `device` (this TP rank's heads and groups)."""
    heads, groups = heads_per_rank(config)
    dtype = config.params_dtype if (config.bf16 or config.fp16) else torch.float32
    return ShapeClass(dtype, heads, groups, config.kv_channels, str(torch.device(device)))


def choose_backend(config, device, build) -> BackendChoice:
    """The first available fused backend (fastest first) whose module, `build(name)`, passes
    `probe` with the model's dtype and this TP rank's heads. NoFusedAttentionBackend when none
    does: the torch kernel is a candidate only where it is fused for the model's dtype."""
    shape = shape_class(config, device)
    passed_over = {}
    for name in available_backends():
        if name not in FUSED_BACKENDS and not (name == "torch" and torch_varlen_runs_on(device, shape.dtype)):
            continue
        try:
            module = build(name).to(device).eval()
        except Exception as error:  # likewise
            passed_over[name] = f"cannot be built: {type(error).__name__}: {error}"
            continue
        reason = probe(module, shape.dtype, shape.heads, shape.groups, shape.head_dim, device)
        if reason is None:
            return BackendChoice(name, passed_over)
        passed_over[name] = reason
    reasons = "; ".join(f"{name}: {why}" for name, why in passed_over.items()) or "neither is installed"
    raise NoFusedAttentionBackend(
        f"no fused attention backend runs the sliced attention ({shape.describe()}): {reasons}. Only the torch "
        "kernel's per-segment path is left, too slow for training on a GPU. " + FUSED_INSTALL_HINT)


_verdicts: dict[ShapeClass, BackendChoice | NoFusedAttentionBackend] = {}


def probed_backend(config, device, build: Callable) -> str:
    """The backend `probed_choice` chose for `config`'s shape class."""
    return probed_choice(config, device, build).backend


def probed_choice(config, device, build: Callable) -> BackendChoice:
    """`choose_backend`'s verdict for `config`'s shape class, probed once per class and process
    (logged then); a refusal is cached and raised again for every model of that class."""
    shape = shape_class(config, device)
    if shape not in _verdicts:
        try:
            _verdicts[shape] = choice = choose_backend(config, device, build)
            log.warning("%s for %s", choice.describe(), shape.describe())
        except NoFusedAttentionBackend as error:
            _verdicts[shape] = error
    verdict = _verdicts[shape]
    if isinstance(verdict, NoFusedAttentionBackend):
        raise NoFusedAttentionBackend(str(verdict))
    return verdict


def probed_shape_classes() -> dict[str, str]:
    """The backend (or 'refused') chosen per shape class so far in this process, by the class's
    description (the selftest reports it)."""
    return {shape.describe(): verdict.backend if isinstance(verdict, BackendChoice) else "refused"
            for shape, verdict in _verdicts.items()}
