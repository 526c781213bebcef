"""The plan: the data structure between the planner, the simulator and the runtime.

`types` holds its parts (samples, slices, MicroPacks, tasks, replica plans) and the array code
over them, `validate` the rules a plan obeys, `plan` the `Plan` of one global batch with its
JSON form. Import every name from `megatron_slimpack.plan`.
"""
from .plan import RENUMBERING_STRATEGIES, Plan
from .types import (
    MicroPack,
    PackFigures,
    PlanError,
    ReplicaPlan,
    Sample,
    SampleSource,
    Slice,
    Task,
    backward_sequence,
    chain_heads,
    check_sources,
    default_sources,
    last_forward_needed,
    micropack_figures,
    overlapping_documents,
    overlaps,
    pack_figures,
    samples_of,
    sequence_sharded_pairs,
    slice_table,
    sources_of,
    task_chunk,
    tasks_of_chunk,
    whole_slices,
    whole_slices_of,
)
from .validate import SliceTable, check_plan, check_slices

# tests/test_plan_and_planner.py imports these two under their underscored names.
_SliceTable = SliceTable
_check_slices = check_slices

__all__ = [
    "RENUMBERING_STRATEGIES", "MicroPack", "PackFigures", "Plan", "PlanError", "ReplicaPlan", "Sample", "SampleSource",
    "SliceTable", "Slice", "Task", "backward_sequence", "chain_heads", "check_plan", "check_slices", "check_sources",
    "default_sources", "last_forward_needed", "micropack_figures", "overlapping_documents", "overlaps", "pack_figures",
    "samples_of", "sequence_sharded_pairs", "slice_table", "sources_of", "task_chunk", "tasks_of_chunk", "whole_slices",
    "whole_slices_of",
]
