"""megatron-dp-balanced: Megatron-LM's `--sequence-packing-scheduler dp_balanced`.

The rule, read from Megatron-LM's `DpBalancedScheduler.get_groups_and_subsamples`
(megatron/core/datasets/data_schedule.py, dev branch d48bd6be and main d98e8a64; the benchmark that
uses it as its baseline: examples/dynamic_context_parallel/README.md and benchmark_dcp.sh on dev):

1. Samples in the global batch's order fill a packed sequence until the next one would exceed
   `--max-seqlen-per-dp-cp-rank` x CP tokens; that sample opens the next packed sequence
   (next-fit: samples are never reordered and never cut).
2. The number of packed sequences is raised to a multiple of dp (with virtual pipeline stages, of
   dp x `microbatch_group_size_per_vp_stage`, which Megatron defaults to pp): from the last packed
   sequence backwards, the last sample of a packed sequence holding two or more is taken out into
   a packed sequence of its own, appended at the end, until the count is a multiple.
3. Packed sequence j is micro-batch j // dp of DP rank j % dp, and runs on that rank's whole CP
   group (every CP rank of a DP rank gets the same packed sequence).
"""
from __future__ import annotations

from ...config import SlimPackConfig
from ...costmodel import VARIABLE_SHAPE_RING_CP, CostModel
from ...plan import Plan, PlanError, samples_of
from ...specs import ParallelConfig
from ..outcomes import DoesNotFit
from ..registry import register
from .common import INTERLEAVED, assemble_plan, deal_round_robin, input_sources, whole_micropacks
from .hybrid_cp import max_tokens_per_rank
from .packing import pack_in_order

# What both of Megatron's sequence-packing schedulers train: every document whole, causal attention
# within it (THD packing with per-document cu_seqlens); nothing is cut at a sequence boundary.
WHOLE_DOCUMENTS = "documents whole: causal attention within each document, no document cut"


def per_rank_token_cap(cost: CostModel, parallel: ParallelConfig, config: SlimPackConfig) -> int:
    """Megatron's `--max-seqlen-per-dp-cp-rank`: tokens one GPU of the DP x CP pool holds of a
    packed sequence. `config.max_micropack_tokens` if set, else `max_tokens_per_rank` for one GPU
    of this pool (the layout with its CP ranks counted as data parallelism: the same static memory,
    since the optimizer state is sharded over dp x cp, and activations of one rank's tokens)."""
    return max_tokens_per_rank(cost, parallel.with_(dp=parallel.dp * parallel.cp, cp=1), config)


def pack_dp_balanced(lengths: list[int], capacity: int, multiple: int) -> list[list[int]]:
    """dp_balanced's packed sequences (indices into `lengths`): next-fit in the given order up to
    `capacity` tokens, then single samples moved from the back of the last multi-sample packed
    sequences into packed sequences of their own until the count is a multiple of `multiple`.
    PlanError when too few samples share a packed sequence to reach the multiple (Megatron's
    "Not enough samples to move")."""
    packed = pack_in_order(list(range(len(lengths))), lengths, capacity)
    count = len(packed)
    missing = -count % multiple
    index = len(packed) - 1
    while missing:
        if index < 0:
            raise PlanError(f"megatron-dp-balanced: {len(lengths)} samples make {count} packed "
                            f"sequences of which too few hold two samples to reach a multiple of {multiple} "
                            f"(dp x micro-batch group); use a larger global batch or fewer data-parallel ranks")
        if len(packed[index]) > 1:
            packed.append([packed[index].pop()])
            missing -= 1
        else:
            index -= 1
    return packed


# Simulated for comparison only: the SlimPack runtime is not Megatron's sequence-packing data path.
@register("megatron-dp-balanced", role="baseline", trainable=False, overlaps=VARIABLE_SHAPE_RING_CP,
          description="Megatron-LM --sequence-packing-scheduler dp_balanced: samples packed in order, never cut, up "
                      "to max-seqlen-per-dp-cp-rank x CP tokens, each packed sequence on the full CP group, packed "
                      "sequences dealt round-robin over DP (trains documents whole)",
          minimum_in_flight="document", constraints=INTERLEAVED)
def plan_megatron_dp_balanced(lengths: list[int], parallel: ParallelConfig, cost: CostModel,
                              config: SlimPackConfig, *, sources=None) -> Plan:
    """Megatron-LM's dp_balanced sequence packing (the module docstring has the rule).

    Conversion: one packed sequence is one MicroPack of whole documents (THD, per-document
    attention); the MicroPacks are dealt round-robin to the data-parallel ranks (packed sequence j
    to rank j % dp, in order), each rank runs Megatron's 1F1B (interleaved with virtual stages,
    where the count per rank is a multiple of pp by rule 2), and every MicroPack runs with the
    layout's CP (`parallel.cp`, priced by the cost model). The per-rank cap is
    `per_rank_token_cap`; a MicroPack holds at most that x cp tokens. A document longer than
    that cap fits no packed sequence: DoesNotFit (Megatron would put it in a packed sequence of
    its own, over the memory its cap stands for). Objective: documents whole (`WHOLE_DOCUMENTS`).
    """
    cap = per_rank_token_cap(cost, parallel, config)
    capacity = cap * parallel.cp
    longest = max(lengths)
    if longest > capacity:
        raise DoesNotFit(
            f"memory: a {longest}-token document exceeds dp_balanced's packed sequence of {cap} tokens per rank x "
            f"cp {parallel.cp} = {capacity}; use more context parallelism, recompute or tensor parallelism",
            sample_ids=[lengths.index(longest)], group_ranks=parallel.cp)
    group = parallel.pp if parallel.vpp > 1 else 1  # Megatron's microbatch_group_size_per_vp_stage default
    packed = pack_dp_balanced(lengths, capacity, parallel.dp * group)
    samples = samples_of(lengths)
    micropacks = whole_micropacks(lengths, packed)
    per_rank = deal_round_robin(micropacks, parallel.dp)
    metadata = {
        "max_seqlen_per_dp_cp_rank": cap, "packed_sequence_tokens": capacity, "packed_sequences": len(packed),
        "cp_size_per_sample": [parallel.cp] * len(lengths), "training_objective": WHOLE_DOCUMENTS,
    }
    return assemble_plan(per_rank, samples, parallel, cost, config, capacity, metadata,
                         input_sources(lengths, sources))
