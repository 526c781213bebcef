"""Run one replica's plan on one pipeline stage (PP=1): forward units, then backward units, in
exactly the order of `stage_orders[0]` (design.md section 3).

The per-MicroPack step functions are the building blocks the pipeline schedule reuses:

    output = forward_step(model, batch, input_tensor=recv)   # hidden states, or the loss sum
    input_grad = backward_step(output, output_grad, input_tensor=recv)

On the last stage `output` is the MicroPack's summed per-token loss and `output_grad` is
`1 / global_loss_tokens` (Megatron's `calculate_per_token_loss`: one division for the whole
global batch); elsewhere it is the gradient received from the next stage. K/V gradients between
slices need nothing from the caller: they flow through the KV store as long as backward runs
MicroPacks in the plan's backward-sequence order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from ..plan import Plan, ReplicaPlan
from .attention import KVStore
from .batch import MicroPackBatch, TokenSource, build_batch


def forward_step(model, batch: MicroPackBatch, input_tensor: Optional[Tensor] = None) -> Tensor:
    """Forward of one MicroPack (one packed THD call) on this stage.

    `input_tensor`: the previous stage's output for this MicroPack ([T, 1, h], a leaf requiring
    grad) on every stage but the first. Returns the masked loss sum (a scalar) on the last
    stage, the hidden states [T, 1, h] elsewhere.
    """
    if input_tensor is not None:
        model.set_input_tensor(input_tensor)
    last_stage = getattr(model, "post_process", True)
    output = model(
        batch.tokens, batch.position_ids, None,
        labels=batch.labels if last_stage else None, packed_seq_params=batch.packed_seq_params,
    )
    if last_stage:
        return (output.float() * batch.loss_mask).sum()
    return output


def backward_step(output: Tensor, output_grad: Tensor | float, input_tensor: Optional[Tensor] = None) -> Optional[Tensor]:
    """Backward of one MicroPack; returns the gradient for the previous stage (or None)."""
    if not isinstance(output_grad, Tensor):
        output_grad = torch.tensor(output_grad, dtype=output.dtype, device=output.device)
    torch.autograd.backward(output, grad_tensors=output_grad)
    return input_tensor.grad if input_tensor is not None else None


def split_into_leaves(unit_activation: Tensor, token_counts: list[int]) -> list[Tensor]:
    """A received forward unit's activation [sum T, 1, h] -> one leaf per MicroPack (in unit
    order), so that backward units, grouped differently, can run and return gradients per
    MicroPack. Pass each leaf as `input_tensor` to `forward_step` and `backward_step`."""
    return [part.detach().requires_grad_() for part in unit_activation.split(token_counts, dim=0)]


def global_loss_tokens(plan: Plan) -> int:
    """Tokens that carry a label in the whole global batch: every token but each document's last."""
    return plan.num_tokens - len(plan.samples)


@dataclass
class UnitReport:
    kind: str  # "F" or "B"
    index: int
    micropacks: list[int]
    tokens: int
    attention_pairs: int
    seconds: float


@dataclass
class StepResult:
    loss: float  # per-token mean over the global batch (this replica's share when DP > 1)
    loss_sum: float
    num_loss_tokens: int  # the divisor
    units: list[UnitReport] = field(default_factory=list)


def run_stage_order(model, replica: ReplicaPlan, batches: list[MicroPackBatch], num_loss_tokens: int,
                    forward_only: bool) -> tuple[float, list[UnitReport]]:
    """Run a one-stage replica's task list: forward units keep their MicroPacks' outputs, backward
    units run them in backward-sequence order. Returns (this rank's loss sum, per-unit reports)."""
    outputs: dict[int, Tensor] = {}
    reports: list[UnitReport] = []
    loss_sum = 0.0
    with torch.set_grad_enabled(not forward_only):
        for kind, unit in replica.stage_orders[0]:
            if kind == "B" and forward_only:
                continue
            members = (replica.forward_units if kind == "F" else replica.backward_units)[unit]
            began = time.perf_counter()
            for mp in members:
                if kind == "F":
                    outputs[mp] = forward_step(model, batches[mp])
                    loss_sum += float(outputs[mp].detach())
                else:
                    backward_step(outputs.pop(mp), 1.0 / num_loss_tokens)
            reports.append(UnitReport(
                kind, unit, list(members), sum(batches[m].num_tokens for m in members),
                sum(replica.micropacks[m].attention_pairs for m in members), time.perf_counter() - began,
            ))
    return loss_sum, reports


class SingleStageExecutor:
    """Executes `ReplicaPlan`s on a megatron-core GPTModel built with the SlimPack layer spec."""

    def __init__(self, model, source: TokenSource, kv_store: Optional[KVStore] = None):
        self.model = model
        self.source = source
        self.kv_store = kv_store if kv_store is not None else KVStore()

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def batches(self, replica: ReplicaPlan) -> list[MicroPackBatch]:
        return [build_batch(mp, self.source, self.kv_store, self.device) for mp in replica.micropacks]

    def run(self, replica: ReplicaPlan, *, num_loss_tokens: Optional[int] = None,
            forward_only: bool = False) -> StepResult:
        """One step of `replica`. Gradients accumulate into the parameters' `.grad` (zero them
        before, reduce over DP after, as with Megatron's schedules). `num_loss_tokens`: the global
        batch's labelled tokens (default: this replica's)."""
        if len(replica.stage_orders) != 1:
            raise ValueError(f"the single-stage executor runs pp=1 plans; this one has {len(replica.stage_orders)} stages")
        batches = self.batches(replica)
        if num_loss_tokens is None:
            num_loss_tokens = sum(batch.num_loss_tokens for batch in batches)
        try:
            loss_sum, reports = run_stage_order(self.model, replica, batches, num_loss_tokens, forward_only)
            if not forward_only and len(self.kv_store):
                raise RuntimeError(f"KV store holds {len(self.kv_store)} entries after the step: some slice's "
                                   "backward did not run, or did not hand off and free its K/V")
        finally:
            if forward_only:
                self.kv_store.clear()
        return StepResult(loss_sum / num_loss_tokens, loss_sum, num_loss_tokens, reports)
