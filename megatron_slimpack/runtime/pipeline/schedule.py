"""The SlimPack schedule: one global-batch step of this rank's stage (docs/design.md section 3).

`slimpack_forward_backward` is a drop-in `forward_backward_func`: it takes Megatron's keyword
signature (`forward_step_func, data_iterator, model, num_microbatches, seq_length,
micro_batch_size, forward_only`, extra keywords accepted) plus the SlimPack ones (`plan`,
`token_source`, and optionally `groups`, `kv_store`, `timeline`). Megatron's own arguments are
accepted for compatibility only: the plan decides what runs, and the tokens come from
`token_source` (`forward_step_func` and `data_iterator` are not called).

Process groups come in one bundle, `ScheduleGroups` (as megatron-core's `pg_collection`): the
pipeline group and this rank's stage, the data-parallel group and rank (which picks the replica
plans this rank runs), the tensor-parallel rank, the group the plan is checked over, and the
DP-Merge groups. Leave `groups` out and it is built from megatron's `parallel_state` (a single
stage without data parallelism when that is not initialised).

Each pipeline stage (one process holding a megatron-core GPTModel chunk built with
`pre_process`/`post_process` for its stage) runs its stage orders through the one executor,
`runtime.executor.StageExecutor` (p2p, per-MicroPack steps, deallocation, memory meter,
timeline); a single stage and a single replica is just pp=1. The result is the list of its
`UnitReport`s (Megatron-style), with the step's loss on the last stage.

Virtual pipeline stages (interleaved 1F1B, `plan.parallel.vpp` > 1): `model` is the list of the
rank's vpp model chunks, as Megatron's trainer passes it; chunk c of stage s is virtual stage
c * pp + s, built with `vp_stage=c` and `config.virtual_pipeline_model_parallel_size=vpp` (its
layers numbered globally), `pre_process` only on stage 0's chunk 0 and `post_process` only on
the last stage's last chunk (`runtime.model.build_stage_chunks` builds them so). The plan's tasks
`(kind, unit, chunk)` name the chunk each runs on; the schedule checks the chunks against the
plan before anything runs.

DP-Merge groups (docs/design.md section 3): a rank first runs the merge groups it belongs to, each
exactly like a replica plan on this stage (its stage order, p2p to the member's own neighbour
stages) but on the member's share of every MicroPack, with K/V gathered over the stage's merge
group (`groups.merge_groups`, from `runtime.merge.merge_groups`); then its own replica plan.
Unit reports and timeline records of merge-group tasks carry `detail` "merge group [ranks]" and
the merge group's replica index, as the simulator's records do.

Gradient synchronisation is owned here and only here (Megatron's DDP protocol, as
`forward_backward_pipelining_without_interleaving`): when the model config has `no_sync_func`
(Megatron `DistributedDataParallel.no_sync`), it wraps every backward call but this stage's last
one, the backward of the last MicroPack of its last backward unit (a unit runs one backward call
per MicroPack; with overlap_grad_reduce DDP learns in its first step how often each parameter's
hook fires outside no_sync and launches a bucket's reduce once that count is reached, so it must
be the same every step, whatever the units' sizes: once per parameter);
after the last backward `grad_sync_func` (if set) is called with the parameters and
`finalize_model_grads_func([model], None)` once per step (num_tokens is None: the loss is already
divided by the global batch's loss-token count, so DDP must *sum*: build the config with
`calculate_per_token_loss=True` before wrapping, which the schedule checks). With several model
chunks the protocol is `forward_backward_pipelining_with_interleaving`'s: `no_sync_func` and
`grad_sync_func` may be lists (one per chunk); no_sync wraps every backward but each chunk's last
one (re-entered after it), `grad_sync_func[c]` runs right after chunk c's last backward, and
`finalize_model_grads_func(chunks, None)` once with all chunks; `param_sync_func` (the
distributed optimizer's overlapped parameter all-gather) is launched per chunk as there
(`_ParamSync`). A chunk that runs no backward in a step (its replica plan is empty on this rank)
has its overlapped reduce launched by `start_grad_sync()` after the step's backwards, in bucket
order, the order the other ranks' hooks launch theirs. Megatron DDP (0.16.1) runs on CPU with
gloo under `compat.apply()` (overlap_grad_reduce off and on, with and without the distributed
optimizer and grad_sync_func, over several steps: tests/test_overlap_grad_reduce.py).
Fallback without a finalize function (`_reduce_like_finalize`): the reductions of megatron-core's
`finalize_model_grads`, with the step's groups, every chunk alike (`reduce_grads=False` skips
them all):
  1. the data-parallel sum: a Megatron DDP chunk's own `finish_grad_sync()`; for a plain module
     ours, a coalesced `all_reduce(SUM)` of every parameter's `.grad` over `groups.dp_group`
     (Megatron's lives in DDP's buffers, which a plain module has not);
  2. the gradients that are partial per TP rank (sequence-parallel norms, q/k norms), summed over
     `groups.tp_group`: megatron-core's `_allreduce_non_tensor_model_parallel_grads`;
  3. a word embedding tied to the output layer (`share_embeddings_and_output_weights`), summed
     over the first and last stage (`groups.embedding_group`, virtual stages too: the first
     stage's first chunk and the last stage's last chunk): `_allreduce_word_embedding_grads`;
  4. the position embedding over `groups.position_embedding_group` (Megatron's is the first stage
     alone, so it is a no-op there): `_allreduce_position_embedding_grads`.
Megatron's helpers read a DDP chunk's `ddp_config`; a plain module is handed to them in a thin
adapter (`_AsDDPChunk`) and its `.grad` is what they reduce. What they cannot serve is refused
before anything runs with `FallbackReductionError`, which says to pass `finalize_model_grads_func`:
mixture-of-experts models (expert-parallel and router gradients, router expert bias), multi-token
prediction, conditional embedders across stages, weight-rematerialisation groups, a tied
embedding without an embedding group, and any reduction the installed release's
`finalize_model_grads` calls that is not listed here.

Tensor parallelism runs with or without sequence parallelism. Without it each TP rank exchanges
the full activation with its peer in the pipeline group; with it (`config.sequence_parallel`)
every MicroPack (or a merge-group member's share of one) is padded to a multiple of the TP size
(batch.py: a padding segment with no loss that attends to nothing), and stages exchange each TP
rank's share of the rows. The sequence-parallel norms' weight gradients are partial sums per TP
rank: Megatron's `finalize_model_grads` sums them over the TP group; without a finalize function
the schedule does (`groups.tp_group`).

Timing: `timeline=True` (or a `runtime.timing.Timeline`) records every F/B task, blocking
receive and send on every rank against a clock started after a barrier, gathered to the first
rank of `groups.check_group` (`result.timeline`); see timing.py.

Before running, the plan's digest (`plan_digest`, 16 bytes) is compared across all ranks of
`groups.check_group` (default: the world) every step, and the stage orders are checked for
deadlock (a replay of the blocking receives) once per plan and data-parallel rank in a process.
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import itertools
from dataclasses import dataclass
from typing import Any, Optional, cast

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from ...plan import Plan, PlanError, ReplicaPlan, last_forward_needed, task_chunk, tasks_of_chunk
from ..attention.batch import TokenSource, build_batch
from ..attention.core import SlicedAttentionMixin
from ..attention.kv_store import KVStore
from . import p2p
from .executor import StageExecutor, global_loss_tokens, inner_module, megatron_config, read_losses
from .merge import member_batches
from .timing import StageMemory, Timeline


class ScheduleError(RuntimeError):
    """The plan cannot run here: ranks disagree on it, or its stage orders deadlock."""


def _group_size(group) -> int:
    return dist.get_world_size(group) if group is not None and dist.is_initialized() else 1


@dataclass
class ScheduleGroups:
    """The process groups of one rank's step, in one bundle (as megatron-core's `pg_collection`).

    `pp_group`/`pp_rank`: the pipeline group and this rank's stage (None: a single stage).
    `dp_group`/`dp_rank`: the data-parallel group (gradient and loss reduction; None: no data
    parallelism) and this rank's DP rank, which picks the replica plans it runs.
    `tp_group`/`tp_rank`: the tensor-parallel group (sequence-parallel norm gradients, when there
    is no finalize function) and rank (timeline records). `check_group`: the ranks the plan's
    fingerprint is compared over and the timeline is gathered over (None: the world).
    `merge_groups`: {dp_ranks: process group} from `runtime.merge.merge_groups`, needed when the
    plan has DP-Merge groups. `embedding_group` / `position_embedding_group`: Megatron's groups of
    the stages holding a copy of the word / position embedding (the tied word embedding is summed
    over the first and last stage when there is no finalize function).
    """

    pp_group: Any = None
    pp_rank: int = 0
    dp_group: Any = None
    dp_rank: int = 0
    tp_rank: int = 0
    tp_group: Any = None
    check_group: Any = None
    merge_groups: Optional[dict] = None
    embedding_group: Any = None
    position_embedding_group: Any = None

    @property
    def pp_size(self) -> int:
        return _group_size(self.pp_group)

    @property
    def dp_size(self) -> int:
        return _group_size(self.dp_group)

    @classmethod
    def from_parallel_state(cls, merge_groups: Optional[dict] = None) -> "ScheduleGroups":
        """This rank's groups from megatron's `parallel_state` when it is initialised; otherwise a
        single stage without data parallelism."""
        from megatron.core import parallel_state

        if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
            return cls(merge_groups=merge_groups)
        pp_group = parallel_state.get_pipeline_model_parallel_group()
        dp_group = parallel_state.get_data_parallel_group()
        return cls(pp_group=pp_group, pp_rank=dist.get_rank(pp_group) if _group_size(pp_group) > 1 else 0,
                   dp_group=dp_group, dp_rank=dist.get_rank(dp_group),
                   tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                   tp_group=parallel_state.get_tensor_model_parallel_group(), merge_groups=merge_groups,
                   embedding_group=parallel_state.get_embedding_group(check_initialized=False),
                   position_embedding_group=parallel_state.get_position_embedding_group(check_initialized=False))


class ScheduleResult(list):
    """Megatron-style return value: the list of this stage's `UnitReport`s (every stage; loss
    figures only on the last), plus `loss` (per-token mean over the whole global batch, all
    replicas, on the last stage; None elsewhere), `loss_sum` (this rank's replica plans', last
    stage) and `num_loss_tokens` (the global divisor)."""

    loss: Optional[float] = None
    loss_sum: Optional[float] = None
    num_loss_tokens: int = 0
    timeline = None  # the `runtime.timing.Timeline` when the step was timed


# ---- checks --------------------------------------------------------------------------------
def check_stage_orders(replica: ReplicaPlan, vpp: int = 1) -> None:
    """Raise ScheduleError if the stages' task lists deadlock: a task waits for the tensor it
    receives, and (as on NCCL) a send completes only once its receive is posted, with the
    transfers grouped as the executor posts them (p2p.py). Also checks what `Plan.validate`
    checks per stage and model chunk (each unit once, in sequence order, backward after the
    forwards it needs). `vpp`: model chunks per stage (tasks are (kind, unit, chunk) when > 1)."""
    orders = replica.stage_orders
    needs = last_forward_needed(replica.forward_units, replica.backward_units).tolist()
    expected = sorted([("F", u) for u in range(len(replica.forward_units))]
                      + [("B", v) for v in range(len(replica.backward_units))])
    for stage, order in enumerate(orders):
        if any(len(task) != (3 if vpp > 1 else 2) or not 0 <= task_chunk(task) < vpp for task in order):
            raise ScheduleError(f"stage {stage} tasks must be " + (
                f"(kind, unit, chunk) with chunk in 0..{vpp - 1} (vpp={vpp})" if vpp > 1
                else "(kind, unit): the plan has no virtual stages"))
        for chunk in range(vpp):
            where = f"stage {stage}" + (f" chunk {chunk}" if vpp > 1 else "")
            _check_chunk_order(tasks_of_chunk(order, chunk), expected, needs, where)
    try:
        p2p.check_deadlock_free(orders, vpp)
    except p2p.P2PDeadlock as error:
        raise ScheduleError(str(error)) from None


def _check_chunk_order(order: list[tuple[str, int]], expected: list[tuple[str, int]], needs: list[int],
                       where: str) -> None:
    """One model chunk's tasks on one stage: each unit once, forwards in order, backward after the
    forwards it needs."""
    if sorted(order) != expected:
        raise ScheduleError(f"{where} must run each forward and backward unit exactly once")
    done_forward = -1
    for kind, unit in order:
        if kind == "F":
            if unit != done_forward + 1:
                raise ScheduleError(f"{where} runs forward unit {unit} out of order")
            done_forward = unit
        elif needs[unit] > done_forward:
            raise ScheduleError(f"{where} runs backward unit {unit} before the forwards it needs")


def check_same_plan(plan: Plan, group=None, digest: Optional[bytes] = None) -> None:
    """all_gather the plan's digest (`plan_digest`; pass it when already computed) over `group`;
    raise ScheduleError naming the ranks that differ."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return
    mine = torch.frombuffer(bytearray(digest if digest is not None else plan_digest(plan)), dtype=torch.uint8)
    backend = dist.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    mine = mine.to(device)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    # one host read for all ranks' digests, not one per rank
    prints = [bytes(row).hex() for row in torch.stack(everyone).tolist()]
    if len(set(prints)) != 1:
        listing = ", ".join(f"rank {r}: {p}" for r, p in enumerate(prints))
        raise ScheduleError(f"ranks run different plans (plan digests differ: {listing})")


_KINDS = {"F": 0, "B": 1}


def plan_digest(plan: Plan) -> bytes:
    """A 16-byte hash of what `Plan.fingerprint` covers (every field of the plan but its
    metadata), hashed from flat integer arrays rather than the fingerprint's JSON: about 20x
    faster (0.07 s against 1.4 s for a 70B 128K global batch of 130K documents on one CPU core),
    cheap enough for every step. Equal plans give equal digests on every rank, whatever objects
    they are built of."""
    h = hashlib.blake2b(digest_size=16)

    def ints(values) -> None:
        array = np.fromiter(values, dtype=np.int64)
        h.update(len(array).to_bytes(8, "little"))
        h.update(array.tobytes())

    chain = itertools.chain.from_iterable
    parallel = sorted(plan.parallel.to_dict().items())
    h.update(repr((plan.FORMAT_VERSION, plan.strategy, plan.context_length, plan.max_micropack_tokens, parallel,
                   list(plan.repeated_documents))).encode())
    ints(chain(plan.samples))
    ints(chain(plan.sample_sources or ()))
    for replica in plan.replicas:
        ints(replica.dp_ranks)
        ints(len(mp.slices) for mp in replica.micropacks)
        ints(chain(chain(mp.slices for mp in replica.micropacks)))
        for units in (replica.forward_units, replica.backward_units):
            ints(map(len, units))
            ints(chain(units))
        for order in replica.stage_orders:
            # a task is (kind, unit[, chunk]); an order holding anything else (which the checks
            # refuse) is hashed by its text
            try:
                ints(map(len, order))
                ints(_KINDS.get(task[0], -1) for task in order)
                ints(chain(task[1:] for task in order))
                h.update(repr([task[0] for task in order if task[0] not in _KINDS]).encode())
            except (TypeError, ValueError, IndexError):
                h.update(repr(order).encode())
    return h.digest()


class _CheckedPlans:
    """The (plan digest, data-parallel rank) pairs whose stage orders this process has checked:
    the last few, so that a trainer alternating between plans (training and evaluation batches,
    a replayed step) checks none of them twice."""

    def __init__(self, size: int = 8):
        self.size = size
        self.keys: collections.OrderedDict = collections.OrderedDict()

    def __contains__(self, key) -> bool:
        if key in self.keys:
            self.keys.move_to_end(key)
            return True
        return False

    def add(self, key) -> None:
        self.keys[key] = None
        while len(self.keys) > self.size:
            self.keys.popitem(last=False)

    def clear(self) -> None:
        self.keys.clear()


_checked_plans = _CheckedPlans()


def _pick_replicas(plan: Plan, dp_rank: int) -> tuple[list[ReplicaPlan], ReplicaPlan]:
    """(DP-Merge groups this rank belongs to, in plan order; its own replica plan)."""
    mine = plan.replicas_of_rank(dp_rank)
    merged = [r for r in mine if r.is_merge_group]
    own = [r for r in mine if not r.is_merge_group]
    if len(own) != 1:
        raise PlanError(f"data-parallel rank {dp_rank} has {len(own)} replica plans of its own; expected one")
    return merged, own[0]


def _model_chunks(model, vpp: int) -> list:
    """The rank's model chunks as a list: one per virtual stage it holds (`plan.parallel.vpp`)."""
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if len(chunks) != vpp:
        raise ScheduleError(
            f"the plan has {vpp} model chunk(s) per pipeline stage (vpp={vpp}) but model= has {len(chunks)}: "
            + ("pass the list of this rank's model chunks, chunk c built with vp_stage=c "
               "(runtime.model.build_stage_chunks)" if vpp > 1 else "plan with vpp equal to the number of chunks"))
    return chunks


def _check_model(chunks: list, config, groups: ScheduleGroups, forward_only: bool, reduce_grads: bool) -> None:
    if not forward_only and reduce_grads and getattr(config, "finalize_model_grads_func", None) is None:
        reasons = _fallback_refusals(chunks, config, groups)
        if reasons:
            raise FallbackReductionError(
                "without config.finalize_model_grads_func the schedule reduces gradients itself and cannot "
                f"reduce these exactly: {'; '.join(reasons)}. Pass finalize_model_grads_func="
                "megatron.core.distributed.finalize_model_grads (with the model wrapped in Megatron's "
                "DistributedDataParallel, as Megatron's trainer does)")
    if (any(_is_megatron_ddp(chunk) for chunk in chunks) and groups.dp_size > 1
            and not getattr(config, "calculate_per_token_loss", False) and not forward_only):
        raise ScheduleError(
            "with Megatron DDP the schedule needs config.calculate_per_token_loss=True before the model is "
            "wrapped: the loss is already divided by the global batch's token count, so DDP must sum (not "
            "average) gradients over data-parallel ranks")
    if len(chunks) > 1:
        _check_virtual_stages(chunks, groups)


def _check_virtual_stages(chunks: list, groups: ScheduleGroups) -> None:
    """Chunk c of stage s must be virtual stage c * pp + s: embedding only on the first, loss only
    on the last, and layers numbered globally (the KV store keys K/V by layer number, so two chunks
    with the same numbers would read each other's K/V)."""
    owner: dict[int, int] = {}
    for index, chunk in enumerate(chunks):
        inner = inner_module(chunk)
        needed = (groups.pp_rank == 0 and index == 0, groups.pp_rank == groups.pp_size - 1 and index == len(chunks) - 1)
        built = (getattr(inner, "pre_process", needed[0]), getattr(inner, "post_process", needed[1]))
        if built != needed:
            raise ScheduleError(
                f"model chunk {index} of pipeline stage {groups.pp_rank} is built with pre_process={built[0]}, "
                f"post_process={built[1]}; as virtual stage {index * groups.pp_size + groups.pp_rank} it needs "
                f"pre_process={needed[0]}, post_process={needed[1]}")
        for module in inner.modules():
            if isinstance(module, SlicedAttentionMixin):
                if owner.setdefault(module.layer_number, index) != index:
                    raise ScheduleError(
                        f"model chunks {owner[module.layer_number]} and {index} both hold layer "
                        f"{module.layer_number}: build chunk c with vp_stage=c and "
                        f"config.virtual_pipeline_model_parallel_size={len(chunks)}, so that layers are "
                        "numbered globally (runtime.model.build_stage_chunks)")


def _check_replicas(plan: Plan, replicas: list[ReplicaPlan], groups: ScheduleGroups, check_plan: bool) -> None:
    if any(r.is_merge_group for r in replicas) and groups.merge_groups is None:
        raise ScheduleError("the plan has DP-Merge groups: create their process groups once at start-up with "
                            "megatron_slimpack.runtime.pipeline.merge.merge_groups(plan_or_dp_size, dp_group_ranks) "
                            "and pass them as groups=ScheduleGroups(..., merge_groups=...)")
    for replica in replicas:
        if len(replica.stage_orders) != groups.pp_size:
            raise PlanError(f"the plan has {len(replica.stage_orders)} stage orders but the pipeline group has "
                            f"{groups.pp_size} stages")
    if not check_plan:
        return
    # The digest is exchanged every step (one all_gather of 16 bytes): every rank issues that
    # collective whatever it has cached, so a rank whose plan differs is caught in the step where
    # it differs, and no rank can skip the exchange (its own plan unchanged) while the others wait
    # in it. Only the local stage-order check (a replay of every transfer, ~0.5 s per replica
    # at 70B 128K) is skipped for a plan this rank has already checked; the digest covers the
    # plan's content, so a plan changed in place is checked again.
    digest = plan_digest(plan)
    check_same_plan(plan, groups.check_group, digest)
    key = (digest, groups.dp_rank)
    if key not in _checked_plans:
        for replica in replicas:
            check_stage_orders(replica, plan.parallel.vpp)
        _checked_plans.add(key)


# ---- gradient synchronisation (the one owner) ----------------------------------------------
def _is_megatron_ddp(model) -> bool:
    try:
        from megatron.core.distributed import DistributedDataParallel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, DistributedDataParallel)


def _overlaps_grad_reduce(model) -> bool:
    """A Megatron DDP chunk whose hooks launch the reduce during backward (overlap_grad_reduce)."""
    return _is_megatron_ddp(model) and bool(getattr(model.ddp_config, "overlap_grad_reduce", False))


def _all_reduce_sum(grads: list[Tensor], group) -> None:
    """Sum tensors over `group` in place, one flat buffer per dtype."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for grad in grads:
        by_dtype.setdefault(grad.dtype, []).append(grad)
    for same in by_dtype.values():
        flat = torch._utils._flatten_dense_tensors(same)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for grad, reduced in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
            grad.copy_(reduced)


def _reduce_grads(chunks: list, group) -> None:
    """Sum the chunks' parameter gradients over the data-parallel group."""
    if group is None or dist.get_world_size(group) == 1:
        return
    params = [p for chunk in chunks for p in chunk.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    _all_reduce_sum([p.grad for p in params], group)


# ---- the fallback reduction without a finalize function --------------------------------------
class FallbackReductionError(ScheduleError):
    """The model holds gradients that the schedule's own reduction (no finalize function) cannot
    reduce exactly: pass `config.finalize_model_grads_func`."""


# finalize_model_grads' steps (0.16-0.19) that the fallback takes, or that the models it accepts
# make no-ops (MoE routers, multi-token prediction, weight-rematerialisation groups are refused).
_FINALIZE_STEPS_TAKEN = {"_allreduce_non_tensor_model_parallel_grads", "_allreduce_word_embedding_grads",
                         "_allreduce_position_embedding_grads"}
_FINALIZE_STEPS_REFUSED = {"_allreduce_conditional_embedding_grads", "_allreduce_router_grads",
                           "_update_router_expert_bias", "_update_router_qb_beta",
                           "_allreduce_replicated_grads_over_gtp_remat_group"}


def _finalize_module():
    """megatron.core.distributed.finalize_model_grads, the module (the package exports the function
    under the same name)."""
    import importlib

    return importlib.import_module("megatron.core.distributed.finalize_model_grads")


def _finalize_steps() -> set[str]:
    """The gradient reductions the installed megatron-core's finalize_model_grads calls."""
    names = _finalize_module().finalize_model_grads.__code__.co_names
    return {name for name in names if name.startswith(("_allreduce", "_update"))}


def _fallback_refusals(chunks: list, config, groups: ScheduleGroups) -> list[str]:
    """What the model needs reduced that the fallback does not reduce exactly (empty: nothing)."""
    reasons = []
    if getattr(config, "num_moe_experts", None):
        reasons.append("a mixture-of-experts model (num_moe_experts): expert-parallel and router gradients, "
                       "router expert bias")
    if getattr(config, "mtp_num_layers", None):
        reasons.append("multi-token prediction (mtp_num_layers): its embedding copy")
    if getattr(config, "has_cond_embedder", False) and groups.pp_size > 1:
        reasons.append("conditional embedders replicated across pipeline stages (has_cond_embedder)")
    if any((getattr(config, name, None) or 1) > 1 for name in ("gtp_weight_remat_size",
                                                                "expert_gtp_weight_remat_size")):
        reasons.append("weight rematerialisation groups (gtp_weight_remat_size)")
    unknown = sorted(_finalize_steps() - _FINALIZE_STEPS_TAKEN - _FINALIZE_STEPS_REFUSED)
    if unknown:
        reasons.append(f"megatron-core's finalize_model_grads also calls {', '.join(unknown)}")
    if _tied_across_stages(chunks, groups) and groups.embedding_group is None:
        reasons.append("word embeddings tied to the output layer across pipeline stages, without "
                       "groups.embedding_group (Megatron's embedding group) to sum them over")
    return reasons


def _tied_across_stages(chunks: list, groups: ScheduleGroups) -> bool:
    """Whether this rank holds a copy of a word embedding tied to an output layer on another stage."""
    inners = [inner_module(chunk) for chunk in chunks]
    return groups.pp_size > 1 and any(getattr(inner, "share_embeddings_and_output_weights", False)
                                      and (inner.pre_process or inner.post_process) for inner in inners)


class _AsDDPChunk:
    """A plain model chunk as megatron-core's finalize helpers read a DDP chunk: its module under
    `module` and a default `ddp_config` (no FSDP); gradients are read from `.grad`."""

    def __init__(self, module):
        from megatron.core.distributed import DistributedDataParallelConfig

        self.module = module
        self.ddp_config = DistributedDataParallelConfig()


def _reduce_like_finalize(chunks: list, config, groups: ScheduleGroups) -> None:
    """finalize_model_grads without a finalize function: the data-parallel sum (DDP's own
    finish_grad_sync for a DDP chunk; ours for a plain module, whose `.grad` has no DDP buffer),
    then megatron-core's own helpers, in finalize_model_grads' order and with this step's groups:
    TP partial sums (sequence-parallel norms, q/k norms), the tied word
    embedding across the embedding group, the position embedding across its group."""
    helpers = _finalize_module()
    plain = [chunk for chunk in chunks if not _is_megatron_ddp(chunk)]
    for chunk in chunks:
        if _is_megatron_ddp(chunk):
            chunk.finish_grad_sync()
    _reduce_grads(plain, groups.dp_group)
    adapted = [chunk if _is_megatron_ddp(chunk) else _AsDDPChunk(chunk) for chunk in chunks]
    if _group_size(groups.tp_group) > 1:
        helpers._allreduce_non_tensor_model_parallel_grads(adapted, config, groups.tp_group)
    if _group_size(groups.embedding_group) > 1:
        helpers._allreduce_word_embedding_grads(adapted, config, groups.embedding_group, groups.pp_group)
    if _group_size(groups.position_embedding_group) > 1:
        helpers._allreduce_position_embedding_grads(adapted, config, groups.position_embedding_group,
                                                    groups.pp_group)


def _per_chunk(func, count: int) -> Optional[list]:
    """Megatron's config hooks may be one function or a list with one per model chunk."""
    if func is None:
        return None
    if isinstance(func, (list, tuple)):
        return list(func)
    return [func] * count


def _entered_all(funcs: list):
    """One context that enters every chunk's no_sync (Megatron's `multi_no_sync`)."""
    stack = contextlib.ExitStack()
    for func in funcs:
        stack.enter_context(func())
    return stack


class _GradientSync:
    """Megatron's DDP protocol: gradient sync is disabled (no_sync) around every backward but the
    last one of each model chunk, grad_sync_func runs once per chunk, and finalize_model_grads_func
    once per step with every chunk. One chunk follows
    `forward_backward_pipelining_without_interleaving`; several follow
    `forward_backward_pipelining_with_interleaving` (see the module docstring)."""

    def __init__(self, chunks: list, config, *, first_stage: bool, groups: ScheduleGroups, reduce_grads: bool,
                 force_all_reduce: Optional[bool] = None):
        self.chunks, self.config, self.first_stage, self.reduce_grads = chunks, config, first_stage, reduce_grads
        self.interleaved = len(chunks) > 1
        self.groups = groups
        no_sync_func = getattr(config, "no_sync_func", None) or contextlib.nullcontext
        self.no_sync_func = (no_sync_func if not isinstance(no_sync_func, (list, tuple))
                             else lambda: _entered_all(list(no_sync_func)))
        self.grad_sync_funcs = _per_chunk(getattr(config, "grad_sync_func", None), len(chunks))
        self.finalize_func = getattr(config, "finalize_model_grads_func", None)
        # Megatron's train_step passes force_all_reduce (0.16+): forwarded as given.
        self.finalize_kwargs = {"force_all_reduce": force_all_reduce} if force_all_reduce is not None else {}
        self.no_sync_context: Optional[contextlib.AbstractContextManager] = None
        self.synchronized: set[int] = set()  # chunks whose gradient sync has been launched

    def disable(self) -> None:
        if self.no_sync_context is None:
            self.no_sync_context = self.no_sync_func()
            self.no_sync_context.__enter__()

    def enable(self) -> None:
        if self.no_sync_context is not None:
            self.no_sync_context.__exit__(None, None, None)
            self.no_sync_context = None

    def before_last_backward(self, chunk: int) -> None:
        """Before the backward call of chunk's last MicroPack (the last of its last backward
        unit): let DDP's hooks launch its reduction during it (both of Megatron's schedules
        without grad_sync_func; the plain one also on the first stage). Only this one call runs
        outside no_sync, so every parameter's hook fires there exactly once per step: the count
        that overlapped DDP learns in its first step and waits for in every later one, whatever
        the number of MicroPacks in the last unit."""
        if self.grad_sync_funcs is None or (self.first_stage and not self.interleaved):
            self.enable()
            self.synchronized.add(chunk)

    def after_last_backward(self, chunk: int) -> None:
        """After chunk's last backward (interleaved only): launch its sync with grad_sync_func, and
        disable sync again for the other chunks' backwards still to come."""
        if not self.interleaved:
            return  # the plain schedule syncs in finish(): nothing runs after its last backward
        if self.grad_sync_funcs is not None:
            self.enable()
            self.grad_sync_funcs[chunk](self.chunks[chunk].parameters())
            self.synchronized.add(chunk)
        self.disable()

    def finish(self) -> bool:
        """After the step's last backward; returns whether gradients were reduced."""
        self.enable()
        for chunk, model in enumerate(self.chunks):
            if chunk in self.synchronized:
                continue
            if self.grad_sync_funcs is not None:
                self.grad_sync_funcs[chunk](model.parameters())
            elif _overlaps_grad_reduce(model):
                # No backward ran on this chunk outside no_sync (its own replica plan is empty
                # here): its hooks launched nothing, so launch the reduce as grad_sync_func would.
                model.start_grad_sync()
        if self.finalize_func is not None:
            # The loss was divided by the global loss-token count already: no num_tokens scaling.
            self.finalize_func(self.chunks, None, **self.finalize_kwargs)
            return True
        if not self.reduce_grads:
            return False
        _reduce_like_finalize(self.chunks, self.config, self.groups)
        groups = self.groups
        return any(_group_size(group) > 1 for group in (groups.dp_group, groups.tp_group, groups.embedding_group,
                                                        groups.position_embedding_group))


class _ParamSync:
    """Megatron's overlapped parameter all-gather with virtual stages (the distributed optimizer
    with --overlap-param-gather, aligned by default: `config.param_sync_func`, one per chunk):
    chunks 0 and 1 are launched when the step starts and chunk c + 1 when chunk c's first forward
    begins, as `forward_backward_pipelining_with_interleaving` does (it shifts that launch earlier
    by the pipeline rank; here each rank launches at its own first forward). With one chunk DDP's
    forward pre-hooks gather on demand, as in Megatron's plain 1F1B; a chunk not launched in time
    is gathered by them too, so the launch points decide overlap, never correctness."""

    def __init__(self, chunks: list, config):
        self.chunks = chunks
        funcs = getattr(config, "param_sync_func", None)
        self.funcs = _per_chunk(funcs, len(chunks)) if len(chunks) > 1 else None
        self.launched: set[int] = set()

    def start(self) -> None:
        for chunk in (0, 1):
            self._launch(chunk)

    def before_forward(self, chunk: int) -> None:
        self._launch(chunk)
        self._launch(chunk + 1)

    def _launch(self, chunk: int) -> None:
        if self.funcs is None or chunk >= len(self.chunks) or chunk in self.launched:
            return
        self.launched.add(chunk)
        self.funcs[chunk](self.chunks[chunk].parameters())


# ---- the step ------------------------------------------------------------------------------
def _start_timeline(timeline, groups: ScheduleGroups):
    """(the started Timeline or None, this stage's StageMemory record or None)."""
    if timeline is True:
        timeline = Timeline(group=groups.check_group)
    if timeline is None or timeline is False:
        return None, None
    timeline.start(rank=groups.dp_rank, stage=groups.pp_rank, tp_rank=groups.tp_rank)
    if not timeline.track_memory:
        return timeline, None
    return timeline, StageMemory(groups.dp_rank, groups.pp_rank, tp_rank=groups.tp_rank)


def _batches(replica: ReplicaPlan, token_source: TokenSource, store: KVStore, groups: ScheduleGroups, device,
             pad_to: int) -> list:
    """One batch per MicroPack: whole, or this member's share when `replica` is a merge group;
    padded to a multiple of `pad_to` rows (sequence parallelism)."""
    if not replica.is_merge_group:
        return [build_batch(mp, token_source, store, device, pad_to) for mp in replica.micropacks]
    merge_groups = cast(dict, groups.merge_groups)  # checked present for a merge group (_check_replicas)
    return member_batches(replica, token_source, store, merge_groups[tuple(replica.dp_ranks)],
                          replica.dp_ranks.index(groups.dp_rank), device, pad_to)


def _step_loss(result: ScheduleResult, loss_sum: float, dp_group) -> None:
    """The last stage's loss: this rank's sum, and the global per-token mean (summed over DP)."""
    result.loss_sum = loss_sum
    total = torch.tensor([loss_sum], dtype=torch.float64)
    if _group_size(dp_group) > 1:
        if dist.get_backend(dp_group) == "nccl":
            total = total.cuda()
        dist.all_reduce(total, group=dp_group)
    result.loss = float(total) / result.num_loss_tokens


def slimpack_forward_backward(
    *,
    model,
    plan: Plan,
    token_source: TokenSource,
    forward_only: bool = False,
    groups: Optional[ScheduleGroups] = None,
    kv_store: Optional[KVStore] = None,
    reduce_grads: bool = True,
    check_plan: bool = True,
    timeline=None,
    force_all_reduce: Optional[bool] = None,
) -> ScheduleResult:
    """Run this rank's stage of its replica plans for one global-batch step (see module doc).

    `model`: this rank's model chunk, or the list of its chunks (one per virtual stage it holds:
    `plan.parallel.vpp`). Gradients accumulate into the chunks' parameters' `.grad` (or Megatron
    DDP's `main_grad`); zero them before the step, as with Megatron's schedules. `groups`: default
    `ScheduleGroups.from_parallel_state()`. `timeline`: True or a `runtime.timing.Timeline` to record every
    task's start and end (returned as `result.timeline`). `kv_store`: default a fresh one.
    `force_all_reduce`: passed on to the finalize function, as Megatron's schedules do. Megatron's
    other schedule arguments (micro-batch counts, sequence lengths, the data iterator) mean nothing
    here: the trainer's adapter (`megatron.hooks.slimpack_forward_backward_func`) absorbs them.
    """
    chunks = _model_chunks(model, plan.parallel.vpp)
    groups = groups if groups is not None else ScheduleGroups.from_parallel_state()
    config = megatron_config(chunks[0])
    _check_model(chunks, config, groups, forward_only, reduce_grads)
    merged, own = _pick_replicas(plan, groups.dp_rank)
    _check_replicas(plan, merged + [own], groups, check_plan)

    timeline, memory_record = _start_timeline(timeline, groups)
    store = kv_store if kv_store is not None else KVStore()
    executor = StageExecutor(chunks, num_loss_tokens=global_loss_tokens(plan), store=store, pp_group=groups.pp_group,
                             pp_rank=groups.pp_rank, pp_size=groups.pp_size, forward_only=forward_only,
                             timeline=timeline, memory_record=memory_record)
    sync = _GradientSync(chunks, config, first_stage=executor.first, groups=groups,
                         reduce_grads=reduce_grads, force_all_reduce=force_all_reduce)
    result = ScheduleResult()
    result.num_loss_tokens = executor.num_loss_tokens
    position_of = {id(r): i for i, r in enumerate(plan.replicas)}
    param_sync = None if forward_only else _ParamSync(chunks, config)
    if param_sync is not None:
        param_sync.start()
        sync.disable()
    try:
        # DP-Merge groups first (docs/design.md section 3): members share each outlier's tokens.
        for replica in merged + [own]:
            reports = executor.run(
                replica, _batches(replica, token_source, store, groups, executor.device, executor.sequence_shards),
                replica_index=position_of[id(replica)],
                detail=f"merge group {list(replica.dp_ranks)}" if replica.is_merge_group else "",
                grad_sync=None if replica.is_merge_group or forward_only else sync, param_sync=param_sync)
            result += reports
        executor.pending.wait_all()
        if not forward_only:
            if len(store):
                raise RuntimeError(f"after the step {len(store)} KV entries remain: some backward did not run")
            reduce_start = timeline.now() if timeline else 0.0
            if sync.finish() and timeline:
                timeline.replica = -1  # as the simulator's DP record
                timeline.record("DP", -1, reduce_start, timeline.now(), "gradient reduction")
    finally:
        sync.enable()
        if forward_only:
            store.clear()
        executor.pending.wait_all()
    if executor.last:
        # Every replica plan's losses in one host read: a read per plan would stall the stream
        # once per merge group.
        read_losses(result)
        _step_loss(result, sum((r.loss_sum for r in result if r.loss_sum is not None), 0.0), groups.dp_group)
    if timeline is not None:
        if memory_record is not None:
            timeline.memory.append(memory_record)
        timeline.gather()
        result.timeline = timeline
    return result
