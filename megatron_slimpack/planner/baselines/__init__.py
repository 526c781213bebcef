"""Baselines: the peers SlimPack is compared against, in the same framework.

Every baseline is a strategy in the registry (`registry.py`, with its `StrategySpec` facts): it
turns one global batch of document lengths into a `Plan` that `Plan.validate()` accepts, priced
by the same cost model and timed by the same simulator as SlimPack, so a comparison is a
comparison of schedules only. The building blocks are the planner's own (`stage_orders`,
`cut_document`, `WorkRates`); what differs is how documents become micro-batches and where the
micro-batches run.

Registered names and what each reproduces (details in each function's docstring):

    megatron-fixed      Megatron-LM GPTDataset: concatenate, cut at exactly the context length
    megatron-stock      the same sequences, attending across document boundaries (stock pretrain_gpt.py;
                        a different training semantic, a reference simulated for comparison only)
    bfd                 best-fit-decreasing token packing (TRL / NeMo)
    sorted              LongAlign sorted batching
    wlb-llm             WLB-LLM: cost-balanced variable-length packing + outlier-delay queues (stateful)
    megatron-hybrid-cp  Megatron-Core main's BalancedCPScheduler (hybrid context parallel), called as a library
    slimpipe            SlimPipe: uniform slices of each sequence, slice-level 1F1B
    megatron-dp-balanced  Megatron-LM's dp_balanced sequence packing: in order, never cut, full CP group
    megatron-dynamic-cp   Megatron-LM dev's default_dynamic_cp: per-sample CP size, packed per CP group

All of them schedule each data-parallel replica with Megatron's 1F1B: one forward and one
backward unit per micro-batch, pp - s - 1 warm-up forwards on stage s; those Megatron-LM runs
(all but SlimPipe) also with virtual stages, in Megatron's interleaved order and under its rule
on the micro-batch count (`schedule_1f1b`), which the variable-count packers meet by splitting or merging
micro-batches (`meet_interleaved_count`).

Modules: common.py (what every baseline shares), sequences.py (GPTDataset's fixed-length
sequences), fixed.py (megatron-fixed, megatron-stock), packing.py (bfd, sorted), wlb_llm.py,
hybrid_cp.py (megatron-hybrid-cp), slimpipe.py, dp_balanced.py (megatron-dp-balanced), dynamic_cp.py
(megatron-dynamic-cp). Importing the package registers every strategy.
"""
# Each module registers its strategies on import; the registry lists them in that order (CLI help,
# comparison tables), so the imports keep the order of the list above.
# isort: off
from . import fixed, packing, wlb_llm, hybrid_cp, slimpipe  # noqa: F401
from . import dp_balanced  # noqa: F401
from . import dynamic_cp  # noqa: F401
# isort: on
from .common import INTERLEAVED, assemble_plan, meet_interleaved_count, schedule_1f1b, whole_documents
from .fixed import STOCK_SEMANTICS, plan_megatron_fixed, plan_megatron_stock
from .hybrid_cp import max_tokens_per_rank, plan_megatron_hybrid_cp
from .packing import best_fit_decreasing, pack_in_order, plan_bfd, plan_sorted
from .sequences import BATCHES_CACHED, Piece, concatenate_and_cut, cut_cached
from .slimpipe import plan_slimpipe, slice_sequence
from .wlb_llm import MicroBatch, PendingDocument, WlbLlmPlanner, pack_by_cost

__all__ = [
    "schedule_1f1b", "meet_interleaved_count", "assemble_plan", "whole_documents", "INTERLEAVED",
    "concatenate_and_cut", "cut_cached", "BATCHES_CACHED", "Piece", "best_fit_decreasing", "pack_in_order",
    "WlbLlmPlanner", "PendingDocument", "MicroBatch", "pack_by_cost", "max_tokens_per_rank", "slice_sequence",
    "plan_megatron_fixed", "plan_megatron_stock", "plan_bfd", "plan_sorted", "plan_megatron_hybrid_cp",
    "plan_slimpipe", "STOCK_SEMANTICS",
]
