"""`slimpack profile --kernels`: this device's kernel speeds, measured, in the form of the published
tables the analytic cost model is fitted to (costmodel/kernels.py), so a profile replaces them.

What is timed (median of `repeats` after a warm-up; on a GPU synchronized around each run), in the
profile's dtype (bf16 on a GPU, fp32 on a CPU):

* GEMM: a square `torch.matmul` of side n, TFLOP/s = 2 n^3 / seconds: the table the GEMM curve
  `f(d) = d / (d + half_dim)` is fitted to (a layer's GEMMs are priced from it by shape).
* attention, for each backend of the runtime that runs here (`runtime.attention.kernels.KERNELS`:
  torch everywhere, flash-attn 2 on a GPU where it is installed): `pack_tokens` tokens of equal
  causal documents of each length L through the runtime's own kernel (THD layout, cu_seqlens),
  forward, and forward plus backward; TFLOP/s counted as the published tables count them
  (4 x pairs x head_dim x heads forward, 2.5x that backward).
  Transformer Engine's fused attention (`te`) is a megatron-core module, not a kernel function of
  the runtime, so it is not measured here: its published cuDNN table stays.

The file: {"format": KERNEL_PROFILE_FORMAT, "environment": {...}, "tables": [...], "fit": [...]};
each table says where it was measured. `--cost-model FILE` (plan, simulate, compare, cost, the
Megatron integration) prices with the analytic model of `--hardware`, each measured table in place
of the one it measures; what was not measured keeps its published rate.
"""
from __future__ import annotations

import importlib.metadata as metadata
import json
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..costmodel.kernels import KERNEL_PROFILE_FORMAT, PublishedTable, table_fit
from ..runtime.attention.kernels import KERNELS, available_backends
from .selftest.common import median_seconds

TERA = 1e12


@dataclass(frozen=True)
class KernelGrid:
    """What is measured: GEMM sides, document lengths, and the attention shape (heads of one
    device's share of a layer; head_dim as the published tables, 128)."""

    gemm_sizes: tuple[int, ...] = (1024, 2048, 4096, 8192)
    doc_lengths: tuple[int, ...] = (512, 1024, 2048, 4096, 8192, 16384)
    pack_tokens: int = 16384
    heads: int = 32
    head_dim: int = 128

    def __post_init__(self) -> None:
        if len(self.gemm_sizes) < 2 or len(self.doc_lengths) < 2:
            raise ValueError("a kernel grid needs at least 2 GEMM sizes and 2 document lengths (a curve is fitted)")
        if max(self.doc_lengths) > self.pack_tokens:
            raise ValueError(f"document length {max(self.doc_lengths)} exceeds pack_tokens {self.pack_tokens}")


# Shapes a CPU measures in seconds (the code path, tests).
QUICK_GRID = KernelGrid(gemm_sizes=(64, 128, 256), doc_lengths=(32, 64, 128), pack_tokens=256, heads=2, head_dim=32)


def _significant(tflops: float) -> float:
    """A measured rate to 4 significant digits (a CPU's rates are thousandths of a TFLOP/s: a fixed
    number of decimals would round them to zero)."""
    return float(f"{tflops:.4g}")


def _describe(device: torch.device, dtype: torch.dtype) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({platform.processor() or 'host'})"
    precision = str(dtype).removeprefix("torch.")
    return f"measured by `slimpack profile --kernels` on {name}, PyTorch {torch.__version__}, {precision}"


def measure_gemm(sizes, device: torch.device, dtype: torch.dtype, repeats: int) -> PublishedTable:
    rates = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)

        def multiply(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
            torch.matmul(a, b)

        seconds = median_seconds(multiply, repeats, device)
        rates.append(_significant(2.0 * n ** 3 / seconds / TERA))
    return PublishedTable("gemm", "matmul", "forward", False, 0, tuple(sizes), tuple(rates),
                          _describe(device, dtype), note="square torch.matmul")


def _attention_run(backend: str, length: int, grid: KernelGrid, device: torch.device,
                   dtype: torch.dtype) -> tuple[Callable[[], None], Callable[[], None]]:
    """(forward, forward+backward) of the runtime's `backend` kernel on equal causal documents."""
    documents = grid.pack_tokens // length
    tokens = documents * length
    q, k, v = (torch.randn(tokens, grid.heads, grid.head_dim, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    bounds = [i * length for i in range(documents + 1)]
    cu = torch.tensor(bounds, device=device, dtype=torch.int32)
    kernel = KERNELS[backend]
    scale = grid.head_dim ** -0.5

    def output() -> torch.Tensor:
        return kernel(q, k, v, cu, cu, length, length, scale, 0.0, bounds=(bounds, bounds))

    grad = torch.randn(tokens, grid.heads, grid.head_dim, device=device, dtype=dtype)

    def forward() -> None:
        output()

    def forward_backward() -> None:
        torch.autograd.grad(output(), (q, k, v), grad)

    return forward, forward_backward


def measure_attention(backend: str, grid: KernelGrid, device: torch.device, dtype: torch.dtype,
                      repeats: int) -> tuple[PublishedTable, PublishedTable]:
    """Forward and backward tables of one backend, by document length."""
    forward_rates, backward_rates = [], []
    for length in grid.doc_lengths:
        documents = grid.pack_tokens // length
        flops = 4.0 * documents * length * (length + 1) / 2 * grid.head_dim * grid.heads
        forward, forward_backward = _attention_run(backend, length, grid, device, dtype)
        forward_s = median_seconds(forward, repeats, device)
        # The backward alone: forward+backward less the forward, floored (noise on a tiny shape).
        backward_s = max(median_seconds(forward_backward, repeats, device) - forward_s, 1e-3 * forward_s)
        forward_rates.append(_significant(flops / forward_s / TERA))
        backward_rates.append(_significant(2.5 * flops / backward_s / TERA))
    source = _describe(device, dtype)
    note = f"the runtime's {backend} kernel, {grid.heads} heads, {grid.pack_tokens} tokens per call"
    return (PublishedTable("attention", backend, "forward", True, grid.head_dim, grid.doc_lengths,
                           tuple(forward_rates), source, note),
            PublishedTable("attention", backend, "backward", True, grid.head_dim, grid.doc_lengths,
                           tuple(backward_rates), source, note + "; causal backward"))


def measured_backends(device: torch.device) -> list[str]:
    """The runtime's kernel functions that run on `device` (te is a module: not measured here)."""
    usable = available_backends() if device.type == "cuda" else ["torch"]
    return [name for name in KERNELS if name in usable]


def environment(device: torch.device) -> dict:
    found: dict = {"torch": torch.__version__, "device": str(device), "python": platform.python_version()}
    if device.type == "cuda":
        found["gpu"] = torch.cuda.get_device_name(device)
        found["cuda"] = torch.version.cuda
    for package in ("flash-attn", "transformer-engine"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def profile_kernels(grid: KernelGrid = KernelGrid(), *, device: str | None = None, repeats: int = 5,
                    progress: Callable[[str], None] | None = None) -> dict:
    """Measure `grid` on `device` (default: the GPU if there is one) and return the profile's JSON object."""
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if where.type == "cuda" else torch.float32
    tables = [measure_gemm(grid.gemm_sizes, where, dtype, repeats)]
    for backend in measured_backends(where):
        if progress:
            progress(f"attention[{backend}] at {len(grid.doc_lengths)} document lengths")
        tables.extend(measure_attention(backend, grid, where, dtype, repeats))
    return {"format": KERNEL_PROFILE_FORMAT, "environment": environment(where),
            "not_measured": {"te": "Transformer Engine's attention is a module: its published cuDNN table is kept"},
            "tables": [table.to_dict() for table in tables],
            "fit": [row for table in tables for row in table_fit(table)]}


def kernel_profile_main(args) -> int:
    """CLI: `slimpack profile --kernels [--quick] [--repeats N] --out FILE`."""
    grid = QUICK_GRID if getattr(args, "quick", False) else KernelGrid()
    data = profile_kernels(grid, repeats=getattr(args, "repeats", 3) or 3,
                           progress=lambda line: print(line, file=sys.stderr))
    out = Path(getattr(args, "out", None) or "kernels.json")
    out.write_text(json.dumps(data, indent=1))
    if getattr(args, "json", False):
        print(json.dumps(data["fit"]))
    else:
        for row in data["fit"]:
            print(f"{row['kernel']:<9} {row['backend']:<6} {row['direction']:<8} {row['size']:>6}  "
                  f"measured {row['published_tflops']:>10.4g} TFLOP/s  fitted {row['model_tflops']:>10.4g}  "
                  f"({100 * row['error']:+.1f}%)")
    print(f"wrote {out}", file=sys.stderr)
    return 0
