"""Modules that moved (`solver.*` -> `planner.*`, the applications -> `apps.*`, runtime modules ->
`runtime.attention.*` / `runtime.pipeline.*`) still import
under their old paths, as the same module objects, with a DeprecationWarning naming the new path."""
from __future__ import annotations

import subprocess
import sys

import pytest

OLD_AND_NEW = [
    ("megatron_slimpack.solver.strategies", "megatron_slimpack.planner.strategies"),
    ("megatron_slimpack.solver.baselines", "megatron_slimpack.planner.baselines"),
    ("megatron_slimpack.solver.search", "megatron_slimpack.planner.slimpack.search"),
    ("megatron_slimpack.solver.pack_phase", "megatron_slimpack.planner.slimpack.pack_phase"),
    ("megatron_slimpack.cli", "megatron_slimpack.apps.cli"),
    ("megatron_slimpack.demo", "megatron_slimpack.apps.demo"),
    ("megatron_slimpack.selftest.report", "megatron_slimpack.apps.selftest.report"),
    ("megatron_slimpack.runtime.schedule", "megatron_slimpack.runtime.pipeline.schedule"),
    ("megatron_slimpack.runtime.kernels", "megatron_slimpack.runtime.attention.kernels"),
]


@pytest.mark.parametrize("old, new", OLD_AND_NEW)
def test_an_old_path_imports_the_new_module_with_a_warning(old, new):
    """In a fresh interpreter (this one may have imported either already)."""
    code = (f"import importlib, warnings\n"
            f"with warnings.catch_warnings(record=True) as caught:\n"
            f"    warnings.simplefilter('always')\n"
            f"    old = importlib.import_module({old!r})\n"
            f"new = importlib.import_module({new!r})\n"
            f"assert old is new, (old, new)\n"
            f"assert any(issubclass(w.category, DeprecationWarning) and {new!r} in str(w.message) for w in caught)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_from_the_old_package_import_a_module():
    code = ("import warnings\n"
            "warnings.simplefilter('error', DeprecationWarning)\n"
            "from megatron_slimpack.planner.slimpack import search\n"
            "warnings.simplefilter('ignore', DeprecationWarning)\n"
            "from megatron_slimpack.solver import search as old_search\n"
            "assert old_search is search\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_an_unknown_old_module_is_still_an_import_error():
    with pytest.raises(ImportError):
        import megatron_slimpack.solver.no_such_module  # noqa: F401
