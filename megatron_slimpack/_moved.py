"""Module paths that moved: `megatron_slimpack.solver.*` is now `megatron_slimpack.planner.*`
(SlimPack's own phases under `planner.slimpack`), the applications (`cli`, `demo`, `profiler`,
`fidelity`, `comparison`, `selftest`, ...) are under `megatron_slimpack.apps`, and the runtime's
modules under `runtime.attention` (kernels, kv_store, seq_params, batch, context_parallel,
backend_probe, rope) and `runtime.pipeline` (schedule, executor, p2p, timing, merge).
Importing an old path still works for this release, with a DeprecationWarning naming the new one.
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

_PACKAGE = __name__.rsplit(".", 1)[0]
_SLIMPACK_PHASES = ("search", "dp_phase", "replica", "pack_phase", "memory", "ladder")
_PLANNER = ("registry", "strategies", "layouts", "orders", "work", "outcomes", "baselines")
_APPS = ("cli", "cli_options", "demo", "profiler", "fidelity", "comparison", "library_noise", "selftest")

_ATTENTION = ("kernels", "kv_store", "seq_params", "batch", "context_parallel", "backend_probe", "rope")
_PIPELINE = ("schedule", "executor", "p2p", "timing", "merge")

MOVED = {
    **{f"runtime.{name}": f"runtime.attention.{name}" for name in _ATTENTION},
    **{f"runtime.{name}": f"runtime.pipeline.{name}" for name in _PIPELINE},
    **{f"solver.{name}": f"planner.slimpack.{name}" for name in _SLIMPACK_PHASES},
    **{f"solver.{name}": f"planner.{name}" for name in _PLANNER},
    **{name: f"apps.{name}" for name in _APPS},
}


def new_name(old: str) -> str | None:
    """The new module path of an old one (`megatron_slimpack.` prefix included), or None."""
    relative = old[len(_PACKAGE) + 1:] if old.startswith(_PACKAGE + ".") else None
    if relative is None:
        return None
    for moved, target in MOVED.items():
        if relative == moved or relative.startswith(moved + "."):
            return f"{_PACKAGE}.{target}{relative[len(moved):]}"
    return None


class _Loader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target

    def create_module(self, spec):
        return None  # a placeholder, replaced below

    def exec_module(self, module) -> None:
        # The import system returns what sys.modules holds under the old name after this.
        sys.modules[module.__name__] = importlib.import_module(self.target)


class _SplitPackage(importlib.abc.Loader):
    """`solver`, whose modules went to two packages: an empty package whose attributes are its
    old submodules, imported (under their old names) on first use."""

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        module.__path__ = []

        def submodule(name: str):
            if new_name(f"{module.__name__}.{name}") is None:
                raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")
            return importlib.import_module(f"{module.__name__}.{name}")

        module.__getattr__ = submodule


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Answers an old module path with the module at its new path (one module object, so
    classes, monkeypatches and pickles are the same under both names)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == f"{_PACKAGE}.solver":
            warnings.warn(f"{fullname} moved to {_PACKAGE}.planner (SlimPack's phases: {_PACKAGE}.planner.slimpack); "
                          "the old path goes away in the next release", DeprecationWarning, stacklevel=2)
            return importlib.util.spec_from_loader(fullname, _SplitPackage(), is_package=True)
        target_name = new_name(fullname)
        if target_name is None:
            return None
        warnings.warn(f"{fullname} moved to {target_name}; the old path goes away in the next release",
                      DeprecationWarning, stacklevel=2)
        return importlib.util.spec_from_loader(fullname, _Loader(target_name))


def install() -> None:
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())  # before the path finder: stale files never win
