"""SlimPack runtime: sliced attention with a per-document KV cache, MicroPack batches, and the
executor that runs a plan's forward and backward units on megatron-core (design.md section 3).

Import `compat` and call `compat.apply()` first on a machine without a GPU.
"""
from .attention import (
    BACKENDS, BackendUnavailable, KVStore, SlicedDotProductAttention, SlicedSeqParams, available_backends,
    resolve_backend, slimpack_layer_spec,
)
from .batch import InMemoryTokenSource, MicroPackBatch, TokenSource, build_batch
from .executor import (
    SingleStageExecutor, StepResult, UnitReport, backward_step, forward_step, global_loss_tokens,
    split_into_leaves,
)
from .schedule import ScheduleError, ScheduleResult, check_same_plan, check_stage_orders, slimpack_forward_backward
from .timing import SavedBytesMeter, StageMemory, TimedTask, Timeline, overlay_records, write_overlay_gantt

__all__ = [
    "BACKENDS", "BackendUnavailable", "KVStore", "SlicedDotProductAttention", "SlicedSeqParams",
    "available_backends", "resolve_backend", "slimpack_layer_spec", "InMemoryTokenSource", "MicroPackBatch",
    "TokenSource", "build_batch", "SingleStageExecutor", "StepResult", "UnitReport", "backward_step",
    "forward_step", "global_loss_tokens", "split_into_leaves", "ScheduleError", "ScheduleResult",
    "check_same_plan", "check_stage_orders", "slimpack_forward_backward", "SavedBytesMeter", "StageMemory",
    "TimedTask", "Timeline", "overlay_records", "write_overlay_gantt",
]
