"""What every self-test check shares: the check record, tolerances, problem sizes, timing, logs."""
from __future__ import annotations

import math
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

PASS, FAIL, ERROR, SKIP, MEASURED = "pass", "fail", "error", "skip", "measured"
FAILED = (FAIL, ERROR)

_STARTED = time.perf_counter()


def log(message: str) -> None:
    """Progress and diagnostics: always stderr (stdout holds only the report)."""
    print(f"[selftest {time.perf_counter() - _STARTED:6.1f}s] {message}", file=sys.stderr, flush=True)


def finite(value: float) -> float | str:
    """A float for JSON: NaN and infinities as strings (json.dumps would write invalid JSON)."""
    value = float(value)
    return value if math.isfinite(value) else str(value)


@dataclass
class Check:
    """One line of the report. status: pass / fail / error (it raised) / skip (with the reason
    in `summary`) / measured (a timing, no pass criterion)."""

    name: str
    status: str
    summary: str
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "summary": self.summary, **self.details}


def skipped(name: str, reason: str) -> Check:
    return Check(name, SKIP, reason)


def guarded(name: str, run: Callable[[], Check]) -> Check:
    """Run one check; an exception makes it an error (traceback to stderr), never a crash."""
    log(f"{name} ...")
    began = time.perf_counter()
    try:
        check = run()
    except Exception as error:  # noqa: BLE001 - the report names it
        traceback.print_exc(file=sys.stderr)
        check = Check(name, ERROR, f"{type(error).__name__}: {error}")
    check.details.setdefault("seconds", round(time.perf_counter() - began, 3))
    log(f"{name}: {check.status.upper()} {check.summary}")
    return check


# ---- tolerances ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tolerances:
    """Pass thresholds. Tensor errors are max |x - ref| / max |ref| (per tensor); loss and grad
    norm are relative differences; `param_grad` is the worst ||g_sliced - g_whole|| / ||g_whole||
    over the model's parameter tensors."""

    attention: float  # a kernel (out, dq, dk, dv) vs the fp32 masked softmax of the same inputs
    merge: float      # merged (position runs) vs unmerged, same kernel and dtype
    loss: float
    grad_norm: float
    param_grad: float


FP32 = Tolerances(attention=1e-4, merge=1e-5, loss=1e-5, grad_norm=1e-5, param_grad=1e-4)
# bf16 keeps 8 mantissa bits (2^-8 = 0.4% per rounding); kernels round P and the output to bf16,
# so dK/dV (sums over many queries) carry about 1% (measured with the torch kernel in bf16). Merged vs
# unmerged compares two such bf16 results: twice a kernel's error. The broken masks these checks
# exist for give errors of order 1.
BF16 = Tolerances(attention=3e-2, merge=6e-2, loss=5e-3, grad_norm=2e-2, param_grad=1e-1)


# ---- problem sizes ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """Where and how big: one per device (GPU: bf16 and realistic shapes; CPU: fp32, small)."""

    device: torch.device
    dtype: torch.dtype
    heads: int
    groups: int  # KV groups (GQA: groups < heads)
    head_dim: int
    attention_segments: tuple  # (KV prefix, queries) per segment
    merge_slices: tuple        # (document, start, end) per slice of the merged MicroPack
    merge_group_sizes: tuple
    train_lengths: tuple       # document lengths
    train_slice: int           # slice length of the sliced plan
    train_steps: int
    train_hidden: int
    train_layers: int
    vocab: int
    overhead_lengths: tuple
    overhead_slice: int
    repeats: int

    @property
    def is_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def tolerances(self) -> Tolerances:
        return FP32 if self.dtype == torch.float32 else BF16

    @property
    def precision(self) -> str:
        return str(self.dtype).replace("torch.", "")


_MERGE_SLICES = ((0, 9, 30), (1, 0, 3), (2, 4, 5), (3, 0, 17), (4, 40, 41))

CPU_SETUP = Setup(
    device=torch.device("cpu"), dtype=torch.float32, heads=4, groups=2, head_dim=16,
    attention_segments=((48, 32), (0, 24), (5, 1), (130, 67), (0, 1)),
    merge_slices=_MERGE_SLICES, merge_group_sizes=(2, 3),
    train_lengths=(100, 61, 37, 9), train_slice=32, train_steps=3, train_hidden=64, train_layers=2, vocab=128,
    overhead_lengths=(1024, 512, 512), overhead_slice=256, repeats=5,
)
GPU_SETUP = Setup(
    device=torch.device("cuda"), dtype=torch.bfloat16, heads=8, groups=2, head_dim=128,
    attention_segments=((1024, 512), (0, 384), (5, 1), (3000, 129), (0, 1)),
    merge_slices=((0, 700, 1500), (1, 0, 3), (2, 4, 5), (3, 0, 517), (4, 40, 41)), merge_group_sizes=(2, 4),
    train_lengths=(1500, 900, 400, 77), train_slice=512, train_steps=3, train_hidden=256, train_layers=2, vocab=512,
    overhead_lengths=(8192, 4096, 4096, 2048), overhead_slice=1024, repeats=10,
)


def make_setup(device: str, quick: bool) -> Setup:
    setup = GPU_SETUP if device == "cuda" else CPU_SETUP
    if quick:
        setup = replace(setup, train_steps=2, repeats=3,
                        overhead_lengths=tuple(n // 2 for n in setup.overhead_lengths))
    return setup


# ---- timing ----------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(run: Callable[[], None], repeats: int, device: torch.device) -> float:
    """Median wall time of `run` over `repeats` after one warm-up (GPU: synchronized on both ends)."""
    run()
    times = []
    for _ in range(repeats):
        synchronize(device)
        began = time.perf_counter()
        run()
        synchronize(device)
        times.append(time.perf_counter() - began)
    return statistics.median(times)
