"""SlimPack runtime: sliced attention with a per-document KV cache, MicroPack batches, the stage
executor that runs a plan's forward and backward units on megatron-core, and the schedule that
drives it for a step (docs/design.md section 3).

Import `compat` and call `compat.apply()` first on a machine without a GPU.

The names below load on first use (PEP 562), so that importing a light submodule (e.g.
`runtime.processes`) does not import torch and megatron-core: `slimpack plan`, `simulate`,
`compare` and `--help` never need them.
"""
from importlib import import_module

_HOME = {
    "attention.core": ("BACKENDS", "BackendUnavailable", "KVStore", "SlicedDotProductAttention", "SlicedSeqParams",
                       "available_backends", "resolve_backend", "slimpack_layer_spec"),
    "attention.batch": ("InMemoryTokenSource", "MicroPackBatch", "TokenSource", "build_batch"),
    "pipeline.executor": ("StageExecutor", "UnitReport", "backward_step", "forward_step", "global_loss_tokens",
                          "split_into_leaves"),
    "pipeline.schedule": ("ScheduleError", "ScheduleGroups", "ScheduleResult", "check_same_plan",
                          "check_stage_orders", "slimpack_forward_backward"),
    "pipeline.timing": ("SavedBytesMeter", "StageMemory", "TimedTask", "Timeline", "overlay_records",
                        "write_overlay_gantt"),
}
_MODULE_OF = {name: module for module, names in _HOME.items() for name in names}

__all__ = list(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_MODULE_OF[name]}", __name__), name)
    globals()[name] = value
    return value
