"""Sections 2, 3 and 5: the runtime's core attention on sliced THD batches.

Every check builds the backend's core attention module exactly as the layer spec does
(`runtime.attention.core_attention_spec`) and calls its `_attend` (the varlen, bottom-right causal
call every layer makes) or `_attend_positions` (DP-Merge's position runs).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields
from typing import cast

import torch
from torch import Tensor

from ...plan import MicroPack, Slice
from ...runtime.attention.context_parallel import build_layout
from ...runtime.attention.core import build_core_attention
from ...runtime.attention.kernels import cu_seqlens
from ...runtime.model import tiny_config
from .common import FAIL, MEASURED, PASS, Check, Setup, finite, median_seconds

REFERENCE = "explicit fp32 masked softmax (bottom-right causal, GQA by repeating KV heads)"


def precision_overrides(setup: Setup) -> dict:
    """TransformerConfig fields for the setup's dtype (fp32 is tiny_config's default)."""
    if setup.dtype == torch.float32:
        return {}
    return {"bf16": setup.dtype == torch.bfloat16, "fp16": setup.dtype == torch.float16,
            "params_dtype": setup.dtype, "pipeline_dtype": setup.dtype}


def attention_module(backend: str, setup: Setup):
    """The SlimPack core attention of `backend`, as a layer would build it."""
    config = tiny_config(num_layers=1, hidden_size=setup.heads * setup.head_dim, num_attention_heads=setup.heads,
                         num_query_groups=setup.groups, **precision_overrides(setup))
    return build_core_attention(backend, config).to(setup.device).eval()


# ---- inputs and the reference ----------------------------------------------------------------
@dataclass
class VarlenCase:
    """Packed queries [Tq, H, D] against (prefix + slice) keys/values [Tk, G, D], per segment."""

    q: Tensor
    k: Tensor
    v: Tensor
    grad: Tensor  # output gradient [Tq, H * D]
    cu_q: Tensor
    cu_kv: Tensor
    max_q: int
    max_kv: int

    def to(self, dtype: torch.dtype) -> "VarlenCase":
        return VarlenCase(*(getattr(self, f.name).to(dtype) if f.name in ("q", "k", "v", "grad")
                            else getattr(self, f.name) for f in fields(self)))


def varlen_case(segments, setup: Setup, seed: int) -> VarlenCase:
    """segments: (KV prefix length, query count) per segment; random inputs in the setup's dtype."""
    q_lens = [queries for _, queries in segments]
    kv_lens = [prefix + queries for prefix, queries in segments]
    generator = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(setup.device, setup.dtype)

    return VarlenCase(
        q=rand(sum(q_lens), setup.heads, setup.head_dim), k=rand(sum(kv_lens), setup.groups, setup.head_dim),
        v=rand(sum(kv_lens), setup.groups, setup.head_dim), grad=rand(sum(q_lens), setup.heads * setup.head_dim),
        cu_q=cu_seqlens(q_lens, setup.device), cu_kv=cu_seqlens(kv_lens, setup.device),
        max_q=max(q_lens), max_kv=max(kv_lens),
    )


def masked_softmax_attention(q, k, v, cu_q, cu_kv, max_q=None, max_kv=None) -> Tensor:
    """Reference: softmax(q k^T / sqrt(d) + mask) v per segment, query i of lq seeing keys
    [0, i + lk - lq] (bottom-right causal). Independent of the runtime's kernels."""
    scale = q.shape[-1] ** -0.5
    bounds_q, bounds_kv = cu_q.tolist(), cu_kv.tolist()
    outputs = []
    for i in range(len(bounds_q) - 1):
        qs = q[bounds_q[i]:bounds_q[i + 1]]
        ks, vs = k[bounds_kv[i]:bounds_kv[i + 1]], v[bounds_kv[i]:bounds_kv[i + 1]]
        repeat = qs.shape[1] // ks.shape[1]
        ks, vs = ks.repeat_interleave(repeat, dim=1), vs.repeat_interleave(repeat, dim=1)
        lq, lk = qs.shape[0], ks.shape[0]
        visible = torch.arange(lk, device=q.device)[None, :] <= torch.arange(lq, device=q.device)[:, None] + (lk - lq)
        scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        outputs.append(torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), vs))
    out = torch.cat(outputs)
    return out.reshape(out.shape[0], -1)


@contextlib.contextmanager
def exact_fp32():
    """fp32 matmuls in full precision (no TF32) for the reference."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def forward_backward(attend, case: VarlenCase) -> dict[str, Tensor]:
    """Output and q/k/v gradients of `attend(q, k, v, cu_q, cu_kv, max_q, max_kv) -> [Tq, H*D]`."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (case.q, case.k, case.v))
    out = attend(q, k, v, case.cu_q, case.cu_kv, case.max_q, case.max_kv)
    out.backward(case.grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def tensor_errors(got: dict[str, Tensor], reference: dict[str, Tensor]) -> dict[str, dict]:
    """Per tensor: max |got - ref| and that divided by max |ref|."""
    errors = {}
    for name, ref in reference.items():
        ref = ref.float()
        diff = float((got[name].float() - ref).abs().max())
        errors[name] = {"max_abs": diff, "max_rel": diff / max(float(ref.abs().max()), 1e-30)}
    return errors


def worst(errors: dict[str, dict]) -> tuple[str, float]:
    """(tensor name, its relative error) of the worst tensor; NaN/inf counts as infinitely wrong."""
    name, value = max(((n, e["max_rel"] if math.isfinite(e["max_rel"]) else math.inf) for n, e in errors.items()),
                      key=lambda item: item[1])
    return name, value


def judged(name: str, errors: dict, tolerance: float, what: str, details: dict) -> Check:
    which, value = worst(errors)
    status = PASS if value <= tolerance else FAIL
    relation = "<=" if status == PASS else ">"
    summary = f"{what}: worst rel err {value:.1e} ({which}) {relation} tol {tolerance:.0e}"
    clean = {n: {k: finite(x) for k, x in e.items()} for n, e in errors.items()}
    return Check(name, status, summary, {**details, "tolerance": tolerance, "errors": clean})


# ---- section 2: each backend against the reference ------------------------------------------
def check_attention(backend: str, setup: Setup) -> Check:
    """Sliced THD attention (KV prefixes, GQA) forward and backward vs the fp32 reference."""
    case = varlen_case(setup.attention_segments, setup, seed=1)
    got = forward_backward(attention_module(backend, setup)._attend, case)
    with exact_fp32():
        reference = forward_backward(masked_softmax_attention, case.to(torch.float32))
    details = {"backend": backend, "dtype": setup.precision, "reference": REFERENCE,
               "segments": [{"prefix": p, "queries": n} for p, n in setup.attention_segments],
               "heads": setup.heads, "kv_groups": setup.groups, "head_dim": setup.head_dim}
    return judged(f"attention[{backend}]", tensor_errors(got, reference), setup.tolerances.attention,
                  f"{setup.precision} out/dq/dk/dv vs fp32 masked softmax", details)


# ---- section 3: DP-Merge's position runs against the unmerged call --------------------------
def merged_forward_backward(module, pack: MicroPack, case: VarlenCase, group_size: int) -> dict[str, Tensor]:
    """Every member's share of the MicroPack through the context-parallel kernel path
    (`_attend_positions`: runs of consecutive positions, keys gathered per run), assembled in
    pack order; K/V gradients summed over members (what the reduce-scatter delivers)."""
    device = case.q.device
    out = case.grad.new_zeros(case.grad.shape)
    dq = torch.zeros_like(case.q)
    dk, dv = (torch.zeros(t.shape, dtype=torch.float32, device=device) for t in (case.k, case.v))
    for rank in range(group_size):
        layout, local, per_slice = build_layout(pack, None, group_size, rank, device)
        local = local.to(device)
        q, k, v = (t.clone().requires_grad_() for t in (case.q[local], case.k, case.v))
        member_out = module._attend_positions(q, k, v, cu_seqlens(per_slice, device), case.cu_kv,
                                              layout.local_positions)
        member_out.backward(case.grad[local])
        grad_q, grad_k, grad_v = (cast(torch.Tensor, t.grad) for t in (q, k, v))  # set by backward()
        out[local], dq[local] = member_out.detach(), grad_q
        dk += grad_k.float()
        dv += grad_v.float()
    return {"out": out, "dq": dq, "dk": dk, "dv": dv}


def check_dp_merge(backend: str, setup: Setup) -> Check:
    """A merged MicroPack (prefixes, long slices split zigzag, short ones dealt round-robin) for
    each group size vs the same MicroPack unmerged, same backend and dtype."""
    pack = MicroPack([Slice(*piece) for piece in setup.merge_slices])
    case = varlen_case([(s.start, s.length) for s in pack.slices], setup, seed=2)
    module = attention_module(backend, setup)
    unmerged = forward_backward(module._attend, case)
    errors = {}
    for k in setup.merge_group_sizes:
        merged = merged_forward_backward(module, pack, case, k)
        errors.update({f"{name}@k={k}": e for name, e in tensor_errors(merged, unmerged).items()})
    details = {"backend": backend, "dtype": setup.precision, "group_sizes": list(setup.merge_group_sizes),
               "slices": [[s.sample_id, s.start, s.end] for s in pack.slices]}
    sizes = "/".join(map(str, setup.merge_group_sizes))
    return judged(f"dp_merge[{backend}]", errors, setup.tolerances.merge,
                  f"position runs over k={sizes} members vs unmerged", details)


# ---- section 5: slicing overhead of the attention kernel ------------------------------------
def overhead_cases(setup: Setup) -> tuple[VarlenCase, list[VarlenCase]]:
    """The documents whole (one call) and cut into slices (call r: every document's r-th slice
    with its prefix): the same attention pairs either way."""
    size = setup.overhead_slice
    whole = varlen_case([(0, n) for n in setup.overhead_lengths], setup, seed=3)
    rounds = max(-(-n // size) for n in setup.overhead_lengths)
    sliced = [varlen_case([(r * size, min(n, (r + 1) * size) - r * size) for n in setup.overhead_lengths
                           if r * size < n], setup, seed=4 + r) for r in range(rounds)]
    return whole, sliced


def attention_seconds(attend, cases: list[VarlenCase], setup: Setup) -> float:
    """Median forward + backward time of `attend` over all `cases`."""
    leaves = [tuple(t.detach().clone().requires_grad_() for t in (c.q, c.k, c.v)) for c in cases]

    def run():
        for case, (q, k, v) in zip(cases, leaves):
            q.grad = k.grad = v.grad = None
            attend(q, k, v, case.cu_q, case.cu_kv, case.max_q, case.max_kv).backward(case.grad)

    return median_seconds(run, setup.repeats, setup.device)


def measure_overhead(backend: str, setup: Setup) -> Check:
    attend = attention_module(backend, setup)._attend
    whole, sliced = overhead_cases(setup)
    whole_s, sliced_s = attention_seconds(attend, [whole], setup), attention_seconds(attend, sliced, setup)
    ratio = sliced_s / whole_s
    timer = "torch.cuda.synchronize + perf_counter" if setup.is_gpu else "perf_counter"
    summary = (f"sliced {sliced_s * 1e3:.2f} ms vs whole {whole_s * 1e3:.2f} ms: overhead ratio {ratio:.2f} "
               f"({len(sliced)} calls of <= {setup.overhead_slice} queries vs 1 call; fwd+bwd, "
               f"median of {setup.repeats})")
    return Check(f"overhead[{backend}]", MEASURED, summary, {
        "backend": backend, "dtype": setup.precision, "documents": list(setup.overhead_lengths),
        "slice_tokens": setup.overhead_slice, "whole_s": whole_s, "sliced_s": sliced_s, "ratio": finite(ratio),
        "repeats": setup.repeats, "timer": timer})
