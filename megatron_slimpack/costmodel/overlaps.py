"""Which communication a strategy's real run hides behind compute, and how its context parallelism
shards a micro-batch: one declared fact per strategy.

The simulator prices every strategy with the same kernels and links; what differs is what its
runtime can overlap. Stock Megatron-LM with fixed-shape micro-batches can hide tensor-parallel
collectives inside the GEMMs (`--tp-comm-overlap`, TE userbuffers, which need fixed shapes) and
exchanges context-parallel K/V in a ring while attention computes. The SlimPack runtime runs
variable MicroPack shapes, so it refuses `--tp-comm-overlap`; with `--slimpack-tp-overlap` it runs
the same chunked ring with buffers sized per MicroPack (runtime/tp_overlap.py), and it gathers K/V
before attention (blocking). Every strategy reduces gradients and gathers parameters as Megatron's
`--overlap-grad-reduce` / `--overlap-param-gather` do.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Overlaps:
    tp_comm: bool = False  # TP collectives hidden behind the layer's GEMMs (what outlasts them is exposed)
    cp_exchange: bool = False  # CP K/V exchange hidden behind attention (what outlasts it is exposed)
    grad_reduce: bool = True  # gradient reduction overlapped with the last backward (bucketed)
    param_gather: bool = True  # distributed-optimizer parameter all-gather overlapped with the next forward
    # CP shards each packed micro-batch as one sequence (2*cp chunks of the whole pack, zigzag), not
    # each document: under document masking the ranks then hold unequal attention pairs and every
    # layer waits for the busiest (`plan.sequence_sharded_pairs`). Megatron's THD path and the
    # SlimPack runtime shard per document; a peer's baseline may be priced as its authors ran it.
    cp_per_sequence: bool = False
    # the flag that gives a run `tp_comm`: TE's userbuffers, or the SlimPack runtime's rings
    tp_comm_flag: str = "--tp-comm-overlap"

    def flags(self) -> list[str]:
        """Megatron-LM flags that give a real run these overlaps."""
        flags = []
        if self.tp_comm:
            flags.append(self.tp_comm_flag)
        if self.grad_reduce:
            flags.append("--overlap-grad-reduce")
        if self.param_gather:
            flags.append("--overlap-param-gather")
        return flags

    def to_dict(self) -> dict:
        return {**asdict(self), "flags": self.flags()}


# What variable-shape runs overlap by default: no TP collective, a blocking K/V gather.
SERIAL = Overlaps()
# The SlimPack runtime with --slimpack-tp-overlap: TP collectives as rings behind the GEMMs next to
# them, as userbuffers chunk them (priced alike), a blocking K/V gather.
SLIMPACK_RUNTIME = Overlaps(tp_comm=True, tp_comm_flag="--slimpack-tp-overlap")
# Stock Megatron-LM on fixed-length sequences with TE: userbuffer TP overlap, ring-attention CP.
FIXED_SHAPE = Overlaps(tp_comm=True, cp_exchange=True)
# Megatron-LM on variable-length THD micro-batches: no userbuffers, TE's ring attention for CP.
VARIABLE_SHAPE_RING_CP = Overlaps(cp_exchange=True)

# strategy name -> its overlaps, filled as strategies register (planner/registry.py): the
# simulator prices a plan with its strategy's overlaps without reaching up into the planner.
_DECLARED: dict[str, Overlaps] = {}


def declare(strategy: str, overlaps: Overlaps) -> None:
    _DECLARED[strategy] = overlaps


def overlaps_of(strategy: str | None) -> Overlaps:
    """The overlaps a strategy declared; a name that declared none runs serial (the SlimPack runtime
    without --slimpack-tp-overlap)."""
    return _DECLARED.get(strategy or "", SERIAL)


__all__ = ["Overlaps", "SERIAL", "SLIMPACK_RUNTIME", "FIXED_SHAPE", "VARIABLE_SHAPE_RING_CP", "declare", "overlaps_of"]
