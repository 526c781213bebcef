"""Pipeline-parallel schedule for one `ReplicaPlan` (design.md section 3).

`slimpack_forward_backward` is a drop-in `forward_backward_func`: it takes Megatron's keyword
signature (`forward_step_func, data_iterator, model, num_microbatches, seq_length,
micro_batch_size, forward_only`, extra keywords accepted) plus the SlimPack ones (`plan`,
`token_source`, and optionally `replica_index`/`dp_rank`, `pp_group`, `pp_rank`, `dp_group`,
`kv_store`). Megatron's own arguments are accepted for compatibility only: the plan decides what
runs, and the tokens come from `token_source` (`forward_step_func` and `data_iterator` are not
called).

Each pipeline stage (one process holding a megatron-core GPTModel chunk built with
`pre_process`/`post_process` for its stage) runs exactly `replica.stage_orders[pp_rank]`:

* forward unit u: receive the unit's activation from the previous stage (blocking `recv` of a
  [sum of the unit's MicroPack tokens, 1, hidden] tensor: the shape comes from the plan, there
  is no shape exchange), split it into one leaf per MicroPack (`split_into_leaves`), run
  `forward_step` per MicroPack, concatenate the outputs and `isend` them to the next stage;
* backward unit v: receive the gradient of the unit's outputs (ordered as the backward unit lists
  its MicroPacks), run `backward_step` per MicroPack in that order (on the last stage the output
  is the MicroPack's loss sum and its gradient is 1 / global loss tokens), concatenate the input
  gradients in the same order and `isend` them upstream.

Communication is plain `torch.distributed` point-to-point over the pipeline process group (gloo
on CPU, or NCCL), not Megatron's `p2p_communication` (which assumes CUDA). Sends are
non-blocking; their handles are waited on before the function returns. Messages between two
neighbouring stages flow in one direction per kind (activations downstream in forward-unit
order, gradients upstream in backward-unit order) and each side posts them in the same order, so
they match without tags.

Data parallelism (Megatron's DDP protocol, as `forward_backward_pipelining_without_interleaving`):
when the model config has `no_sync_func` (Megatron `DistributedDataParallel.no_sync`), it wraps every
backward but this stage's last one; after the last backward `grad_sync_func` (if set) is called
with the parameters and `finalize_model_grads_func([model], None)` once per step (num_tokens is
None: the loss is already divided by the global batch's loss-token count, so DDP must *sum*:
build the config with `calculate_per_token_loss=True` before wrapping, which the schedule checks).
Megatron DDP (0.16.1) runs on CPU with gloo under `compat.apply()` (overlap_grad_reduce=False
tested). Fallback without a finalize function: a Megatron DDP model gets `finish_grad_sync()`,
a plain module a coalesced `all_reduce(SUM)` of every parameter's `.grad` over the DP group
(`reduce_grads=False` skips it). `config.deallocate_pipeline_outputs` frees a stage's outputs'
data once sent (backward then goes through megatron's `custom_backward`).

DP-Merge groups (design.md section 3): a rank first runs the merge groups it belongs to, each
exactly like a replica plan on this stage (its stage order, p2p to the member's own neighbour
stages) but on the member's share of every MicroPack, with K/V gathered over the stage's merge
group (`merge_process_groups`, from `runtime.merge.merge_groups`); then its own replica plan.
Per-unit reports and timeline records of merge-group tasks carry `detail` "merge group [ranks]"
and the merge group's replica index, as the simulator's records do.

Tensor parallelism without sequence parallelism works (each TP rank exchanges the full
activation with its peer in the pipeline group); sequence parallelism is refused with a clear
`ScheduleError`.

Timing: `timeline=True` (or a `runtime.timing.Timeline`) records every F/B task, blocking
receive and send on every rank against a clock started after a barrier, gathered to rank 0
(`result.timeline`); see timing.py.

Before running, the plan's fingerprint is compared across all ranks of `check_group` (default:
the world) and the stage orders are checked for deadlock (a replay of the blocking receives).
"""
from __future__ import annotations

import contextlib
import time
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from ..plan import Plan, PlanError, ReplicaPlan, last_forward_needed
from .attention import KVStore
from .batch import TokenSource, build_batch
from .executor import backward_step, forward_step, global_loss_tokens, split_into_leaves
from .merge import member_batches


class ScheduleError(RuntimeError):
    """The plan cannot run here: ranks disagree on it, or its stage orders deadlock."""


class ScheduleResult(list):
    """Megatron-style return value: the list of per-unit report dicts (on every stage; loss
    figures only on the last), plus `loss` (per-token mean over the whole global batch, all
    replicas, on the last stage; None elsewhere), `loss_sum` (this replica's) and
    `num_loss_tokens` (the global divisor)."""

    loss: Optional[float] = None
    loss_sum: Optional[float] = None
    num_loss_tokens: int = 0
    timeline = None  # the `runtime.timing.Timeline` when the step was timed


# ---- checks --------------------------------------------------------------------------------
def check_stage_orders(replica: ReplicaPlan) -> None:
    """Raise ScheduleError if the stages' task lists deadlock under blocking receives.

    Replays all stages: F u on stage s waits for F u on stage s - 1; B v on stage s waits for
    B v on stage s + 1 (sends never block). Also checks what `Plan.validate` checks per stage
    (each unit once, in sequence order, backward after the forwards it needs)."""
    orders = replica.stage_orders
    pp = len(orders)
    needs = last_forward_needed(replica.forward_units, replica.backward_units).tolist()
    expected = sorted([("F", u) for u in range(len(replica.forward_units))]
                      + [("B", v) for v in range(len(replica.backward_units))])
    for stage, order in enumerate(orders):
        if sorted(order) != expected:
            raise ScheduleError(f"stage {stage} must run each forward and backward unit exactly once")
        done_forward = -1
        for kind, unit in order:
            if kind == "F":
                if unit != done_forward + 1:
                    raise ScheduleError(f"stage {stage} runs forward unit {unit} out of order")
                done_forward = unit
            elif needs[unit] > done_forward:
                raise ScheduleError(f"stage {stage} runs backward unit {unit} before the forwards it needs")
    done = [set() for _ in range(pp)]
    position = [0] * pp
    progress = True
    while progress:
        progress = False
        for stage in range(pp):
            while position[stage] < len(orders[stage]):
                kind, unit = orders[stage][position[stage]]
                peer = stage - 1 if kind == "F" else stage + 1
                if 0 <= peer < pp and (kind, unit) not in done[peer]:
                    break
                done[stage].add((kind, unit))
                position[stage] += 1
                progress = True
    stuck = [(stage, orders[stage][position[stage]]) for stage in range(pp) if position[stage] < len(orders[stage])]
    if stuck:
        waits = ", ".join(f"stage {s} waits at {k}{u}" for s, (k, u) in stuck)
        raise ScheduleError(f"the plan's stage orders deadlock: {waits}")


def check_same_plan(plan: Plan, group=None) -> None:
    """all_gather the plan fingerprint over `group`; raise ScheduleError naming the ranks that differ."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = torch.tensor(list(plan.fingerprint().encode()), dtype=torch.uint8)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = mine.to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    prints = [bytes(t.cpu().tolist()).decode(errors="replace") for t in everyone]
    if len(set(prints)) != 1:
        listing = ", ".join(f"rank {r}: {p}" for r, p in enumerate(prints))
        raise ScheduleError(f"ranks run different plans (fingerprints differ: {listing})")


def _pick_replicas(plan: Plan, replica_index: Optional[int], dp_rank: Optional[int]) -> tuple[list[ReplicaPlan], ReplicaPlan]:
    """(DP-Merge groups this rank belongs to, in plan order; its own replica plan)."""
    if replica_index is not None:
        replica = plan.replicas[replica_index]
        if replica.is_merge_group:
            raise ScheduleError("replica_index names a DP-Merge group: pass dp_rank instead, so the rank runs its "
                                "merge groups and then its own replica plan")
        return [], replica
    mine = plan.replicas_of_rank(dp_rank or 0)
    merged = [r for r in mine if r.is_merge_group]
    own = [r for r in mine if not r.is_merge_group]
    if len(own) != 1:
        raise PlanError(f"data-parallel rank {dp_rank} has {len(own)} replica plans of its own; expected one")
    return merged, own[0]


def _reduce_grads(model, group) -> None:
    """Sum parameter gradients over the data-parallel group, one flat buffer per dtype."""
    if group is None or dist.get_world_size(group) == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for p in params:
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(grads)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for grad, reduced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            grad.copy_(reduced)


# ---- the schedule --------------------------------------------------------------------------
def _is_megatron_ddp(model) -> bool:
    try:
        from megatron.core.distributed import DistributedDataParallel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, DistributedDataParallel)


def _inner_module(model):
    """The module that owns `set_input_tensor` / `post_process` (through DDP / Float16 wrappers)."""
    inner = model
    while not hasattr(inner, "post_process") and hasattr(inner, "module"):
        inner = inner.module
    return inner


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


class _Pending:
    """Non-blocking sends in flight; completion is polled (for the timeline) at task boundaries."""

    def __init__(self, timeline):
        self.items: list[list] = []  # [handle, tensor, unit, detail, posted_at]
        self.timeline = timeline

    def add(self, handle, tensor, unit: int, detail: str) -> None:
        self.items.append([handle, tensor, unit, detail, self.timeline.now() if self.timeline else 0.0])

    def poll(self) -> None:
        if self.timeline is None:
            return
        keep = []
        for item in self.items:
            if item[0].is_completed():
                self.timeline.record("P2P", item[2], item[4], self.timeline.now(), item[3])
            else:
                keep.append(item)
        self.items = keep

    def wait_all(self) -> None:
        for handle, _, unit, detail, posted in self.items:
            handle.wait()
            if self.timeline is not None:
                self.timeline.record("P2P", unit, posted, self.timeline.now(), detail)
        self.items = []


class _StageRunner:
    """Runs replica plans' task lists on this pipeline stage: blocking receives, one
    `forward_step`/`backward_step` per MicroPack, non-blocking sends. One runner per step; it
    runs the rank's merge groups, then its own replica, so their sends share one `_Pending`."""

    def __init__(self, *, inner, pp_group, pp_rank: int, pp_size: int, hidden: int, dtype, device,
                 deallocate: bool, num_loss_tokens: int, forward_only: bool, store: KVStore, timeline,
                 meter=None, memory_record=None, grad_scale_func=None):
        self.inner, self.pp_group, self.pp_rank = inner, pp_group, pp_rank
        self.first, self.last = pp_rank == 0, pp_rank == pp_size - 1
        self.prev_rank = dist.get_global_rank(pp_group, pp_rank - 1) if not self.first else None
        self.next_rank = dist.get_global_rank(pp_group, pp_rank + 1) if not self.last else None
        self.hidden, self.dtype, self.device = hidden, dtype, device
        self.deallocate = deallocate and not self.last
        self.num_loss_tokens, self.forward_only, self.store = num_loss_tokens, forward_only, store
        self.grad_scale_func = grad_scale_func
        self.timeline, self.meter, self.memory_record = timeline, meter, memory_record
        self.pending = _Pending(timeline)
        self.live_bytes: dict[int, int] = {}

    def _note_memory(self) -> None:
        if self.memory_record is not None:
            current = sum(self.live_bytes.values()) + self.store.nbytes()
            self.memory_record.peak_activation_bytes = max(self.memory_record.peak_activation_bytes, current)

    def _receive(self, tokens: int, source: int, unit: int, label: str) -> Tensor:
        """Blocking receive of a [tokens, 1, hidden] activation or gradient (shape from the plan)."""
        buffer = torch.empty(tokens, 1, self.hidden, dtype=self.dtype, device=self.device)
        waited = self.timeline.now() if self.timeline else 0.0
        dist.recv(buffer, src=source, group=self.pp_group)
        if self.timeline:
            self.timeline.record("RECV", unit, waited, self.timeline.now(), label)
        return buffer

    def _record(self, kind: str, unit: int, start: float, detail: str) -> None:
        if self.timeline:
            self.timeline.record(kind, unit, start, self.timeline.now(), detail)

    def run(self, replica: ReplicaPlan, batches, *, replica_index: int, detail: str = "",
            before_last_backward=None) -> tuple[float, list[dict]]:
        """Run `replica.stage_orders[pp_rank]` on `batches` (one per MicroPack: whole, or this
        member's share in a merge group). Returns (loss sum on the last stage, per-unit reports).
        `before_last_backward` is called just before the order's last backward (DDP's grad sync)."""
        order = replica.stage_orders[self.pp_rank]
        last_backward = max((i for i, (kind, _) in enumerate(order) if kind == "B"), default=None)
        counts = [batch.num_tokens for batch in batches]
        if self.timeline is not None:
            self.timeline.replica = replica_index
        inputs: dict[int, Tensor] = {}   # received leaves, per MicroPack (not on the first stage)
        outputs: dict[int, Tensor] = {}  # forward outputs kept for backward
        freed: set[int] = set()          # outputs whose data was deallocated after the send
        reports, loss_sum = [], 0.0
        with torch.set_grad_enabled(not self.forward_only):
            for position, (kind, unit) in enumerate(order):
                if kind == "B" and self.forward_only:
                    continue
                members = (replica.forward_units if kind == "F" else replica.backward_units)[unit]
                sizes = [counts[mp] for mp in members]
                began = time.perf_counter()
                report = {"kind": kind, "index": unit, "micropacks": list(members), "tokens": sum(sizes),
                          "attention_pairs": sum(replica.micropacks[mp].attention_pairs for mp in members)}
                if detail:
                    report["detail"] = detail
                self.pending.poll()
                if kind == "F":
                    unit_loss = self._forward(unit, members, sizes, batches, inputs, outputs, freed, detail)
                    if self.last:
                        loss_sum += unit_loss
                        report["loss_sum"] = unit_loss
                else:
                    if position == last_backward and before_last_backward is not None:
                        before_last_backward()
                    self._backward_unit(unit, members, sizes, inputs, outputs, freed, detail)
                report["seconds"] = time.perf_counter() - began
                reports.append(report)
        if not self.forward_only and outputs:
            raise RuntimeError(f"after the step {len(outputs)} MicroPack outputs remain: some backward did not run")
        self.live_bytes.clear()
        return loss_sum, reports

    def _forward(self, unit, members, sizes, batches, inputs, outputs, freed, detail) -> float:
        leaves = [None] * len(members)
        if not self.first:
            buffer = self._receive(sum(sizes), self.prev_rank, unit, f"F {self.pp_rank - 1}->{self.pp_rank}")
            leaves = split_into_leaves(buffer, sizes)
            if self.meter is not None:
                self.meter.shared = {buffer.untyped_storage().data_ptr()}
        task_start = self.timeline.now() if self.timeline else 0.0
        sent, unit_loss = [], 0.0
        for mp, leaf in zip(members, leaves):
            if self.meter is not None:
                with self.meter:
                    output = forward_step(self.inner, batches[mp], input_tensor=leaf)
                self.live_bytes[mp] = self.meter.bytes
                if not detail:  # per-MicroPack figures of the rank's own replica (fidelity)
                    self.memory_record.micropack_bytes[mp] = self.meter.bytes
                self._note_memory()
            else:
                output = forward_step(self.inner, batches[mp], input_tensor=leaf)
            if self.last:
                unit_loss += float(output.detach())
            else:
                sent.append(output.detach())
            if not self.forward_only:
                outputs[mp] = output
                if leaf is not None:
                    inputs[mp] = leaf
        if self.last:
            self._record("F", unit, task_start, detail)
            return unit_loss
        activation = torch.cat(sent).to(self.dtype).contiguous()
        del sent
        if self.deallocate and not self.forward_only:
            freed.update(mp for mp in members if _free_output(outputs[mp]))
        self._record("F", unit, task_start, detail)
        self.pending.add(dist.isend(activation, dst=self.next_rank, group=self.pp_group), activation, unit,
                         f"F {self.pp_rank}->{self.pp_rank + 1}")
        return 0.0

    def _loss_seed(self, like: Tensor) -> Tensor:
        """The last stage's backward seed: 1 / global loss tokens, times the loss scale when the
        optimizer has one (fp16; Megatron's backward_step applies config.grad_scale_func the same way)."""
        seed = torch.tensor(1.0 / self.num_loss_tokens, dtype=like.dtype, device=like.device)
        if self.grad_scale_func is None:
            return seed
        return self.grad_scale_func(seed).to(like.dtype).reshape(like.shape)  # Megatron's scale is a [1] tensor

    def _backward_unit(self, unit, members, sizes, inputs, outputs, freed, detail) -> None:
        grads: list = [None] * len(members)
        if not self.last:
            buffer = self._receive(sum(sizes), self.next_rank, unit, f"B {self.pp_rank + 1}->{self.pp_rank}")
            grads = list(buffer.split(sizes, dim=0))
        task_start = self.timeline.now() if self.timeline else 0.0
        upstream = []
        for mp, grad, size in zip(members, grads, sizes):
            leaf = inputs.pop(mp, None)
            output = outputs.pop(mp)
            if grad is None:
                grad = self._loss_seed(output)
            input_grad = _backward(output, grad, leaf, mp in freed)
            freed.discard(mp)
            if not self.first:
                if input_grad is None:
                    input_grad = torch.zeros(size, 1, self.hidden, dtype=self.dtype, device=self.device)
                upstream.append(input_grad)
        for mp in members:
            self.live_bytes.pop(mp, None)
        self._note_memory()
        self._record("B", unit, task_start, detail)
        if not self.first:
            gradient = torch.cat(upstream).to(self.dtype).contiguous()
            self.pending.add(dist.isend(gradient, dst=self.prev_rank, group=self.pp_group), gradient, unit,
                             f"B {self.pp_rank}->{self.pp_rank - 1}")


def slimpack_forward_backward(
    *,
    forward_step_func=None,
    data_iterator=None,
    model,
    num_microbatches: Optional[int] = None,
    seq_length: Optional[int] = None,
    micro_batch_size: Optional[int] = None,
    forward_only: bool = False,
    plan: Plan,
    token_source: TokenSource,
    replica_index: Optional[int] = None,
    dp_rank: Optional[int] = None,
    pp_group=None,
    pp_rank: Optional[int] = None,
    dp_group=None,
    check_group=None,
    kv_store: Optional[KVStore] = None,
    reduce_grads: bool = True,
    check_plan: bool = True,
    timeline=None,
    merge_process_groups: Optional[dict] = None,
    **kwargs,
) -> ScheduleResult:
    """Run this rank's stage of one replica plan for one global-batch step (see module doc).

    Gradients accumulate into the chunk's parameters' `.grad` (or Megatron DDP's `main_grad`);
    zero them before the step, as with Megatron's schedules. `pp_group`/`pp_rank`/`dp_group`
    default to megatron's parallel state when it is initialised, else to a single stage / no data
    parallelism. `timeline`: True or a `runtime.timing.Timeline` to record every task's start and
    end (gathered to the first rank of `check_group`; returned as `result.timeline`).
    `merge_process_groups`: from `runtime.merge.merge_groups` (this rank's DP group's layouts),
    needed when the plan has DP-Merge groups: each rank runs its merge groups first, on its
    pipeline stage with the stage's merge group for the context-parallel attention, then its own
    replica plan.
    """
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise NotImplementedError("virtual pipeline stages (several model chunks) are not supported")
        model = model[0]
    from megatron.core import parallel_state

    megatron_ready = dist.is_initialized() and parallel_state.model_parallel_is_initialized()
    if pp_group is None and megatron_ready:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    pp_size = dist.get_world_size(pp_group) if (pp_group is not None and dist.is_initialized()) else 1
    if pp_rank is None:
        pp_rank = dist.get_rank(pp_group) if pp_size > 1 else 0
    if dp_group is None and megatron_ready:
        dp_group = parallel_state.get_data_parallel_group()
    if dp_rank is None and replica_index is None:
        dp_rank = dist.get_rank(dp_group) if dp_group is not None else 0
    dp_size = dist.get_world_size(dp_group) if (dp_group is not None and dist.is_initialized()) else 1
    tp_rank = parallel_state.get_tensor_model_parallel_rank() if megatron_ready else 0

    inner = _inner_module(model)
    config = getattr(model, "config", None) or getattr(inner, "config", None)
    tp_size = getattr(config, "tensor_model_parallel_size", 1) or 1
    if tp_size > 1 and getattr(config, "sequence_parallel", False):
        raise ScheduleError(
            "the SlimPack pipeline schedule does not support sequence parallelism yet (MicroPacks are not padded "
            "to a multiple of tp and activations would be sent as TP shards); set sequence_parallel=False "
            "(tensor parallelism without sequence parallelism is supported)")
    ddp = _is_megatron_ddp(model)
    if ddp and dp_size > 1 and not getattr(config, "calculate_per_token_loss", False) and not forward_only:
        raise ScheduleError(
            "with Megatron DDP the schedule needs config.calculate_per_token_loss=True before the model is "
            "wrapped: the loss is already divided by the global batch's token count, so DDP must sum (not "
            "average) gradients over data-parallel ranks")

    merged_replicas, replica = _pick_replicas(plan, replica_index, dp_rank)
    if merged_replicas and merge_process_groups is None:
        raise ScheduleError("the plan has DP-Merge groups: create their process groups once at start-up with "
                            "megatron_slimpack.runtime.merge.merge_groups(plan_or_dp_size, dp_group_ranks) and pass "
                            "them as merge_process_groups=")
    for checked in merged_replicas + [replica]:
        if len(checked.stage_orders) != pp_size:
            raise PlanError(f"the plan has {len(checked.stage_orders)} stage orders but the pipeline group has "
                            f"{pp_size} stages")
    if check_plan:
        check_same_plan(plan, check_group)
        for checked in merged_replicas + [replica]:
            check_stage_orders(checked)

    if timeline is True:
        from .timing import Timeline

        timeline = Timeline(group=check_group)
    elif timeline is False:
        timeline = None
    replica_rank = dp_rank if dp_rank is not None else (replica.dp_ranks[0] if replica.dp_ranks else 0)
    param = next(model.parameters())
    num_loss_tokens = global_loss_tokens(plan)
    store = kv_store if kv_store is not None else KVStore()
    meter = memory_record = None
    if timeline is not None:
        timeline.start(rank=replica_rank, stage=pp_rank, tp_rank=tp_rank)
        if timeline.track_memory:
            from .timing import SavedBytesMeter, StageMemory

            meter = SavedBytesMeter({p.untyped_storage().data_ptr() for p in model.parameters()})
            memory_record = StageMemory(replica_rank, pp_rank, tp_rank=tp_rank)
    runner = _StageRunner(
        inner=inner, pp_group=pp_group, pp_rank=pp_rank, pp_size=pp_size, hidden=config.hidden_size,
        dtype=getattr(config, "pipeline_dtype", None) or param.dtype, device=param.device,
        deallocate=bool(getattr(config, "deallocate_pipeline_outputs", False)), num_loss_tokens=num_loss_tokens,
        forward_only=forward_only, store=store, timeline=timeline, meter=meter, memory_record=memory_record,
        grad_scale_func=getattr(config, "grad_scale_func", None))

    # Megatron DDP protocol (as forward_backward_pipelining_without_interleaving): gradient sync is
    # disabled (no_sync) around every backward but this stage's last one; then grad_sync_func (if
    # any) and finalize_model_grads_func once per step.
    no_sync_func = getattr(config, "no_sync_func", None) or contextlib.nullcontext
    grad_sync_func = getattr(config, "grad_sync_func", None)
    finalize_func = getattr(config, "finalize_model_grads_func", None)
    no_sync_context = None

    def disable_grad_sync():
        nonlocal no_sync_context
        if no_sync_context is None:
            no_sync_context = no_sync_func()
            no_sync_context.__enter__()

    def enable_grad_sync():
        nonlocal no_sync_context
        if no_sync_context is not None:
            no_sync_context.__exit__(None, None, None)
            no_sync_context = None

    def before_last_backward():
        if grad_sync_func is None or runner.first:
            enable_grad_sync()

    result = ScheduleResult()
    loss_sum = 0.0
    position_of = {id(r): i for i, r in enumerate(plan.replicas)}
    if not forward_only:
        disable_grad_sync()
    try:
        # DP-Merge groups first (design.md section 3): members share each outlier's tokens.
        for merged in merged_replicas:
            batches = member_batches(merged, token_source, store, merge_process_groups[tuple(merged.dp_ranks)],
                                     merged.dp_ranks.index(dp_rank), param.device)
            share, reports = runner.run(merged, batches, replica_index=position_of[id(merged)],
                                        detail=f"merge group {list(merged.dp_ranks)}")
            loss_sum += share
            result += reports
        batches = [build_batch(mp, token_source, store, param.device) for mp in replica.micropacks]
        own_loss, reports = runner.run(replica, batches, replica_index=position_of[id(replica)],
                                       before_last_backward=before_last_backward)
        loss_sum += own_loss
        result += reports
        runner.pending.wait_all()
        if not forward_only:
            if len(store):
                raise RuntimeError(f"after the step {len(store)} KV entries remain: some backward did not run")
            reduce_start = timeline.now() if timeline else 0.0
            if no_sync_context is not None:
                enable_grad_sync()
                if grad_sync_func is not None:
                    grad_sync_func(model.parameters())
            if finalize_func is not None:
                # The loss was divided by the global loss-token count already: no num_tokens scaling.
                if "force_all_reduce" in kwargs:  # Megatron's train_step passes it (0.16+)
                    finalize_func([model], None, force_all_reduce=kwargs["force_all_reduce"])
                else:
                    finalize_func([model], None)
            elif reduce_grads:
                if ddp:
                    model.finish_grad_sync()
                else:
                    _reduce_grads(model, dp_group)
            if timeline and (finalize_func is not None or (reduce_grads and dp_size > 1)):
                timeline.replica = -1  # as the simulator's DP record
                timeline.record("DP", -1, reduce_start, timeline.now(), "gradient reduction")
    finally:
        if no_sync_context is not None:
            enable_grad_sync()
        if forward_only:
            store.clear()
        runner.pending.wait_all()
    result.num_loss_tokens = num_loss_tokens
    if runner.last:
        result.loss_sum = loss_sum
        total = torch.tensor([loss_sum], dtype=torch.float64)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            if dist.get_backend(dp_group) == "nccl":
                total = total.cuda()
            dist.all_reduce(total, group=dp_group)
        result.loss = float(total) / num_loss_tokens
    if timeline is not None:
        if memory_record is not None:
            timeline.memory.append(memory_record)
        timeline.gather()
        result.timeline = timeline
    return result
