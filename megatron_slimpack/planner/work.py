"""Fast linear surrogates of the cost model for the planner's inner loops.

The planner moves tens of thousands of documents around per step; it cannot call the full cost
model per candidate move. `WorkRates` linearises it around a reference MicroPack size: the work
of `tokens` tokens and `pairs` attention pairs is `per_token*tokens + per_pair*pairs` seconds,
summed over all pipeline stages (the replica's total compute).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..costmodel import Amount, CostModel
from ..specs import ParallelConfig


def causal_pairs(length: int, prefix: int = 0) -> int:
    """Attention pairs of `length` query tokens after a KV prefix of `prefix` tokens."""
    return length * prefix + length * (length + 1) // 2


@dataclass(frozen=True)
class WorkRates:
    forward_per_token: float
    forward_per_pair: float
    backward_per_token: float
    backward_per_pair: float
    # The analytic model's GEMMs run a MicroPack of t tokens at t / (t + half_tokens) of peak
    # efficiency: the rates hold at `reference_tokens`, a smaller MicroPack costs more per unit.
    reference_tokens: float = 0.0
    half_tokens: float = 0.0
    # Seconds (forward + backward, all stages) a MicroPack costs whatever its size: the GEMMs'
    # row overhead (rows cost rows + half_tokens) and the collectives' latencies. The rates spread
    # it over `reference_tokens`; attention and element-wise work have no such term (varlen
    # attention runs each document at its own length's rate, whatever the pack).
    per_pack: float = 0.0

    @classmethod
    def from_cost(cls, cost: CostModel, parallel: ParallelConfig, reference_tokens: int) -> "WorkRates":
        tokens = max(reference_tokens, 1)
        pairs = causal_pairs(tokens)

        def rates(backward: bool) -> tuple[float, float]:
            stages = cost.layers_per_stage(parallel) * parallel.virtual_stages
            base = (cost.layer_time(tokens, 0, parallel, backward) + cost.tp_comm_time(tokens, parallel, backward)
                    + cost.cp_comm_time(tokens, parallel, backward))
            with_pairs = cost.layer_time(tokens, pairs, parallel, backward)
            per_token = stages * base / tokens + cost.head_time(tokens, parallel, backward) / tokens
            per_pair = stages * (with_pairs - cost.layer_time(tokens, 0, parallel, backward)) / pairs
            return per_token, per_pair

        forward, backward = rates(False), rates(True)
        # Efficiency is a function of a device's share of the tokens: in whole-MicroPack tokens its
        # half point is cp times larger. A profiled model has no such curve (its intercept stays).
        half = cost.pack_half_tokens(parallel)
        per_pack = 0.0
        if half:
            # Every term is affine in a MicroPack's tokens: the per-token rates at two sizes give
            # the per-MicroPack seconds they spread over the tokens.
            stages = cost.layers_per_stage(parallel) * parallel.virtual_stages

            def per_token(size: float) -> float:
                return sum(stages * (cost.layer_time(size, 0, parallel, backward)
                                     + cost.tp_comm_time(size, parallel, backward)
                                     + cost.cp_comm_time(size, parallel, backward))
                           + cost.head_time(size, parallel, backward) for backward in (False, True)) / size

            per_pack = max(0.0, (per_token(tokens) - per_token(2.0 * tokens)) * 2.0 * tokens)
        return cls(forward[0], forward[1], backward[0], backward[1], float(tokens), float(half), per_pack)

    def forward(self, tokens: Amount, pairs: Amount) -> Amount:
        return self.forward_per_token * tokens + self.forward_per_pair * pairs

    def backward(self, tokens: Amount, pairs: Amount) -> Amount:
        return self.backward_per_token * tokens + self.backward_per_pair * pairs

    def total(self, tokens: Amount, pairs: Amount) -> Amount:
        return self.forward(tokens, pairs) + self.backward(tokens, pairs)

    def size_penalty(self, tokens, pairs=0.0):
        """How much more a MicroPack of `tokens` tokens and `pairs` attention pairs costs per unit
        of work than at the reference size (scalars or arrays; 1 where the rates carry no
        efficiency curve): its `per_pack` seconds, which the rates spread over the reference
        size, fall on its own tokens. Attention-heavy MicroPacks are penalised less (their
        attention runs at its documents' rate whatever the pack's size)."""
        if not self.half_tokens:
            return 1.0 + 0.0 * tokens
        spread = self.per_pack * (1.0 - tokens / self.reference_tokens)
        return 1.0 + spread / self.total(tokens, pairs)

    def document(self, length: int) -> float:
        """Forward + backward seconds of a whole document run alone."""
        return self.total(length, causal_pairs(length))
