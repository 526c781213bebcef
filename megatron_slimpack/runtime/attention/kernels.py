"""Attention kernels and backend choice (design.md section 3).

Every kernel takes packed queries q [Tq, H, D] and keys/values k, v [Tk, G, D] with varlen
boundaries (cu_q, cu_kv) and computes bottom-right causal attention per segment (query i of a
segment of lq queries against lk keys sees keys [0, i + lk - lq]: a slice's queries see their
document's prefix and, causally, their own tokens):
  1. Transformer Engine fused attention, THD, `padding_causal_bottom_right` (in attention.py:
     it is a megatron-core module subclass);
  2. flash-attn `flash_attn_varlen_func(causal=True)` (bottom-right since 2.1);
  3. torch reference (`scaled_dot_product_attention` per segment): CPU and tests.
"""
from __future__ import annotations

import importlib.util
import inspect
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

BACKENDS = ("te", "flash", "torch")  # fastest first
_PACKAGE_OF = {"te": "transformer_engine", "flash": "flash_attn"}
_INSTALL_HINT = {"te": "pip install transformer-engine[pytorch]",
                 "flash": "pip install flash-attn --no-build-isolation"}

Kernel = Callable[..., Tensor]


class BackendUnavailable(RuntimeError):
    """An attention backend was requested that this machine cannot run."""


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


def torch_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, dropout_p, bounds=None):
    """Reference: one scaled_dot_product_attention per segment (CPU and tests). `bounds`: cu_q
    and cu_kv as host ints where the caller has them (reading them back is a host sync)."""
    bounds_q, bounds_kv = bounds if bounds is not None else (None, None)
    bounds_q = bounds_q if bounds_q is not None else cu_q.tolist()
    bounds_kv = bounds_kv if bounds_kv is not None else cu_kv.tolist()
    outputs = []
    for i in range(len(bounds_q) - 1):
        qs = q[bounds_q[i]:bounds_q[i + 1]]
        ks, vs = k[bounds_kv[i]:bounds_kv[i + 1]], v[bounds_kv[i]:bounds_kv[i + 1]]
        lq, lk = qs.shape[0], ks.shape[0]
        # Bottom-right: query i sees keys [0, i + lk - lq]; with no prefix this is plain causal.
        mask = None if lq == lk else torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(lk - lq)
        outputs.append(segment_attention(qs, ks, vs, mask, scale, dropout_p))
    return torch.cat(outputs)


def flash_kernel(q, k, v, cu_q, cu_kv, max_q, max_kv, scale, dropout_p, bounds=None):
    """flash-attn 2: `causal=True` is bottom-right aligned since 2.1; GQA native. It reads the
    boundaries on the device (`bounds` unused)."""
    from flash_attn import flash_attn_varlen_func

    return flash_attn_varlen_func(
        q, k, v, cu_q.to(torch.int32), cu_kv.to(torch.int32), max_q, max_kv,
        dropout_p=dropout_p, softmax_scale=scale, causal=True,
    )


KERNELS: dict[str, Kernel] = {"torch": torch_kernel, "flash": flash_kernel}


def takes_host_bounds(kernel: Kernel) -> bool:
    """Whether `kernel` accepts the boundaries as host ints (`bounds=`)."""
    try:
        return "bounds" in inspect.signature(kernel).parameters
    except (TypeError, ValueError):
        return False


# ---- backend choice ------------------------------------------------------------------------
def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def te_attention_importable() -> bool:
    """TE and megatron-core's TE extension both import (the TE backend's module needs both)."""
    if not _installed(_PACKAGE_OF["te"]):
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


def available_backends() -> list[str]:
    """Backends this machine can run, fastest first."""
    gpu = torch.cuda.is_available()
    found = [name for name in ("te", "flash") if gpu and _installed(_PACKAGE_OF[name])]
    if "te" in found and not te_attention_importable():
        found.remove("te")
    if "flash" in found and not flash_version_ok():
        found.remove("flash")
    return found + ["torch"]


def resolve_backend(backend: str = "auto") -> str:
    """'auto' -> the fastest available; an explicit name is checked, with a clear error."""
    if backend == "auto":
        return available_backends()[0]
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose from auto, {', '.join(BACKENDS)}")
    if backend != "torch":
        if not _installed(_PACKAGE_OF[backend]):
            raise BackendUnavailable(
                f"attention backend {backend!r} needs the package {_PACKAGE_OF[backend]!r}: {_INSTALL_HINT[backend]}"
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
