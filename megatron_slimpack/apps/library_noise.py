"""Known notices of the libraries we import, silenced while a `slimpack` command runs.

megatron-core warns on import that Transformer Engine / apex are missing (expected on CPU and
harmless: it falls back to torch), and prints a failing `IndexedDataset.__del__` after a corrupt
`megatron:` dataset that our one-line error already names. Only these are silenced, by message
prefix; every other warning, ours included, still shows.
"""
from __future__ import annotations

import os
import re
import sys
import warnings
from contextlib import contextmanager

# Notices megatron-core gives on every import or model build where Transformer Engine and Apex are
# absent (the CPU and torch paths of this package need neither, by design), and one about a default
# of its own config: four to ten lines per process. Silenced in this process and (through
# PYTHONWARNINGS) in the processes a command spawns.
LIBRARY_NOISE = (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
)


def ignore_library_warnings() -> None:
    """Silence `LIBRARY_NOISE` in this process (the demo's worker processes call it too)."""
    for prefix in LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(prefix), category=UserWarning)


def library_noise_env(current: str | None) -> str:
    """PYTHONWARNINGS for child processes: `current`, then `LIBRARY_NOISE` ignored (the last wins)."""
    return ",".join(([current] if current else []) + [f"ignore:{prefix}:UserWarning" for prefix in LIBRARY_NOISE])


def is_half_built_megatron_dataset(unraisable) -> bool:
    """megatron-core's `IndexedDataset.__del__` failing on an object whose `__init__` did not finish (a
    corrupt `megatron:` index, which the one-line error already names): Python would print it as
    "Exception ignored in ..." with a traceback after that error."""
    function = unraisable.object
    return (getattr(function, "__qualname__", "") == "IndexedDataset.__del__"
            and getattr(function, "__module__", "").startswith("megatron.core")
            and issubclass(unraisable.exc_type, AttributeError))


@contextmanager
def silenced():
    """While a command runs: `LIBRARY_NOISE` ignored here and in child processes, and the half-built
    dataset's `__del__` error dropped; everything as it was afterwards."""
    previous_hook, previous_env = sys.unraisablehook, os.environ.get("PYTHONWARNINGS")

    def hook(unraisable):
        if not is_half_built_megatron_dataset(unraisable):
            previous_hook(unraisable)

    with warnings.catch_warnings():
        ignore_library_warnings()
        os.environ["PYTHONWARNINGS"] = library_noise_env(previous_env)
        sys.unraisablehook = hook
        try:
            yield
        finally:
            sys.unraisablehook = previous_hook
            if previous_env is None:
                os.environ.pop("PYTHONWARNINGS", None)
            else:
                os.environ["PYTHONWARNINGS"] = previous_env
