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

__all__ = [
    "BACKENDS", "BackendUnavailable", "KVStore", "SlicedDotProductAttention", "SlicedSeqParams",
    "available_backends", "resolve_backend", "slimpack_layer_spec", "InMemoryTokenSource", "MicroPackBatch",
    "TokenSource", "build_batch", "SingleStageExecutor", "StepResult", "UnitReport", "backward_step",
    "forward_step", "global_loss_tokens", "split_into_leaves",
]
