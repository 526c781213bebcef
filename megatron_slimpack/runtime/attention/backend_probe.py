"""Pick the attention backend that runs, not merely the one that imports (issue 22).

A backend can import and still fail on this machine: Transformer Engine's THD
`padding_causal_bottom_right` needs cuDNN >= 9.6 on sm90+ (lengths aligned to 64 before 9.7) or
its flash path, neither runs fp32, and a flash-attn build may not match the GPU. So with
`backend="auto"` on a GPU, each available backend, fastest first, runs one tiny sliced case once
(a segment with a KV prefix and one without, lengths not multiples of 64, the model's dtype,
heads per TP rank and query groups), forward and backward, against the torch kernel in fp32. The
first that runs and agrees is used; the reasons the others were passed over are logged. The
torch kernel is the last resort and is not probed (it is the reference).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import torch

from .kernels import available_backends, cu_seqlens, torch_kernel

log = logging.getLogger("megatron_slimpack.attention")

# (KV prefix, queries) per segment: a continued slice and a whole short document, not 64-aligned.
PROBE_SEGMENTS = ((37, 29), (0, 50))
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


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
    scale = head_dim ** -0.5
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


def choose_backend(config, device, build) -> BackendChoice:
    """The first available backend (fastest first) whose module, `build(name)`, passes `probe`
    with the model's dtype and this TP rank's heads; torch when none does."""
    heads, groups = heads_per_rank(config)
    head_dim = config.kv_channels
    dtype = config.params_dtype if (config.bf16 or config.fp16) else torch.float32
    passed_over = {}
    for name in available_backends():
        if name == "torch":
            break
        try:
            module = build(name).to(device).eval()
        except Exception as error:  # likewise
            passed_over[name] = f"cannot be built: {type(error).__name__}: {error}"
            continue
        reason = probe(module, dtype, heads, groups, head_dim, device)
        if reason is None:
            return BackendChoice(name, passed_over)
        passed_over[name] = reason
    return BackendChoice("torch", passed_over)
