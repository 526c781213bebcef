"""The stage executor: runs replica plans' task lists on one pipeline stage (docs/design.md section 3).

There is one executor, `StageExecutor`, for every layout: one stage and one replica is just
pp=1. The schedule (`runtime.schedule.slimpack_forward_backward`) creates one per step and runs
the rank's DP-Merge groups, then its own replica plan, through it; every unit it runs yields a
`UnitReport`.

The per-MicroPack step functions are its building blocks (the profiler times them alone):

    output = forward_step(model, batch, input_tensor=recv)   # hidden states, or the loss sum
    input_grad = backward_step(output, output_grad, input_tensor=recv)

On the last stage `output` is the MicroPack's summed per-token loss and `output_grad` is
`1 / global_loss_tokens` (Megatron's `calculate_per_token_loss`: one division for the whole
global batch); elsewhere it is the gradient received from the next stage. K/V gradients between
slices need nothing from the caller: they flow through the KV store as long as backward runs
MicroPacks in the plan's backward-sequence order.

Per unit on stage s (`replica.stage_orders[s]`; "the previous/next stage" is the neighbouring
virtual stage under virtual pipeline stages, see below):

* forward unit u: receive the unit's activation from the previous stage (a [sum of the unit's
  MicroPack tokens, 1, hidden] tensor, this TP rank's share of the rows under sequence
  parallelism: the shape comes from the plan, there is no shape
  exchange), split it into one leaf per MicroPack (`split_into_leaves`), run `forward_step` per
  MicroPack, concatenate the outputs: the activation for the next stage;
* backward unit v: receive the gradient of the unit's outputs (ordered as the backward unit lists
  its MicroPacks), run `backward_step` per MicroPack in that order (on the last stage the output
  is the MicroPack's loss sum and its gradient is `_loss_seed`), concatenate the input gradients
  in the same order: the gradient for the previous stage.

Virtual pipeline stages (interleaved 1F1B, `ParallelConfig.vpp` > 1): the executor gets this
rank's model chunks, a list; chunk c of stage s is virtual stage c * pp + s, and every task
`(kind, unit, chunk)` runs on its chunk, with the chunk's own held tensors. Only the first
virtual stage (stage 0's chunk 0) embeds tokens and only the last (the last stage's last chunk)
computes the loss; every other chunk receives an activation and sends one on, the last stage's
chunk c to stage 0's chunk c + 1. K/V of sliced documents need nothing more: the chunks' layers
are numbered globally (megatron-core's `vp_stage` offsets), so their KV-store entries are
distinct, and each chunk runs its backward units in backward-sequence order.

Communication is plain `torch.distributed` point-to-point over the pipeline process group (gloo
on CPU, or NCCL), not Megatron's `p2p_communication` (which assumes CUDA), in the program of
p2p.py: a task's outgoing tensor goes out together with the next task's receive in one
`batch_isend_irecv` (NCCL-safe when neighbours send to each other at once); receives are waited
on, sends stay pending until the schedule waits on them. Every rank posts the transfers it shares
with a peer in one global order (p2p.py), so they match without tags, also where two ranks
exchange both kinds in both directions (virtual stages).
`config.deallocate_pipeline_outputs` frees a stage's outputs' data once sent (backward then goes
through megatron's `custom_backward`).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor

from ...plan import Plan, ReplicaPlan, task_chunk
from ..attention.batch import MicroPackBatch
from ..attention.kv_store import KVStore
from . import p2p
from .timing import SavedBytesMeter


# ---- per-MicroPack steps -------------------------------------------------------------------
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


def backward_step(output: Tensor, output_grad: Tensor | float,
                  input_tensor: Optional[Tensor] = None) -> Optional[Tensor]:
    """Backward of one MicroPack; returns the gradient for the previous stage (or None)."""
    if not isinstance(output_grad, Tensor):  # a fill on the device: no copy from the host
        output_grad = torch.full((), output_grad, dtype=output.dtype, device=output.device)
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


# ---- the model as the executor sees it -----------------------------------------------------
def inner_module(model):
    """The module that owns `set_input_tensor` / `post_process` (through DDP / Float16 wrappers)."""
    inner = model
    while not hasattr(inner, "post_process") and hasattr(inner, "module"):
        inner = inner.module
    return inner


def sequence_shards(config) -> int:
    """Shares of every MicroPack's rows between TP ranks: the TP size under sequence parallelism
    (batches are padded to a multiple of it), else 1."""
    tp_size = getattr(config, "tensor_model_parallel_size", 1) or 1
    return tp_size if getattr(config, "sequence_parallel", False) else 1


def megatron_config(model):
    """The model's megatron-core TransformerConfig (on the wrapper, or on the wrapped module)."""
    return getattr(model, "config", None) or getattr(inner_module(model), "config", None)


def _free_output(output: Tensor) -> bool:
    """Megatron's `deallocate_output_tensor`: keep only the autograd node of a sent output."""
    if output._base is not None or output.numel() <= 1:
        return False
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)
    return True


def _backward(output: Tensor, grad, input_tensor: Optional[Tensor], freed: bool) -> Optional[Tensor]:
    if not freed:
        return backward_step(output, grad, input_tensor=input_tensor)
    from megatron.core.pipeline_parallel.schedules import custom_backward

    custom_backward(output, grad)  # the C++ engine skips the shape check of the freed output
    return input_tensor.grad if input_tensor is not None else None


def _label(transfer: "p2p.Transfer", pp_size: int) -> str:
    """Timeline detail of a transfer, as the simulator writes it: "F 0->1" between pipeline
    stages (the record's chunk says which model chunk)."""
    return f"{transfer.kind} {transfer.source % pp_size}->{transfer.destination % pp_size}"


# ---- reports -------------------------------------------------------------------------------
@dataclass
class UnitReport:
    """One forward ("F") or backward ("B") unit run on this stage."""

    kind: str
    index: int  # the unit's index in its replica plan's forward_units / backward_units
    micropacks: list[int]
    tokens: int
    attention_pairs: int
    seconds: float  # wall time of the unit on this stage, its receive included
    # forward units on the last stage: the summed per-token loss (a device scalar until `read_losses`)
    loss_sum: Optional[float | Tensor] = None
    detail: str = ""  # "merge group [ranks]" for a DP-Merge group's units
    chunk: int = 0  # the model chunk it ran on (virtual pipeline stages; 0 without)


def read_losses(reports: list[UnitReport]) -> None:
    """The forward units' loss sums, device scalars until now, as floats: one host read for all
    (the schedule reads once per step, after every replica plan has run)."""
    with_loss = [report for report in reports if report.loss_sum is not None]
    if not with_loss:
        return
    values = torch.stack([cast(Tensor, report.loss_sum) for report in with_loss]).tolist()
    for report, value in zip(with_loss, values):
        report.loss_sum = value


# ---- the executor --------------------------------------------------------------------------
class _PendingSends:
    """Non-blocking sends in flight; completion is polled (for the timeline) at task boundaries."""

    def __init__(self, timeline):
        self.items: list[list] = []  # [handle, tensor, unit, detail, posted_at, chunk]
        self.timeline = timeline

    def add(self, handle, tensor, unit: int, detail: str, chunk: int = 0) -> None:
        self.items.append([handle, tensor, unit, detail, self.timeline.now() if self.timeline else 0.0, chunk])

    def poll(self) -> None:
        if self.timeline is None:
            return
        keep = []
        for item in self.items:
            if item[0].is_completed():
                self.timeline.record("P2P", item[2], item[4], self.timeline.now(), item[3], item[5])
            else:
                keep.append(item)
        self.items = keep

    def wait_all(self) -> None:
        for handle, _, unit, detail, posted, chunk in self.items:
            handle.wait()
            if self.timeline is not None:
                self.timeline.record("P2P", unit, posted, self.timeline.now(), detail, chunk)
        self.items = []


@dataclass
class _HeldTensors:
    """A replica plan's MicroPack tensors between their forward and their backward on one model
    chunk of this stage."""

    inputs: dict = field(default_factory=dict)   # received leaves, per MicroPack (not on the first stage)
    outputs: dict = field(default_factory=dict)  # forward outputs kept for backward
    freed: set = field(default_factory=set)      # outputs whose data was deallocated after the send


class StageExecutor:
    """Runs replica plans' task lists on this pipeline stage: blocking receives, one
    `forward_step`/`backward_step` per MicroPack, non-blocking sends. One executor per step; the
    schedule runs the rank's merge groups, then its own replica, through it, so their sends share
    one `pending` list (wait on it before the step ends).

    `model`: this stage's model chunk, or its list of chunks (virtual pipeline stages: chunk c is
    virtual stage c * pp_size + pp_rank). `first` / `last`: whether this stage holds the first /
    last virtual stage (it is the first / last pipeline stage).
    `timeline` (a started `runtime.timing.Timeline`) records every task; `memory_record` (a
    `StageMemory`) collects saved-tensor bytes per MicroPack (summed over the chunks) and the
    stage's peak.
    """

    def __init__(self, model, *, num_loss_tokens: int, store: KVStore, pp_group=None, pp_rank: int = 0,
                 pp_size: int = 1, forward_only: bool = False, timeline=None, memory_record=None):
        self.chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        config = megatron_config(self.chunks[0])
        param = next(self.chunks[0].parameters())
        self.inners = [inner_module(chunk) for chunk in self.chunks]
        self.vpp = len(self.chunks)
        self.pp_group, self.pp_rank = pp_group, pp_rank
        self.pp_size = pp_size
        self.first, self.last = pp_rank == 0, pp_rank == pp_size - 1
        self._outbox: dict = {}  # Transfer -> tensor produced, not yet posted
        self._inbox: dict = {}   # Transfer -> (buffer, request, posted at): posted, not yet consumed
        self.hidden = config.hidden_size
        # Under sequence parallelism a stage's activations are this TP rank's share of the rows.
        self.sequence_shards = sequence_shards(config)
        self.dtype = getattr(config, "pipeline_dtype", None) or param.dtype
        self.device = param.device
        # The loss chunk's outputs are scalars that are never sent: only sent activations are freed.
        self.deallocate = bool(getattr(config, "deallocate_pipeline_outputs", False))
        self.grad_scale_func = getattr(config, "grad_scale_func", None)
        self.num_loss_tokens, self.forward_only, self.store = num_loss_tokens, forward_only, store
        self.timeline, self.memory_record = timeline, memory_record
        self.meter = None
        if memory_record is not None:
            self.meter = SavedBytesMeter({p.untyped_storage().data_ptr() for chunk in self.chunks
                                          for p in chunk.parameters()})
        self.pending = _PendingSends(timeline)
        self.live_bytes: dict[tuple[int, int], int] = {}  # (chunk, MicroPack) -> saved bytes

    def is_input_chunk(self, chunk: int) -> bool:
        """Whether `chunk` is the first virtual stage (embeds tokens, receives nothing)."""
        return self.first and chunk == 0

    def is_loss_chunk(self, chunk: int) -> bool:
        """Whether `chunk` is the last virtual stage (computes the loss, receives no gradient)."""
        return self.last and chunk == self.vpp - 1

    # ---- one replica plan ----------------------------------------------------------------
    def run(self, replica: ReplicaPlan, batches: list, *, replica_index: int, detail: str = "",
            grad_sync=None, param_sync=None) -> list[UnitReport]:
        """Run `replica.stage_orders[pp_rank]` on `batches` (one per MicroPack: whole, or this
        member's share in a merge group). `replica_index`: the replica plan's position in the plan
        (timeline records); `detail`: carried by its reports and records. `grad_sync` (DDP's
        gradient sync, the schedule's `_GradientSync`): its `before_last_backward(chunk)` is called
        right before the last MicroPack's backward of each chunk's last backward unit (the step's
        only backward call that may run outside DDP's no_sync) and `after_last_backward(chunk)`
        after that unit;
        `param_sync` (the overlapped parameter all-gather, the schedule's `_ParamSync`): its
        `before_forward(chunk)` before every forward."""
        stage_tasks = [[task for task in order if not (self.forward_only and task[0] == "B")]
                       for order in replica.stage_orders]
        tasks = stage_tasks[self.pp_rank]
        last_backward = {task_chunk(task): position for position, task in enumerate(tasks) if task[0] == "B"}
        counts = [batch.num_tokens // self.sequence_shards for batch in batches]  # activation rows

        def members_of(kind: str, unit: int) -> list[int]:
            return (replica.forward_units if kind == "F" else replica.backward_units)[unit]

        def tokens_of(transfer) -> int:
            return sum(counts[mp] for mp in members_of(transfer.kind, transfer.unit))

        calls = {call.before: call for call in p2p.stage_program(stage_tasks, self.pp_rank, vpp=self.vpp)}
        if self.timeline is not None:
            self.timeline.replica = replica_index
        held = [_HeldTensors() for _ in self.chunks]
        reports = []
        with torch.set_grad_enabled(not self.forward_only):
            for position, task in enumerate(tasks):
                kind, unit, chunk = task[0], task[1], task_chunk(task)
                members = members_of(kind, unit)
                sizes = [counts[mp] for mp in members]
                began = time.perf_counter()
                self.pending.poll()
                self._post(calls.get(position), tokens_of)
                received = self._received(p2p.incoming(task, self.pp_rank, self.pp_size, self.vpp), chunk)
                loss_sum = None
                is_last_backward = grad_sync is not None and last_backward.get(chunk) == position
                if kind == "F":
                    if param_sync is not None:
                        param_sync.before_forward(chunk)
                    loss_sum, sent = self._forward_unit(unit, chunk, members, sizes, batches, held[chunk], detail,
                                                        received)
                else:
                    before_last_micropack = partial(grad_sync.before_last_backward, chunk) if is_last_backward else None
                    sent = self._backward_unit(unit, chunk, members, sizes, held[chunk], detail, received,
                                               before_last_micropack)
                    if is_last_backward:
                        grad_sync.after_last_backward(chunk)
                outgoing = p2p.outgoing(task, self.pp_rank, self.pp_size, self.vpp)
                if outgoing is not None:
                    self._outbox[outgoing] = (sent, chunk)
                reports.append(UnitReport(
                    kind, unit, list(members), sum(batches[mp].num_tokens for mp in members),
                    sum(replica.micropacks[mp].attention_pairs for mp in members),
                    time.perf_counter() - began, loss_sum, detail, chunk))
            self._post(calls.get(len(tasks)), tokens_of)
        remaining = sum(len(chunk_held.outputs) for chunk_held in held)
        if not self.forward_only and remaining:
            raise RuntimeError(f"after the step {remaining} MicroPack outputs remain: some backward did not run")
        self.live_bytes.clear()
        return reports

    # ---- point-to-point, record, memory --------------------------------------------------
    def _post(self, call: Optional[p2p.P2PCall], tokens_of) -> None:
        """Post one call of the stage's p2p program (p2p.py) as one `batch_isend_irecv`: sends of
        tensors earlier tasks produced, receives into [tokens, 1, hidden] buffers (the shape comes
        from the plan). Sends stay pending; receives are waited on by their consumer."""
        if call is None:
            return
        ops = [dist.P2POp(dist.isend, self._outbox[t][0], self._peer(t.destination), self.pp_group)
               for t in call.sends]
        buffers = [torch.empty(tokens_of(t), 1, self.hidden, dtype=self.dtype, device=self.device)
                   for t in call.receives]
        ops += [dist.P2POp(dist.irecv, buffer, self._peer(t.source), self.pp_group)
                for t, buffer in zip(call.receives, buffers)]
        posted = self.timeline.now() if self.timeline else 0.0
        requests = dist.batch_isend_irecv(ops)
        for transfer, request in zip(call.sends, requests):
            tensor, chunk = self._outbox.pop(transfer)
            self.pending.add(request, tensor, transfer.unit, _label(transfer, self.pp_size), chunk)
        for transfer, buffer, request in zip(call.receives, buffers, requests[len(call.sends):]):
            self._inbox[transfer] = (buffer, request, posted)

    def _received(self, transfer: Optional[p2p.Transfer], chunk: int) -> Optional[Tensor]:
        """Wait for a posted receive and hand its buffer to the consuming task (on `chunk`)."""
        if transfer is None:
            return None
        buffer, request, posted = self._inbox.pop(transfer)
        request.wait()
        if self.timeline:
            self.timeline.record("RECV", transfer.unit, posted, self.timeline.now(), _label(transfer, self.pp_size),
                                 chunk)
        return buffer

    def _peer(self, virtual_stage: int) -> int:
        return dist.get_global_rank(self.pp_group, virtual_stage % self.pp_size)

    def _record(self, kind: str, unit: int, start: float, detail: str, chunk: int) -> None:
        if self.timeline:
            self.timeline.record(kind, unit, start, self.timeline.now(), detail, chunk)

    def _note_memory(self) -> None:
        if self.memory_record is not None:
            current = sum(self.live_bytes.values()) + self.store.nbytes()
            self.memory_record.peak_activation_bytes = max(self.memory_record.peak_activation_bytes, current)

    def _metered_forward(self, mp: int, chunk: int, batch, leaf, detail: str) -> Tensor:
        if self.meter is None:
            return forward_step(self.inners[chunk], batch, input_tensor=leaf)
        with self.meter:
            output = forward_step(self.inners[chunk], batch, input_tensor=leaf)
        self.live_bytes[(chunk, mp)] = self.meter.bytes
        if not detail:  # per-MicroPack figures of the rank's own replica (fidelity), all chunks together
            figures = self.memory_record.micropack_bytes
            figures[mp] = figures.get(mp, 0) + self.meter.bytes
        self._note_memory()
        return output

    # ---- units -----------------------------------------------------------------------------
    def _forward_unit(self, unit, chunk, members, sizes, batches, held: _HeldTensors, detail,
                      buffer: Optional[Tensor]) -> tuple[Optional[Tensor], Optional[Tensor]]:
        """Forward of one unit on `chunk`, on its received activation `buffer` (None on the first
        virtual stage); returns (its loss sum on the last virtual stage, a device scalar; the
        activation to send on the others)."""
        leaves: list[Optional[Tensor]] = [None] * len(members)
        if not self.is_input_chunk(chunk):
            received = cast(Tensor, buffer)  # every chunk but the input one receives its activation
            leaves = list(split_into_leaves(received, sizes))
            if self.meter is not None:
                self.meter.shared = {received.untyped_storage().data_ptr()}
        task_start = self.timeline.now() if self.timeline else 0.0
        computes_loss = self.is_loss_chunk(chunk)
        sent, unit_loss = [], None
        for mp, leaf in zip(members, leaves):
            output = self._metered_forward(mp, chunk, batches[mp], leaf, detail)
            if computes_loss:  # summed on the device: read once per step (`read_losses`)
                loss = output.detach().double()
                unit_loss = loss if unit_loss is None else unit_loss + loss
            else:
                sent.append(output.detach())
            if not self.forward_only:
                held.outputs[mp] = output
                if leaf is not None:
                    held.inputs[mp] = leaf
        if computes_loss:
            self._record("F", unit, task_start, detail, chunk)
            return unit_loss, None
        activation = torch.cat(sent).to(self.dtype).contiguous()
        del sent
        if self.deallocate and not self.forward_only:
            held.freed.update(mp for mp in members if _free_output(held.outputs[mp]))
        self._record("F", unit, task_start, detail, chunk)
        return None, activation

    def _loss_seed(self, like: Tensor) -> Tensor:
        """The last stage's backward seed: 1 / global loss tokens, times the loss scale when the
        optimizer has one (fp16; Megatron's backward_step applies config.grad_scale_func the same way)."""
        seed = torch.full((), 1.0 / self.num_loss_tokens, dtype=like.dtype, device=like.device)
        if self.grad_scale_func is None:
            return seed
        return self.grad_scale_func(seed).to(like.dtype).reshape(like.shape)  # Megatron's scale is a [1] tensor

    def _backward_unit(self, unit, chunk, members, sizes, held: _HeldTensors, detail,
                       buffer: Optional[Tensor], before_last_micropack=None) -> Optional[Tensor]:
        """Backward of one unit on `chunk`, on its received output gradient `buffer` (None on the
        last virtual stage); returns the input gradient to send upstream (None on the first).
        `before_last_micropack` (if given) is called right before the unit's last MicroPack's
        backward."""
        grads: list = [None] * len(members)
        if not self.is_loss_chunk(chunk):
            grads = list(cast(Tensor, buffer).split(sizes, dim=0))  # received: not the loss chunk
        task_start = self.timeline.now() if self.timeline else 0.0
        upstream = []
        for position, (mp, grad, size) in enumerate(zip(members, grads, sizes)):
            if before_last_micropack is not None and position == len(members) - 1:
                before_last_micropack()
            leaf = held.inputs.pop(mp, None)
            output = held.outputs.pop(mp)
            if grad is None:
                grad = self._loss_seed(output)
            input_grad = _backward(output, grad, leaf, mp in held.freed)
            held.freed.discard(mp)
            if not self.is_input_chunk(chunk):
                if input_grad is None:
                    input_grad = torch.zeros(size, 1, self.hidden, dtype=self.dtype, device=self.device)
                upstream.append(input_grad)
        for mp in members:
            self.live_bytes.pop((chunk, mp), None)
        self._note_memory()
        self._record("B", unit, task_start, detail, chunk)
        if self.is_input_chunk(chunk):
            return None
        return torch.cat(upstream).to(self.dtype).contiguous()
