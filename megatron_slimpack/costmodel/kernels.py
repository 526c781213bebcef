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

from dataclasses import dataclass

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
        return cls(1.0 / inverse_peak, half_over_peak / inverse_peak)


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


def fit_report() -> list[dict]:
    """Every published row next to the fitted curve: size, published and model TFLOP/s, error."""
    rates = published_h100_rates()
    rows = []
    for table in ATTENTION_TABLES:
        fitted = (rates.attention_backward if table.direction == "backward" else rates.attention_forward)[table.backend]
        for size, published in zip(table.sizes, table.tflops):
            model = fitted.tflops(size)
            rows.append({"kernel": "attention", "backend": table.backend, "direction": table.direction,
                         "size": size, "published_tflops": published, "model_tflops": round(float(model), 1),
                         "error": round(float(model / published - 1.0), 4)})
    for size, published in zip(GEMM_TABLE.sizes, GEMM_TABLE.tflops):
        model = rates.gemm.tflops(size, size, size)
        rows.append({"kernel": "gemm", "backend": "cublas", "direction": "forward", "size": size,
                     "published_tflops": published, "model_tflops": round(model, 1),
                     "error": round(model / published - 1.0, 4)})
    return rows


__all__ = [
    "PublishedTable", "ATTENTION_TABLES", "GEMM_TABLE", "AttentionRate", "GemmRate", "KernelRates",
    "published_h100_rates", "generic_rates", "kernel_rates", "fit_report", "ELEMENTWISE_BANDWIDTH_SHARE",
]
