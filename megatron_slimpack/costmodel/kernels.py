"""Kernel speed as data: published H100 measurements (and this project's own H100 measurement of
the runtime's torch kernel, which nobody publishes) and the curves fitted to them.

Every figure the analytic cost model turns FLOPs into seconds with comes from a table below, and
every table names its source. The planner needs times that add up over the documents of a
MicroPack, so each table is fitted by a curve whose time is linear in what a MicroPack sums:

- Attention (FlashAttention-style kernels, varlen/THD): a sequence of `n` query tokens and `a`
  (query, key) pairs takes `flops_per_pair * (a + half_length / 2 * n) / peak` seconds. For a
  whole causal document of length L (a = L(L+1)/2) that is a rate of about
  `peak * L / (L + half_length)`: short documents run slower, as the kernels do, and because the
  overhead is per query token, a pack of short documents is priced at the short documents' rate
  whatever the pack's size (varlen kernels run at the per-sequence rate).
- GEMMs: `2*m*n*k / (peak * f(m) f(n) f(k))` with `f(d) = d / (d + half_dim)`: small dimensions
  (few tokens, or a weight cut thin by tensor parallelism) under-use the tensor cores.
- Element-wise work (norms, RoPE, SwiGLU, residual adds, cross-entropy) is memory-bound: bytes
  moved / the device's achieved memory bandwidth.

`fit_report()` prints each published row next to the fitted curve (docs/cost-model.md quotes it).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace

import numpy as np

TERA = 1e12


@dataclass(frozen=True)
class PublishedTable:
    """Measured TFLOP/s of one kernel at several sizes (sequence length, or square GEMM side)."""

    kernel: str  # "attention" or "gemm"
    backend: str  # te (cuDNN fused attention), flash (flash-attn 2), flash3, cublas
    direction: str  # forward | backward
    causal: bool
    head_dim: int
    sizes: tuple[int, ...]
    tflops: tuple[float, ...]
    source: str
    note: str = ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "PublishedTable":
        """A table from its JSON object (a kernel profile's row), every field checked: ValueError
        names the first problem."""
        if not isinstance(data, dict):
            raise ValueError(f"a kernel table is a JSON object, got {type(data).__name__}")
        names = [item.name for item in fields(cls)]
        missing = [name for name in names if name not in data and name != "note"]
        unknown = [name for name in data if name not in names]
        if missing or unknown:
            raise ValueError(" and ".join((["lacks " + ", ".join(missing)] if missing else [])
                                          + (["has unknown " + ", ".join(unknown)] if unknown else [])))
        if data["kernel"] not in ("attention", "gemm"):
            raise ValueError(f"kernel {data['kernel']!r} is neither 'attention' nor 'gemm'")
        if data["direction"] not in ("forward", "backward"):
            raise ValueError(f"direction {data['direction']!r} is neither 'forward' nor 'backward'")
        sizes, rates = data["sizes"], data["tflops"]
        if not isinstance(sizes, list) or not isinstance(rates, list) or len(sizes) != len(rates) or len(sizes) < 2:
            raise ValueError("sizes and tflops must be lists of the same length, at least 2 rows (a curve is fitted)")
        if any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in sizes):
            raise ValueError(f"sizes must be positive integers, got {sizes}")
        if any(isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0
               for x in rates):
            raise ValueError(f"tflops must be positive finite numbers, got {rates}")
        return cls(data["kernel"], str(data["backend"]), data["direction"], bool(data["causal"]),
                   int(data["head_dim"]), tuple(sizes), tuple(float(x) for x in rates), str(data["source"]),
                   str(data.get("note", "")))


# FlashAttention-3 paper (Shah et al., arXiv 2407.08608, Figures 5 and 6): H100 SXM5, BF16, head
# dim 128, hidden 2048, batch x seqlen = 16K tokens. Forward causal; backward as published (the
# paper's backward figures are non-causal). FLOPs counted as 4 * seqlen^2 * head_dim * heads,
# halved when causal; backward 2.5x forward.
_FA3_PAPER = "FlashAttention-3 paper, arXiv 2407.08608, Fig. 5-6 (H100 SXM5, BF16, head dim 128)"
_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
_TORCH_VARLEN = ("benchmarks/results/gpu_h100.md (commit ad4a878): torch.nn.attention.varlen.varlen_attn, "
                 "PyTorch 2.11.0+cu130, one H100 80GB HBM3, BF16, head dim 128")
ATTENTION_TABLES: tuple[PublishedTable, ...] = (
    PublishedTable("attention", "flash3", "forward", True, 128, _LENGTHS, (292, 423, 521, 579, 602, 616), _FA3_PAPER),
    PublishedTable("attention", "te", "forward", True, 128, _LENGTHS, (315, 410, 484, 518, 529, 539), _FA3_PAPER,
                   note="cuDNN fused attention, the kernel Transformer Engine runs for THD on Hopper"),
    PublishedTable("attention", "flash", "forward", True, 128, _LENGTHS, (191, 260, 298, 319, 333, 335), _FA3_PAPER,
                   note="FlashAttention-2"),
    PublishedTable("attention", "flash3", "backward", False, 128, _LENGTHS, (316, 424, 501, 542, 559, 561),
                   _FA3_PAPER, note="non-causal backward"),
    PublishedTable("attention", "te", "backward", False, 128, _LENGTHS, (305, 408, 465, 499, 518, 516), _FA3_PAPER,
                   note="cuDNN fused attention; non-causal backward"),
    PublishedTable("attention", "flash", "backward", False, 128, _LENGTHS, (214, 260, 291, 310, 318, 322), _FA3_PAPER,
                   note="FlashAttention-2; non-causal backward"),
    # The runtime's torch kernel on a GPU: one call of PyTorch's varlen flash attention per MicroPack.
    # Measured here (benchmarks/gpu_anchors.py, section attention): 32 heads, 16K tokens of equal
    # documents, both directions causal; backward FLOPs 2.5x forward, as above.
    PublishedTable("attention", "torch", "forward", True, 128, _LENGTHS, (117.4, 155.9, 224.4, 291.1, 288.3, 288.3),
                   _TORCH_VARLEN, note="PyTorch 2.11 varlen_attn; this project's measurement"),
    PublishedTable("attention", "torch", "backward", True, 128, _LENGTHS, (120.9, 199.7, 245.3, 263.7, 282.4, 334.2),
                   _TORCH_VARLEN, note="PyTorch 2.11 varlen_attn; causal backward; this project's measurement"),
)

# torch.matmul BF16 square GEMMs on an H100 80GB HBM3 (PyTorch 2.7.0+cu128): the
# torch-performance-test-data record "NVIDIA H100 80GB HBM3" (github.com/zzc0721/
# torch-performance-test-data, issue 79). The 1024 x 1024 row (176.6 TFLOP/s: 2 GFLOP in 12 us,
# launch-bound in a micro-benchmark) is left out of the fit: a layer's GEMMs at 1K tokens have
# weight dimensions of several thousand.
GEMM_TABLE = PublishedTable(
    "gemm", "cublas", "forward", False, 0, (2048, 4096, 8192), (676.59, 788.72, 797.51),
    "torch-performance-test-data issue 79: torch.matmul BF16 on H100 80GB HBM3, PyTorch 2.7.0+cu128",
    note="1024 x 1024 (176.6 TFLOP/s) left out: launch-bound")

# The `format` of a kernel profile file (`slimpack profile --kernels`): measured tables of this module's form.
KERNEL_PROFILE_FORMAT = "slimpack-kernel-profile/1"

# Achieved bandwidth of memory-bound element-wise kernels as a share of the HBM peak.
ELEMENTWISE_BANDWIDTH_SHARE = 0.8


@dataclass(frozen=True)
class AttentionRate:
    """Seconds of a FlashAttention-style kernel: flops_per_pair * (pairs + half_length/2 * tokens) / peak."""

    peak_flops: float
    half_length: float

    def seconds(self, flops_per_pair, pairs, tokens):
        return flops_per_pair * (pairs + 0.5 * self.half_length * tokens) / self.peak_flops

    def tflops(self, length: float) -> float:
        """Rate on one whole causal sequence of `length` tokens, FLOPs counted on its pairs."""
        pairs = length * (length + 1) / 2
        return pairs / self.seconds(1.0, pairs, length) / TERA

    @classmethod
    def fit(cls, table: PublishedTable) -> "AttentionRate":
        """Least squares on relative error: 1/rate(L) = (1 + half/(L+1)) / peak is linear in
        (1/peak, half/peak)."""
        sizes = np.asarray(table.sizes, dtype=float)
        rates = np.asarray(table.tflops, dtype=float) * TERA
        rows = np.stack([rates, rates / (sizes + 1)], axis=1)
        (inverse_peak, half_over_peak), *_ = np.linalg.lstsq(rows, np.ones_like(rates), rcond=None)
        if not (inverse_peak > 0 and half_over_peak >= 0):
            inverse_peak, half_over_peak = cls._bounded_fit(rows, float(rates.min()), float(rates.max()))
        return cls(1.0 / inverse_peak, half_over_peak / inverse_peak)

    @staticmethod
    def _bounded_fit(rows: np.ndarray, slowest: float, fastest: float) -> tuple[float, float]:
        """The same least squares with half >= 0 and the peak between the slowest measured rate and
        10^4 times the fastest: measured rates that do not level off (a CPU's, whose per-document
        cost rules at every length) or that fall with length leave the unconstrained fit without a
        meaning (a negative peak or per-token cost)."""
        best: tuple[float, float, float] | None = None
        for inverse_peak in np.geomspace(1e-4 / fastest, 1.0 / slowest, 400):
            rest = 1.0 - rows[:, 0] * inverse_peak
            half_over_peak = max(0.0, float(rows[:, 1] @ rest / (rows[:, 1] @ rows[:, 1])))
            error = float(((rest - rows[:, 1] * half_over_peak) ** 2).sum())
            if best is None or error < best[0]:
                best = (error, float(inverse_peak), half_over_peak)
        assert best is not None
        return best[1], best[2]


@dataclass(frozen=True)
class GemmRate:
    """Seconds of a GEMM: 2mnk / (peak * f(m) f(n) f(k)), f(d) = d / (d + half_dim)."""

    peak_flops: float
    half_dim: float

    def share(self, m, n, k):
        h = self.half_dim
        return (m / (m + h)) * (n / (n + h)) * (k / (k + h))

    def seconds(self, m, n, k):
        return 2.0 * m * n * k / (self.peak_flops * self.share(m, n, k))

    def tflops(self, m: float, n: float, k: float) -> float:
        return self.peak_flops * self.share(m, n, k) / TERA

    @classmethod
    def fit(cls, table: PublishedTable) -> "GemmRate":
        """Grid search of half_dim with the peak in closed form (least squares on relative error)."""
        sizes = np.asarray(table.sizes, dtype=float)
        rates = np.asarray(table.tflops, dtype=float) * TERA
        best: tuple[float, float, float] | None = None
        for half in np.arange(0.0, 2048.0, 1.0):
            share = (sizes / (sizes + half)) ** 3
            # minimise sum((peak*share/rate - 1)^2): peak = sum(s/r) / sum((s/r)^2)
            ratio = share / rates
            peak = float(ratio.sum() / (ratio ** 2).sum())
            error = float(((peak * ratio - 1.0) ** 2).sum())
            if best is None or error < best[0]:
                best = (error, peak, float(half))
        assert best is not None
        return cls(best[1], best[2])


@dataclass(frozen=True)
class KernelRates:
    """The kernel speeds one accelerator is priced with."""

    name: str
    gemm: GemmRate
    attention_forward: dict[str, AttentionRate]
    attention_backward: dict[str, AttentionRate]
    source: str

    def attention(self, backend: str, backward: bool) -> AttentionRate:
        rates = self.attention_backward if backward else self.attention_forward
        return rates[backend]

    def with_measured(self, tables: Sequence[PublishedTable], source: str) -> "KernelRates":
        """These rates with each measured table (`slimpack profile --kernels`) in place of the one it
        measures: the GEMM curve, or one backend's attention in one direction. What was not
        measured keeps its published (or preset) rate."""
        gemm, forward, backward = self.gemm, dict(self.attention_forward), dict(self.attention_backward)
        for table in tables:
            if table.kernel == "gemm":
                gemm = GemmRate.fit(table)
            else:
                (backward if table.direction == "backward" else forward)[table.backend] = AttentionRate.fit(table)
        return replace(self, name=f"{self.name}+measured", gemm=gemm, attention_forward=forward,
                       attention_backward=backward, source=f"{source}; otherwise {self.source}")


def published_h100_rates() -> KernelRates:
    """Hopper (H100 SXM, and H200: the same SMs and clocks) fitted to the tables above."""
    forward = {t.backend: AttentionRate.fit(t) for t in ATTENTION_TABLES if t.direction == "forward"}
    backward = {t.backend: AttentionRate.fit(t) for t in ATTENTION_TABLES if t.direction == "backward"}
    return KernelRates("h100-published", GemmRate.fit(GEMM_TABLE), forward, backward,
                       source=f"{_FA3_PAPER}; {GEMM_TABLE.source}")


def generic_rates(peak_flops: float, max_efficiency: float, half_tokens: float) -> KernelRates:
    """A device without published tables: one saturating curve for every kernel, from its preset
    (`HardwareSpec.max_efficiency`, `half_efficiency_tokens`)."""
    # A third of the half point per GEMM dimension keeps a square GEMM's half point where the preset puts it.
    gemm = GemmRate(peak_flops * max_efficiency, half_tokens / 3.0)
    attention = AttentionRate(peak_flops * max_efficiency, float(half_tokens))
    backends = ("te", "flash", "flash3", "torch")
    return KernelRates("generic", gemm, dict.fromkeys(backends, attention), dict.fromkeys(backends, attention),
                       source="hardware preset (no published kernel table)")


_PUBLISHED: dict[str, KernelRates] = {}


def kernel_rates(kind: str, peak_flops: float, max_efficiency: float, half_tokens: float) -> KernelRates:
    """The rates a `HardwareSpec.kernels` name stands for."""
    if kind == "h100-published":
        if kind not in _PUBLISHED:
            _PUBLISHED[kind] = published_h100_rates()
        return _PUBLISHED[kind]
    if kind == "generic":
        return generic_rates(peak_flops, max_efficiency, half_tokens)
    raise ValueError(f"unknown kernel table {kind!r}; known: h100-published, generic")


def table_fit(table: PublishedTable, rates: KernelRates | None = None) -> list[dict]:
    """Each row of `table` next to its fitted curve (the curve in `rates`, or fitted to the table
    alone): size, table and model TFLOP/s, relative error."""
    if table.kernel == "gemm":
        gemm = rates.gemm if rates is not None else GemmRate.fit(table)

        def model(size: int) -> float:
            return gemm.tflops(size, size, size)
    else:
        fitted = (rates.attention(table.backend, table.direction == "backward") if rates is not None
                  else AttentionRate.fit(table))

        def model(size: int) -> float:
            return float(fitted.tflops(size))
    return [{"kernel": table.kernel, "backend": table.backend, "direction": table.direction, "size": size,
             "published_tflops": published, "model_tflops": float(f"{model(size):.4g}"),
             "error": round(model(size) / published - 1.0, 4)}
            for size, published in zip(table.sizes, table.tflops)]


def fit_report() -> list[dict]:
    """Every published row next to the fitted curve: size, published and model TFLOP/s, error."""
    rates = published_h100_rates()
    return [row for table in (*ATTENTION_TABLES, GEMM_TABLE) for row in table_fit(table, rates)]


__all__ = [
    "PublishedTable", "ATTENTION_TABLES", "GEMM_TABLE", "AttentionRate", "GemmRate", "KernelRates",
    "published_h100_rates", "generic_rates", "kernel_rates", "fit_report", "ELEMENTWISE_BANDWIDTH_SHARE",
    "KERNEL_PROFILE_FORMAT", "table_fit",
]
