"""The one base class of the errors the package raises on bad input (plans, presets, workloads,
configuration): `except SlimPackError` catches them all. Each message names the problem and the fix."""
from __future__ import annotations


class SlimPackError(ValueError):
    """Bad input to megatron_slimpack; subclasses say which kind."""
