"""The cost model: time and memory of MicroPacks on one pipeline stage (model.py), priced with
kernel speeds taken from published measurements (kernels.py) or a `slimpack profile` file."""
from __future__ import annotations

from .kernels import (
    KERNEL_PROFILE_FORMAT,
    AttentionRate,
    GemmRate,
    KernelRates,
    PublishedTable,
    fit_report,
    kernel_rates,
)
from .model import (
    PROFILE_KEYS,
    REGENERATE_PROFILE,
    ActivationCoefficients,
    Amount,
    CostModel,
    ProfileError,
    TimeCoefficients,
    analytic_activation,
    format_bytes,
    read_kernel_profile,
    read_profile,
)
from .overlaps import FIXED_SHAPE, SERIAL, SLIMPACK_RUNTIME, VARIABLE_SHAPE_RING_CP, Overlaps, overlaps_of

__all__ = [
    "PROFILE_KEYS", "REGENERATE_PROFILE", "ActivationCoefficients", "Amount", "CostModel", "ProfileError",
    "TimeCoefficients", "analytic_activation", "format_bytes", "read_kernel_profile", "read_profile",
    "KERNEL_PROFILE_FORMAT", "AttentionRate", "GemmRate", "KernelRates", "PublishedTable", "fit_report", "kernel_rates",
    "Overlaps", "SERIAL", "SLIMPACK_RUNTIME", "FIXED_SHAPE", "VARIABLE_SHAPE_RING_CP", "overlaps_of",
]
