"""SlimPack runtime: sliced attention with a per-document KV cache, MicroPack batches, the stage
executor that runs a plan's forward and backward units on megatron-core, and the schedule that
drives it for a step (design.md section 3).

Import `compat` and call `compat.apply()` first on a machine without a GPU.
"""
from .attention import (
    BACKENDS,
    BackendUnavailable,
    KVStore,
    SlicedDotProductAttention,
    SlicedSeqParams,
    available_backends,
    resolve_backend,
    slimpack_layer_spec,
)
from .batch import InMemoryTokenSource, MicroPackBatch, TokenSource, build_batch
from .executor import StageExecutor, UnitReport, backward_step, forward_step, global_loss_tokens, split_into_leaves
from .schedule import (
    ScheduleError,
    ScheduleGroups,
    ScheduleResult,
    check_same_plan,
    check_stage_orders,
    slimpack_forward_backward,
)
from .timing import SavedBytesMeter, StageMemory, TimedTask, Timeline, overlay_records, write_overlay_gantt

__all__ = [
    "BACKENDS", "BackendUnavailable", "KVStore", "SlicedDotProductAttention", "SlicedSeqParams",
    "available_backends", "resolve_backend", "slimpack_layer_spec", "InMemoryTokenSource", "MicroPackBatch",
    "TokenSource", "build_batch", "StageExecutor", "UnitReport", "backward_step",
    "forward_step", "global_loss_tokens", "split_into_leaves", "ScheduleError", "ScheduleGroups", "ScheduleResult",
    "check_same_plan", "check_stage_orders", "slimpack_forward_backward", "SavedBytesMeter", "StageMemory",
    "TimedTask", "Timeline", "overlay_records", "write_overlay_gantt",
]
