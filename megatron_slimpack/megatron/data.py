"""The planner iterator: global batches in, one identical plan per step on every rank out.

`PlannerIterator` wraps a `workload.GlobalBatchSampler` (document lengths of each global batch
and where their tokens live) and a planning function. It

* plans ahead: a background worker draws batch n+1.. n+plan_ahead and plans them while step n
  trains, so planning is off the critical path. The worker is a spawned process by default
  (`backend="auto"`/`"process"`, megatron/planner_process.py): the planner is mostly pure Python
  and would hold the training process's GIL against the thread that launches the kernels. A
  thread (`backend="thread"`) is the fallback: used when the plan function or the sampler does
  not pickle (a closure; "auto" then says nothing, "process" warns) or when the worker process
  cannot start (a warning). `plan_ahead=0` plans inline, in `next()`. Per step it records the
  planning time and how long `next()` actually waited for it (`exposed_s`);
  `hidden_s = planning - exposed`;
* makes every rank run the same plan: only the source rank (rank 0 of `group`) samples and
  plans; in `next()` (main thread, same order on every rank) it broadcasts the plan (pickled, by
  the worker when it is a process), the batch and the sampler state with
  `torch.distributed.broadcast_object_list`. Without an initialised process group the iterator
  plans locally;
* serves each rank its metadata: `PlannedBatch.replica_plans(dp_rank)` / `.stage_order(dp, pp)`
  (the plan fixes every shape: cu_seqlens and units come from it, no shape exchange);
* checkpoints exactly: `state_dict()` holds the sampler state *after the last batch consumed*
  (batches planned ahead but not consumed are drawn again after `load_state_dict`), so a resumed
  run sees exactly the batches an uninterrupted run would have; with a planning function from
  `plan_function`, also its planner's state after that batch (WLB-LLM's delayed documents). A
  worker (thread or process) starts from that state: it restores the sampler and the planner
  itself, and from then on the stateful planner's state lives in the worker (the iterator's copy
  of the plan function is not advanced by a worker process; `state_dict()` is the truth).

`plan_function(planner, parallel, cost, config)` is the planning function a run gives it (a
picklable `StrategyPlanFunction`): each batch is planned with its samples' sources
(`GlobalBatch.sources`), which the plan records per sample (`Plan.sample_sources`);
`BatchTokenSource(corpus, plan)` reads tokens through exactly that mapping.
`fast_forward(sampler, planner, ...)` brings sampler and planner to their state after N batches
(a run resumed at step N), including a stateful strategy's delayed documents; an iterator built on
them afterwards hands that state to its worker.
"""
from __future__ import annotations

import numbers
import queue
import threading
import time
import warnings
from typing import Any, Callable, Optional

from ..errors import SlimPackError
from ..plan import Plan, Sample
from ..planner.strategies import check_plan_input, plan_on_view, planning_view
from ..workload import GlobalBatch, GlobalBatchSampler, TextCorpus
from .planned import (  # noqa: F401  (PlannedBatch, BatchTokenSource, PlannerError: this module's public names)
    DONE,
    BatchTokenSource,
    PlannedBatch,
    PlannerError,
    plan_one,
    planner_of,
    planner_state_of,
    restore_position,
)
from .planner_process import PlannerProcess, WorkerJob, WorkerStartError, dump_planned, load_planned

PlanFunction = Callable[[GlobalBatch], Plan]


class StrategyPlanFunction:
    """`plan_batch(batch) -> Plan`: the batch's lengths (checked against the context length)
    planned by `planner` with `sources=batch.sources` on the strategy's `planning_view` (a base
    merge shares its plans by DP-Merge groups), then validated. A class (not a closure) so
    that it pickles: the planner iterator's worker process rebuilds it from these four pieces.
    `planner`'s state is the state after the batches planned."""

    def __init__(self, planner, parallel, cost, config):
        self.planner, self.parallel, self.cost, self.config = planner, parallel, cost, config

    def __call__(self, batch: GlobalBatch) -> Plan:
        lengths = check_plan_input(batch.lengths, self.config.context_length)
        return plan_on_view(self.planner, lengths, self.parallel, self.cost, self.config,
                            sources=batch.sources).validate()

    def __repr__(self) -> str:
        return f"StrategyPlanFunction({type(self.planner).__name__}, {self.config.strategy!r})"


def plan_function(planner, parallel, cost, config) -> StrategyPlanFunction:
    """`plan_batch(batch) -> Plan` for a planner iterator: the batch's lengths (checked against the
    context length) planned by `planner` (a `planner.registry.StepPlanner`, e.g. from
    `new_planner(config.strategy)`) with `sources=batch.sources`, then validated. The function
    keeps the planner as `plan_batch.planner` (its state is the state after the batches planned)
    and pickles (planner, ParallelConfig, CostModel and SlimPackConfig do), so the planner
    iterator can plan in a worker process."""
    return StrategyPlanFunction(planner, parallel, cost, config)


def fast_forward(sampler: GlobalBatchSampler, planner, parallel, cost, config, steps: int) -> None:
    """Draw `steps` batches from `sampler` and bring `planner` to its state after planning them
    (`StepPlanner.advance`: nothing for stateless strategies; WLB-LLM's delay queues and carried
    documents as planning would leave them), without building plans. A run resumed at step N calls
    this with steps=N, then plans batch N as the uninterrupted run did."""
    if not _is_count(steps):
        raise ResumeStateError(f"fast_forward: steps must be the number of batches already trained (an integer "
                               f">= 0), got {steps!r}")
    for _ in range(int(steps)):
        batch = sampler.next_batch()
        planner.advance(check_plan_input(batch.lengths, config.context_length), planning_view(parallel, config)[0],
                        cost, config, sources=batch.sources)


BACKENDS = ("auto", "process", "thread")


class _ThreadPlanner:
    """The thread backend: plans ahead in a daemon thread of this process, on the iterator's own
    sampler and plan function (restored first to the state after the last consumed batch).
    `get()`/`close()` as `planner_process.PlannerProcess`."""

    name = "thread"
    pid = None

    def __init__(self, sampler, plan_fn, *, sampler_state, planner_state, drawn, steps, plan_ahead, serialize):
        self.sampler, self.plan_fn, self.steps, self.serialize = sampler, plan_fn, steps, serialize
        self.queue: queue.Queue = queue.Queue(maxsize=plan_ahead)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._work, args=(sampler_state, planner_state, drawn),
                                       name="slimpack-planner", daemon=True)
        self.thread.start()

    def _put(self, item) -> None:
        """Queue `item`, giving up when close() asks the worker to stop (never blocks forever)."""
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _work(self, sampler_state, planner_state, drawn: int) -> None:
        try:
            restore_position(self.sampler, self.plan_fn, sampler_state, planner_state)
            while (self.steps is None or drawn < self.steps) and not self.stop.is_set():
                item = plan_one(self.sampler, self.plan_fn)
                pickled = dump_planned(item) if self.serialize else None  # the broadcast's bytes, off next()
                drawn += 1
                self._put((item, pickled))
            self._put((DONE, None))
        except BaseException as error:  # surfaced by next()
            self._put((error, None))

    def get(self, timeout_s: Optional[float] = None):
        try:
            item, pickled = self.queue.get(timeout=timeout_s)
        except queue.Empty:
            raise PlannerError(f"planning failed: the planner thread sent no plan in {timeout_s:g} s (hung, or slower "
                               "than --slimpack-planner-timeout allows)") from None
        if isinstance(item, BaseException):
            raise PlannerError(f"planning failed: {item!r}") from item
        return item, pickled

    def close(self) -> None:
        self.stop.set()
        self.thread.join()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()


class PlannerIterator:
    """Iterator of `PlannedBatch`; see the module docstring.

    `plan_fn(batch) -> Plan` runs on the source rank only: in the worker (a process or a thread,
    `backend`) when `plan_ahead >= 1`, inline with `plan_ahead=0`. `backend`: "auto" (default: a
    worker process when `plan_fn` and the sampler pickle, else a thread), "process" (the same,
    warning when it falls back to a thread) or "thread". `steps`: stop after that many batches
    (None: endless). `group`: the process group over which plans are broadcast (default: the
    world when torch.distributed is initialised). The worker starts on the first `next()` (or
    `start()`); call `close()` (or use the iterator as a context manager) to stop it. `timeout_s`:
    the longest `next()` waits for the worker's next plan before it raises `PlannerError` (a
    worker killed is an error at once; one that hangs, after this).
    """

    def __init__(
        self,
        sampler: GlobalBatchSampler,
        plan_fn: PlanFunction,
        *,
        plan_ahead: int = 1,
        steps: Optional[int] = None,
        group=None,
        broadcast: Optional[bool] = None,
        backend: str = "auto",
        timeout_s: Optional[float] = None,
    ):
        import torch.distributed as dist

        if plan_ahead < 0:
            raise ValueError(f"plan_ahead must be >= 0, got {plan_ahead}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        self.sampler = sampler
        self.plan_fn = plan_fn
        self.plan_ahead = plan_ahead
        self.steps = steps
        self.group = group
        self.requested_backend = backend
        self.timeout_s = timeout_s  # longest wait for one plan from the worker (None: no limit)
        self.distributed = dist.is_initialized() if broadcast is None else broadcast
        if self.distributed:
            self.rank = dist.get_rank(group)
            self.source = dist.get_global_rank(group, 0) if group is not None else 0
        else:
            self.rank, self.source = 0, 0
        self.is_source = self.rank == 0
        self._consumed = 0
        self._state = sampler.state_dict()  # after the last consumed batch
        self._planner_state = planner_state_of(plan_fn)  # likewise
        self.history: list[PlannedBatch] = []
        self._worker: Any = None  # _ThreadPlanner or planner_process.PlannerProcess (get, close, name)
        self._worker_name: Optional[str] = None  # the last worker's backend, kept after close()
        self.fallback_reason: Optional[str] = None  # why no worker process is used (then threads only)

    # ---- worker ----------------------------------------------------------------------------
    def _remaining(self, drawn: int) -> bool:
        return self.steps is None or drawn < self.steps

    def _planner(self):
        return planner_of(self.plan_fn)

    def _planner_state_now(self) -> dict:
        return planner_state_of(self.plan_fn)

    @property
    def backend(self) -> Optional[str]:
        """Where this rank plans: "inline", "thread" or "process" (the worker running or last run;
        None: not the source rank, or no worker has started yet)."""
        if not self.is_source:
            return None
        if self.plan_ahead == 0:
            return "inline"
        return self._worker.name if self._worker is not None else self._worker_name

    @property
    def worker_pid(self) -> Optional[int]:
        """The worker process's pid (None without one)."""
        return getattr(self._worker, "pid", None)

    def _start_thread(self):
        return _ThreadPlanner(self.sampler, self.plan_fn, sampler_state=self._state,
                              planner_state=self._planner_state, drawn=self._consumed, steps=self.steps,
                              plan_ahead=self.plan_ahead, serialize=self.distributed)

    def _start_process(self):
        """A worker process, or None (with `fallback_reason`) when it cannot be started."""
        import os

        job = WorkerJob(self.sampler, self.plan_fn, self._state, self._planner_state, self._consumed, self.steps,
                        os.getpid())
        try:
            return PlannerProcess(job, self.plan_ahead)
        except Exception as error:  # the job does not pickle, or no process can be spawned here
            self.fallback_reason = f"{type(error).__name__}: {error}"
            if self.requested_backend == "process":
                warnings.warn(f"slimpack: cannot plan in a worker process ({self.fallback_reason}); planning in a "
                              "thread of the training process instead", RuntimeWarning, stacklevel=4)
            return None

    def start(self) -> None:
        """Start the worker now (it starts on the first `next()` otherwise); nothing on other ranks
        or with `plan_ahead=0`."""
        if self._worker is None and self.is_source and self.plan_ahead > 0 and self._remaining(self._consumed):
            if self.requested_backend != "thread" and self.fallback_reason is None:  # no failed try before
                self._worker = self._start_process()
            if self._worker is None:
                self._worker = self._start_thread()
            self._worker_name = self._worker.name

    def _next_planned(self):
        self.start()
        try:
            return self._worker.get(self.timeout_s)
        except WorkerStartError as error:
            self.fallback_reason = str(error)
            warnings.warn(f"slimpack: {error}; planning in a thread of the training process instead",
                          RuntimeWarning, stacklevel=3)
            self._worker.close()
            self._worker = self._start_thread()
            self._worker_name = self._worker.name
            return self._next_planned()
        except PlannerError:
            self.close()
            raise

    def close(self) -> None:
        """Stop the worker (a process is gone when this returns). Iterating again starts a new one
        from the state after the last consumed batch."""
        if self._worker is not None:
            worker, self._worker = self._worker, None
            worker.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- iteration -------------------------------------------------------------------------
    def __iter__(self):
        return self

    def __next__(self) -> PlannedBatch:
        began = time.perf_counter()
        item: Any = None  # a PlannedBatch, or the worker's DONE
        pickled = None
        if self.is_source:
            if not self._remaining(self._consumed):
                item = DONE
            elif self.plan_ahead == 0:
                item = plan_one(self.sampler, self.plan_fn)
            else:
                item, pickled = self._next_planned()
        waited = time.perf_counter() - began
        if self.distributed:
            item = self._broadcast(item, pickled)
        if item is DONE or item is None:
            self.close()
            raise StopIteration
        item.exposed_s = waited if self.is_source else 0.0
        item.broadcast_s = time.perf_counter() - began - waited
        self._consumed += 1
        self._state = item.sampler_state
        self._planner_state = item.planner_state
        self.history.append(item)
        return item

    def _broadcast(self, item, pickled: Optional[tuple[bytes, bytes]]):
        """The source rank's item on every rank. It travels as `planner_process.dump_planned`'s two
        pickles (made by the worker; unpickled with the cyclic collector paused: far cheaper than
        JSON for 10^5 samples)."""
        import torch.distributed as dist

        payload: list[Any]  # "done", the two pickles, or (on other ranks) None until received
        if self.is_source:
            payload = ["done" if item is DONE else (pickled if pickled is not None else dump_planned(item))]
        else:
            payload = [None]
        dist.broadcast_object_list(payload, src=self.source, group=self.group)
        data = payload[0]
        if data == "done":
            return DONE
        if self.is_source:
            return item
        return load_planned(*data)

    # ---- figures and checkpointing ------------------------------------------------------------
    def planning_summary(self) -> dict:
        planning = sum(item.planning_time_s for item in self.history)
        exposed = sum(min(item.exposed_s, item.planning_time_s) for item in self.history)
        return {"steps": len(self.history), "planning_s": planning, "exposed_s": exposed,
                "broadcast_s": sum(item.broadcast_s for item in self.history),
                "hidden_s": max(0.0, planning - exposed),
                "hidden_fraction": (planning - exposed) / planning if planning > 0 else 1.0}

    def state_dict(self) -> dict:
        return {"consumed": self._consumed, "sampler": dict(self._state), "planner": self._planner_state}

    def load_state_dict(self, state: dict) -> None:
        """Continue after the batches consumed when `state` was saved (call before iterating); the
        planner behind a `plan_function` gets its state after them too. A state that is not one
        `state_dict()` returned raises `ResumeStateError` naming what is wrong, and changes nothing."""
        check_resume_state(state, self.sampler)
        self.close()
        sampler_before = self.sampler.state_dict()
        self.sampler.load_state_dict(state["sampler"])  # refuses another corpus or settings, changing nothing
        planner = self._planner()
        if planner is not None and "planner" in state:
            strategy = getattr(getattr(self.plan_fn, "config", None), "strategy", None)
            try:
                _load_planner_state(planner, state["planner"], strategy or type(planner).__name__)
            except ResumeStateError:
                self.sampler.load_state_dict(sampler_before)
                raise
        self._consumed = int(state["consumed"])
        self._state = dict(state["sampler"])
        self._planner_state = self._planner_state_now() if planner is not None else {}


# ---- resume states ------------------------------------------------------------------------------
class ResumeStateError(SlimPackError):
    """A planner iterator's resume state that is not one its `state_dict()` returned (a corrupt or
    hand-edited checkpoint, or one of another run): says which entry is wrong."""


RESUME_FIX = "resume from the state_dict() the run saved, unchanged"
SAMPLER_STATE_KEYS = ("fingerprint", "step", "epoch", "cursor", "document", "offset", "split_documents",
                      "split_pieces", "dropped_documents", "dropped_tokens")


def _is_count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


def _entry_of(state, key: str, kind: type, where: str):
    """`state[key]`, which must be a `kind` (a dict: the state's section)."""
    if not isinstance(state, dict):
        raise ResumeStateError(f"{where} is a {type(state).__name__}, not a dict; {RESUME_FIX}")
    if key not in state:
        raise ResumeStateError(f"{where} has no {key!r} entry (it has {sorted(state)}); {RESUME_FIX}")
    value = state[key]
    if not isinstance(value, kind):
        raise ResumeStateError(f"{where} entry {key!r} is {value!r}, not a {kind.__name__}; {RESUME_FIX}")
    return value


def check_resume_state(state, sampler) -> None:
    """Refuse a `PlannerIterator.state_dict()` that is not one: wrong shape, a negative or
    non-integer count, a sampler position outside its documents (`ResumeStateError`)."""
    _entry_of(state, "sampler", dict, "the resume state")
    consumed = _entry_of(state, "consumed", object, "the resume state")
    if not _is_count(consumed):
        raise ResumeStateError(f"the resume state's 'consumed' is {consumed!r}, not a count of batches (an "
                               f"integer >= 0); {RESUME_FIX}")
    if isinstance(sampler, GlobalBatchSampler):
        check_sampler_state(state["sampler"], len(sampler.lengths), sampler.lengths)


def check_sampler_state(state: dict, documents: int, lengths) -> None:
    """A `GlobalBatchSampler.state_dict()` over `documents` documents of `lengths`: every entry
    present, counts integers >= 0, the cursor and the open document inside the corpus."""
    where = "the resume state's 'sampler'"
    missing = [key for key in SAMPLER_STATE_KEYS if key not in state]
    if missing:
        raise ResumeStateError(f"{where} lacks {', '.join(missing)}; {RESUME_FIX}")
    for key in SAMPLER_STATE_KEYS[1:]:
        value = state[key]
        if not _is_count(value) and not (key == "document" and value is None):
            raise ResumeStateError(f"{where} entry {key!r} is {value!r}, not an integer >= 0; {RESUME_FIX}")
    if state["cursor"] > documents:
        raise ResumeStateError(f"{where} entry 'cursor' is {state['cursor']}, beyond the corpus's {documents} "
                               f"documents; {RESUME_FIX} (and the same corpus)")
    document = state["document"]
    if document is not None and (document >= documents or state["offset"] >= lengths[document]):
        raise ResumeStateError(f"{where} is inside document {document} at token {state['offset']}, which the "
                               f"corpus of {documents} documents does not have; {RESUME_FIX} (and the same corpus)")


def _load_planner_state(planner, state, name: str) -> None:
    """`planner.load_state_dict(state)`, all or nothing: a state the planner (of strategy `name`)
    cannot take leaves it as it was and raises `ResumeStateError` (not a KeyError from deep inside)."""
    if not isinstance(state, dict):
        raise ResumeStateError(f"the resume state's 'planner' is a {type(state).__name__}, not the dict a {name} "
                               f"planner's state_dict() returns; {RESUME_FIX}")
    before = planner.state_dict()
    try:
        planner.load_state_dict(state)
    except (KeyError, TypeError, ValueError, IndexError) as error:
        planner.load_state_dict(before)
        detail = f"no {error.args[0]!r} entry" if isinstance(error, KeyError) and error.args else str(error)
        raise ResumeStateError(f"the resume state's 'planner' is not a {name} planner state: {detail}; "
                               f"{RESUME_FIX}") from None

def samples_of(batch: GlobalBatch) -> list[Sample]:
    return batch.samples()


__all__ = ["PlannedBatch", "BatchTokenSource", "PlannerIterator", "PlannerError", "TextCorpus", "plan_function",
           "StrategyPlanFunction", "fast_forward", "BACKENDS", "ResumeStateError", "check_resume_state"]
