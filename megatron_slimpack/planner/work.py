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
    # The analytic model's kernels run a MicroPack of t tokens at t / (t + half_tokens) of peak
    # efficiency: the rates hold at `reference_tokens`, a smaller MicroPack costs more per unit.
    reference_tokens: float = 0.0
    half_tokens: float = 0.0

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
        return cls(forward[0], forward[1], backward[0], backward[1], float(tokens), float(half))

    def forward(self, tokens: Amount, pairs: Amount) -> Amount:
        return self.forward_per_token * tokens + self.forward_per_pair * pairs

    def backward(self, tokens: Amount, pairs: Amount) -> Amount:
        return self.backward_per_token * tokens + self.backward_per_pair * pairs

    def total(self, tokens: Amount, pairs: Amount) -> Amount:
        return self.forward(tokens, pairs) + self.backward(tokens, pairs)

    def size_penalty(self, tokens):
        """How much more a MicroPack of `tokens` costs per unit of work than one of the reference
        size (scalars or arrays; 1 where the rates carry no efficiency curve)."""
        if not self.half_tokens:
            return 1.0 + 0.0 * tokens
        return (((tokens + self.half_tokens) / tokens)
                / ((self.reference_tokens + self.half_tokens) / self.reference_tokens))

    def document(self, length: int) -> float:
        """Forward + backward seconds of a whole document run alone."""
        return self.total(length, causal_pairs(length))
