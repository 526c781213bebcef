"""Attention kernels and backend choice (docs/design.md section 3).

Every kernel takes packed queries q [Tq, H, D] and keys/values k, v [Tk, G, D] with varlen
boundaries (cu_q, cu_kv) and computes bottom-right causal attention per segment (query i of a
segment of lq queries against lk keys sees keys [0, i + lk - lq]: a slice's queries see their
document's prefix and, causally, their own tokens):
  1. Transformer Engine fused attention, THD, `padding_causal_bottom_right` (in core.py: it is a
     megatron-core module subclass; its unfused path is refused, `UnfusedAttentionError`);
  2. flash-attn `flash_attn_varlen_func(causal=True)` (bottom-right since 2.1);
  3. torch. On a GPU (sm80+, bf16/fp16, no dropout, not deterministic) where PyTorch has
     `torch.nn.attention.varlen.varlen_attn` (its bundled flash-attention 2, bottom-right causal
     like flash-attn >= 2.1), one fused varlen call per MicroPack. Otherwise block by block:
     `scaled_dot_product_attention(is_causal=True)` per segment without a prefix; per segment with
     one, on a GPU SDPA with `causal_lower_right` (fused), on the CPU the prefix block (unmasked)
     and the own block (causal) combined by log-sum-exp (`SplitPrefixAttention`, torch's fused CPU
     kernel), and with explicit tiles or deterministic mode tiles with an online softmax
     (`PrefixCausalAttention`); no query x key mask is built. CPU, tests, the probe's reference
     (in fp32, which never takes the varlen call), and a fused GPU path needing no extra package.
Every backend takes the softmax scale; flash-attn also Megatron's deterministic mode (TE reads
NVTE_ALLOW_NONDETERMINISTIC_ALGO, the torch kernel is deterministic). Sliding windows and softmax
variants are refused (`check_attention_options`).
"""
from __future__ import annotations

import importlib.util
import inspect
from functools import lru_cache
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ...errors import SlimPackError

BACKENDS = ("te", "flash", "torch")  # fastest first
PACKAGE_OF = {"te": "transformer_engine", "flash": "flash_attn"}
INSTALL_HINT = {"te": "pip install transformer-engine[pytorch]",
                 "flash": "pip install flash-attn --no-build-isolation"}

Kernel = Callable[..., Tensor]


class BackendUnavailable(RuntimeError):
    """An attention backend was requested that this machine cannot run."""


class UnsupportedAttentionOption(SlimPackError):
    """A Megatron attention option the sliced core attention does not implement on every backend."""


class UnfusedAttentionError(SlimPackError):
    """An attention path that would build the full query x key score matrix (e.g. Transformer
    Engine's unfused attention) was about to run: at long context it does not fit in memory."""


class NoFusedAttentionBackend(SlimPackError):
    """No fused attention backend runs this model's sliced attention on this GPU; only unfused paths
    (the torch kernel) are left, too slow and memory-hungry for training at long context."""


FUSED_INSTALL_HINT = ("Install flash-attn >= 2.1 (pip install flash-attn --no-build-isolation) or Transformer "
                      "Engine with cuDNN >= 9.6, or a torch with torch.nn.attention.varlen on an sm80+ GPU; or "
                      "choose the attention backend 'torch' explicitly to run it anyway (tests, debugging)")


def check_attention_options(config) -> None:
    """Refuse the TransformerConfig attention options that not every backend honours with a KV
    prefix: sliding windows (`window_size`) and softmax variants other than vanilla
    (`softmax_type`, which adds a sink term to the softmax denominator)."""
    problems = []
    window = getattr(config, "window_size", None)
    if window is not None:
        problems.append(f"window_size={tuple(window)} (sliding-window attention) is not supported by the sliced "
                        "core attention: remove --window-size (and --window-attn-skip-freq)")
    softmax_type = getattr(config, "softmax_type", "vanilla") or "vanilla"
    if softmax_type != "vanilla":
        problems.append(f"softmax_type={softmax_type!r} is not supported by the sliced core attention: use "
                        "--softmax-type vanilla")
    if problems:
        raise UnsupportedAttentionOption("; ".join(problems))


def cu_seqlens(lengths: Sequence[int], device) -> Tensor:
    """Cumulative segment boundaries [0, l0, l0 + l1, ...] as int32 (the varlen kernels' format)."""
    return torch.tensor([0, *lengths], dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def segment_attention(qs: Tensor, ks: Tensor, vs: Tensor, mask: Tensor | None, scale, dropout_p: float) -> Tensor:
    """One segment's queries [Tq, H, D] against its keys/values [Tk, G, D] with torch SDPA; no
    mask means plain causal. Inputs go in as [1, H, T, D]: on CPU only 4-D inputs reach the fused
    flash kernel (3-D ones take the math path: ~4x slower and it saves the Tq x Tk probabilities)."""
    def heads_first(x: Tensor) -> Tensor:
        return x.transpose(0, 1).unsqueeze(0)

    out = F.scaled_dot_product_attention(
        heads_first(qs), heads_first(ks), heads_first(vs), attn_mask=mask, is_causal=mask is None,
        dropout_p=dropout_p, scale=scale, enable_gqa=ks.shape[1] != qs.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


# ---- the torch kernel's blockwise bottom-right causal attention ------------------------------
# Tile sizes of `PrefixCausalAttention`: the scores of one tile (heads x QUERY_BLOCK x KEY_BLOCK
# in fp32) are the largest transient it allocates, whatever the segment's lengths.
QUERY_BLOCK = 256
KEY_BLOCK = 1024


def _rng_state(device: torch.device) -> Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _tiles(lq: int, lk: int, query_block: int, key_block: int):
    """(query rows [a, b), key rows [c, e), whether the tile needs its own causal mask) of a
    bottom-right causal segment, in a fixed order (forward and backward draw dropout masks in it).
    Query i sees keys [0, i + lk - lq]: tiles wholly above the diagonal are skipped, tiles wholly
    below it are unmasked."""
    prefix = lk - lq
    for a in range(0, lq, query_block):
        b = min(a + query_block, lq)
        for c in range(0, prefix + b, key_block):
            e = min(c + key_block, prefix + b)
            yield a, b, c, e, e - 1 > prefix + a


def _tile_scores(qt: Tensor, kt: Tensor, scale: float, a: int, b: int, c: int, e: int, prefix: int,
                 masked: bool) -> Tensor:
    """Scaled fp32 scores of query rows [a, b) against key rows [c, e) ([G, r, b - a, e - c]),
    -inf where a key lies after the query's position (a mask of this tile only)."""
    scores = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    if masked:
        horizon = torch.arange(a, b, device=qt.device)[:, None] + prefix
        hidden = torch.arange(c, e, device=qt.device)[None, :] > horizon
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _grouped(x: Tensor, groups: int) -> Tensor:
    """[T, H, D] -> [G, H / G, T, D] (query head h uses K/V group h // (H / G), as in SDPA's GQA)."""
    return x.reshape(x.shape[0], groups, x.shape[1] // groups, x.shape[2]).permute(1, 2, 0, 3)


class PrefixCausalAttention(torch.autograd.Function):
    """Exact bottom-right causal attention of one segment (queries [lq, H, D] against keys and
    values [lk, G, D], lk >= lq) computed tile by tile with an online softmax, forward and
    backward (the flash-attention recurrence in torch). It never holds the lq x lk scores or a
    mask of that size: only one tile of scores at a time, and it saves for backward its inputs,
    its output and the fp32 log-sum-exp per query and head. Deterministic: fixed summation order.
    Dropout masks are drawn per tile from the current RNG stream; backward redraws them from the
    state saved in forward."""

    @staticmethod
    def forward(ctx, q, k, v, scale, dropout_p, query_block, key_block):
        lq, heads, _ = q.shape
        lk, groups, dim_v = v.shape
        prefix = lk - lq
        acc_dtype = torch.promote_types(q.dtype, torch.float32)  # fp32, or fp64 for fp64 inputs
        qg, kg, vg = _grouped(q, groups), k.permute(1, 0, 2).unsqueeze(1), v.permute(1, 0, 2).unsqueeze(1)
        out = torch.empty(groups, heads // groups, lq, dim_v, dtype=acc_dtype, device=q.device)
        lse = torch.empty(groups, heads // groups, lq, dtype=acc_dtype, device=q.device)
        rng = _rng_state(q.device) if dropout_p > 0 else None
        row_max = row_sum = acc = None
        for a, b, c, e, masked in _tiles(lq, lk, query_block, key_block):
            if c == 0:
                shape = (groups, heads // groups, b - a)
                row_max = torch.full(shape, float("-inf"), dtype=acc_dtype, device=q.device)
                row_sum = torch.zeros(shape, dtype=acc_dtype, device=q.device)
                acc = torch.zeros(*shape, dim_v, dtype=acc_dtype, device=q.device)
            scores = _tile_scores(qg[:, :, a:b].to(acc_dtype), kg[:, :, c:e].to(acc_dtype), scale, a, b, c, e,
                                  prefix, masked)
            new_max = torch.maximum(row_max, scores.amax(-1))
            probs = torch.exp(scores - new_max[..., None])
            correction = torch.exp(row_max - new_max)
            row_sum = row_sum * correction + probs.sum(-1)
            if dropout_p > 0:
                probs = probs * (torch.rand_like(probs) >= dropout_p) / (1 - dropout_p)
            acc = acc * correction[..., None] + torch.matmul(probs, vg[:, :, c:e].to(acc_dtype))
            row_max = new_max
            if e == prefix + b:  # the query block's last tile
                out[:, :, a:b] = acc / row_sum[..., None]
                lse[:, :, a:b] = row_max + torch.log(row_sum)
        out = out.permute(2, 0, 1, 3).reshape(lq, heads, dim_v).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (scale, dropout_p, query_block, key_block, rng)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        scale, dropout_p, query_block, key_block, rng = ctx.options
        lq, heads, _ = q.shape
        lk, groups, _ = v.shape
        prefix = lk - lq
        acc_dtype = lse.dtype
        qg, kg, vg = _grouped(q, groups), k.permute(1, 0, 2).unsqueeze(1), v.permute(1, 0, 2).unsqueeze(1)
        dout = _grouped(grad_out, groups).to(acc_dtype)
        delta = (dout * _grouped(out, groups).to(acc_dtype)).sum(-1)  # rowsum(dO * O) per query and head
        dq = torch.zeros(qg.shape, dtype=acc_dtype, device=q.device)
        dk = torch.zeros(groups, lk, k.shape[-1], dtype=acc_dtype, device=q.device)
        dv = torch.zeros(groups, lk, v.shape[-1], dtype=acc_dtype, device=q.device)
        with torch.random.fork_rng(devices=[q.device] if q.device.type == "cuda" else [],
                                   enabled=dropout_p > 0):
            if rng is not None:
                _set_rng_state(rng, q.device)
            for a, b, c, e, masked in _tiles(lq, lk, query_block, key_block):
                qt, kt, vt = (x.to(acc_dtype) for x in (qg[:, :, a:b], kg[:, :, c:e], vg[:, :, c:e]))
                probs = torch.exp(_tile_scores(qt, kt, scale, a, b, c, e, prefix, masked) - lse[:, :, a:b, None])
                dprobs = torch.matmul(dout[:, :, a:b], vt.transpose(-1, -2))
                kept = probs
                if dropout_p > 0:
                    keep = (torch.rand_like(probs) >= dropout_p) / (1 - dropout_p)
                    kept, dprobs = probs * keep, dprobs * keep
                dv[:, c:e] += torch.einsum("grqk,grqd->gkd", kept, dout[:, :, a:b])
                dscores = probs * (dprobs - delta[:, :, a:b, None]) * scale
                dq[:, :, a:b] += torch.matmul(dscores, kt)
                dk[:, c:e] += torch.einsum("grqk,grqd->gkd", dscores, qt)
        dq = dq.permute(2, 0, 1, 3).reshape(q.shape).to(q.dtype)
        return (dq, dk.permute(1, 0, 2).to(k.dtype), dv.permute(1, 0, 2).to(v.dtype),
                None, None, None, None)


def _cpu_flash_ops():
    """torch's fused CPU flash-attention forward (returning the log-sum-exp) and backward, or None
    where this torch lacks them."""
    aten = torch.ops.aten
    try:
        return (aten._scaled_dot_product_flash_attention_for_cpu,
                aten._scaled_dot_product_flash_attention_for_cpu_backward)
    except (AttributeError, RuntimeError):
        return None


class SplitPrefixAttention(torch.autograd.Function):
    """Exact bottom-right causal attention of one segment on the CPU in two fused blocks: queries
    against the prefix keys (unmasked) and against their own keys (causal, a square), combined by
    their log-sum-exps. Backward runs the fused backward of each block with the combined output
    and log-sum-exp (what the combined softmax's gradient needs). Neither block has a mask; the
    fused CPU kernel holds one tile of scores at a time. Saves the inputs, the output and the
    log-sum-exp (fp32) per query and head, as `PrefixCausalAttention` does."""

    @staticmethod
    def forward(ctx, q, k, v, scale):
        forward_op, _ = _cpu_flash_ops()
        prefix = k.shape[0] - q.shape[0]
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out_prefix, lse_prefix = forward_op(qh, kh[:, :, :prefix], vh[:, :, :prefix], 0.0, False, scale=scale)
        out_own, lse_own = forward_op(qh, kh[:, :, prefix:], vh[:, :, prefix:], 0.0, True, scale=scale)
        lse = torch.logaddexp(lse_prefix, lse_own)
        acc_dtype = lse.dtype
        out = (out_prefix.to(acc_dtype) * torch.exp(lse_prefix - lse)[..., None]
               + out_own.to(acc_dtype) * torch.exp(lse_own - lse)[..., None]).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out.squeeze(0).transpose(0, 1)

    @staticmethod
    def backward(ctx, grad_out):
        _, backward_op = _cpu_flash_ops()
        q, k, v, out, lse = ctx.saved_tensors
        prefix = k.shape[0] - q.shape[0]
        qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        grad = grad_out.transpose(0, 1).unsqueeze(0).contiguous()
        dq_prefix, dk_prefix, dv_prefix = backward_op(grad, qh, kh[:, :, :prefix], vh[:, :, :prefix], out, lse,
                                                      0.0, False, scale=ctx.scale)
        dq_own, dk_own, dv_own = backward_op(grad, qh, kh[:, :, prefix:], vh[:, :, prefix:], out, lse,
                                             0.0, True, scale=ctx.scale)

        def tokens_first(x: Tensor) -> Tensor:
            return x.squeeze(0).transpose(0, 1)

        return (tokens_first(dq_prefix + dq_own), tokens_first(torch.cat([dk_prefix, dk_own], dim=2)),
                tokens_first(torch.cat([dv_prefix, dv_own], dim=2)), None)


def lower_right_attention(qs: Tensor, ks: Tensor, vs: Tensor, scale: float, dropout_p: float) -> Tensor:
    """One segment with a KV prefix through SDPA with a bottom-right causal bias (`causal_lower_right`),
    which torch runs with a fused GPU kernel and no materialized mask. K/V heads are repeated for GQA
    (the bias path takes no `enable_gqa`)."""
    from torch.nn.attention.bias import causal_lower_right

    if ks.shape[1] != qs.shape[1]:
        ks, vs = (x.repeat_interleave(qs.shape[1] // x.shape[1], dim=1) for x in (ks, vs))
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0) for x in (qs, ks, vs))
    out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=causal_lower_right(qs.shape[0], ks.shape[0]),
                                         dropout_p=dropout_p, scale=scale)
    return out.squeeze(0).transpose(0, 1)


def prefix_causal_attention(qs: Tensor, ks: Tensor, vs: Tensor, scale: float, dropout_p: float = 0.0, *,
                            query_block: int | None = None, key_block: int | None = None) -> Tensor:
    """Bottom-right causal attention of one segment with a KV prefix, block by block (no dense
    mask): on the CPU without dropout two fused blocks (`SplitPrefixAttention`), on a GPU SDPA's
    fused bottom-right causal kernel (`lower_right_attention`), otherwise tiles
    (`PrefixCausalAttention`; explicit tile sizes also select it)."""
    tiles_asked = query_block is not None or key_block is not None
    if qs.device.type == "cpu" and dropout_p == 0 and not tiles_asked and _cpu_flash_ops() is not None:
        return SplitPrefixAttention.apply(qs, ks, vs, float(scale))
    if qs.device.type == "cuda" and not tiles_asked:
        return lower_right_attention(qs, ks, vs, float(scale), float(dropout_p))
    return PrefixCausalAttention.apply(qs, ks, vs, float(scale), float(dropout_p),
                                       query_block or QUERY_BLOCK, key_block or KEY_BLOCK)


def _tiles_everywhere(device: torch.device, deterministic: bool) -> bool:
    """Whether the torch kernel runs every segment as tiles: deterministic mode off the CPU."""
    return bool(deterministic) and device.type != "cpu"


# ---- PyTorch's own varlen flash attention (GPU) ----------------------------------------------
def _torch_varlen_function():
    """`torch.nn.attention.varlen.varlen_attn`, or None where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def torch_varlen_runs_on(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the torch kernel takes PyTorch's fused varlen call for inputs of `dtype` on `device`
    (dropout and deterministic mode aside): a CUDA GPU of compute capability 8.0 or newer (its
    flash-attention 2 kernels), bf16 or fp16, and a torch that has `varlen_attn`."""
    device = torch.device(device)
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and torch.cuda.is_available()
            and _sm80_or_newer(device.index) and _torch_varlen_function() is not None)


@lru_cache(maxsize=None)
def _sm80_or_newer(index: int | None) -> bool:
    """Whether CUDA device `index` (None: the current one) has compute capability 8.0 or newer
    (cached: the torch kernel asks on every attention call)."""
    return torch.cuda.get_device_capability(index) >= (8, 0)


@lru_cache(maxsize=None)
def _parameters(function: Callable) -> frozenset[str]:
    """The keyword names `function` takes (cached: read on every attention call)."""
    return frozenset(inspect.signature(function).parameters)


def torch_varlen_attention(q, k, v, cu_q, cu_kv, max_q: int, max_kv: int, scale: float) -> Tensor:
    """One `varlen_attn` call over every segment, bottom-right causal (`window_size=(-1, 0)`, or
    `is_causal=True` in the torch releases that named it so); K/V heads repeated for GQA where the
    signature has no `enable_gqa`. The softmax scale is applied to q where it takes no `scale`."""
    varlen_attn = _torch_varlen_function()
    parameters = _parameters(varlen_attn)
    options: dict = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
    if "scale" in parameters:
        options["scale"] = scale
    else:
        q = q * (scale * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, cu_q.to(torch.int32), cu_kv.to(torch.int32), int(max_q), int(max_kv), **options)


def torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, dropout_p, bounds=None, deterministic=False):
    """The torch kernel (CPU, tests, the reference of the probe, and a fused GPU path): on a GPU
    where `torch_varlen_runs_on` and without dropout or deterministic mode, one fused varlen call;
    otherwise block by block: a segment without a KV prefix is one SDPA call with `is_causal`
    (plain causal), a segment with a prefix runs `prefix_causal_attention`; no query x key mask is
    ever built. `bounds`: cu_q and cu_kv as host ints where the caller has them (reading them back
    is a host sync). `deterministic` (Megatron's --deterministic-mode): on the CPU every path is
    deterministic; elsewhere every segment then runs the tiles (fixed summation order), not SDPA's
    or flash-attention's GPU backward."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    if not dropout_p and not deterministic and torch_varlen_runs_on(q.device, q.dtype):
        return torch_varlen_attention(q, k, v, cu_q, cu_kv, max_q, max_kv, float(scale))
    bounds_q, bounds_kv = bounds if bounds is not None else (None, None)
    bounds_q = bounds_q if bounds_q is not None else cu_q.tolist()
    bounds_kv = bounds_kv if bounds_kv is not None else cu_kv.tolist()
    tiled = _tiles_everywhere(q.device, deterministic)
    outputs = []
    for i in range(len(bounds_q) - 1):
        qs = q[bounds_q[i]:bounds_q[i + 1]]
        ks, vs = k[bounds_kv[i]:bounds_kv[i + 1]], v[bounds_kv[i]:bounds_kv[i + 1]]
        if tiled and qs.shape[0]:
            outputs.append(PrefixCausalAttention.apply(qs, ks, vs, float(scale), float(dropout_p),
                                                       QUERY_BLOCK, KEY_BLOCK))
        elif qs.shape[0] == 0 or qs.shape[0] == ks.shape[0]:
            outputs.append(segment_attention(qs, ks, vs, None, scale, dropout_p))
        else:
            outputs.append(prefix_causal_attention(qs, ks, vs, scale, dropout_p))
    return torch.cat(outputs)


def flash_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, dropout_p, bounds=None, deterministic=False):
    """flash-attn 2: `causal=True` is bottom-right aligned since 2.1; GQA native. It reads the
    boundaries on the device (`bounds` unused). `deterministic`: flash-attn's backward then
    accumulates dQ without atomics (Megatron's --deterministic-mode)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_q.to(torch.int32), cu_kv.to(torch.int32), max_q, max_kv,
        dropout_p=dropout_p, softmax_scale=scale, causal=True, deterministic=bool(deterministic),
    )


KERNELS: dict[str, Kernel] = {"torch": torch_kernel, "flash": flash_kernel}


def takes_option(kernel: Kernel, name: str) -> bool:
    """Whether `kernel` accepts the keyword `name` (a named parameter or **kwargs)."""
    try:
        parameters = inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False
    return name in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


def takes_host_bounds(kernel: Kernel) -> bool:
    """Whether `kernel` accepts the boundaries as host ints (`bounds=`)."""
    return takes_option(kernel, "bounds")


# ---- backend choice ------------------------------------------------------------------------
def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def te_attention_importable() -> bool:
    """TE and megatron-core's TE extension both import (the TE backend's module needs both)."""
    if not _installed(PACKAGE_OF["te"]):
        return False
    try:
        from megatron.core.extensions.transformer_engine import TEDotProductAttention  # noqa: F401
    except ImportError:
        return False
    return True


FLASH_MIN_VERSION = (2, 1)  # causal=True is bottom-right aligned from 2.1 on


def flash_version_ok() -> bool:
    """flash-attn >= 2.1: older versions align causal masks top-left, which silently drops a
    slice's prefix from its queries' view."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        text = version("flash-attn")
    except PackageNotFoundError:
        return False
    parts = [int("".join(ch for ch in piece if ch.isdigit()) or 0) for piece in text.split(".")[:2]]
    return tuple(parts) >= FLASH_MIN_VERSION


def torch_fused_on_gpu() -> bool:
    """Whether the torch kernel is fused on this machine's GPU in bf16 (`torch_varlen_runs_on`)."""
    return torch.cuda.is_available() and torch_varlen_runs_on(torch.device("cuda"), torch.bfloat16)


def available_backends() -> list[str]:
    """Backends this machine can run, fastest first."""
    gpu = torch.cuda.is_available()
    found = [name for name in ("te", "flash") if gpu and _installed(PACKAGE_OF[name])]
    if "te" in found and not te_attention_importable():
        found.remove("te")
    if "flash" in found and not flash_version_ok():
        found.remove("flash")
    return found + ["torch"]


def resolve_backend(backend: str = "auto") -> str:
    """'auto' -> the fastest available (on a GPU a fused one: NoFusedAttentionBackend where only
    the torch kernel is there); an explicit name is checked, with a clear error."""
    if backend == "auto":
        fastest = available_backends()[0]
        if fastest == "torch" and torch.cuda.is_available() and not torch_fused_on_gpu():
            raise NoFusedAttentionBackend("attention backend 'auto' on a GPU: neither flash-attn >= 2.1 nor a "
                                          "Transformer Engine whose megatron-core extension imports is installed, "
                                          "and the torch kernel is not fused here (it needs an sm80+ GPU and a "
                                          "torch with torch.nn.attention.varlen). " + FUSED_INSTALL_HINT)
        return fastest
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from auto, {', '.join(BACKENDS)}")
    if backend != "torch":
        if not _installed(PACKAGE_OF[backend]):
            raise BackendUnavailable(
                f"attention backend {backend!r} needs the package {PACKAGE_OF[backend]!r}: {INSTALL_HINT[backend]}"
            )
        if not torch.cuda.is_available():
            raise BackendUnavailable(f"attention backend {backend!r} needs a CUDA GPU; use backend='torch' on CPU")
        if backend == "flash" and not flash_version_ok():
            raise BackendUnavailable("attention backend 'flash' needs flash-attn >= 2.1 (older versions align causal "
                                     "masks top-left, wrong for a slice's prefix): pip install 'flash-attn>=2.1'")
        if backend == "te" and not te_attention_importable():
            raise BackendUnavailable("attention backend 'te': megatron.core.extensions.transformer_engine does not "
                                     "import with the installed transformer-engine; use backend='flash' or 'torch'")
    return backend
