"""The planner iterator's worker process (megatron/planner_process.py): the same
plans as inline planning, exact resume (a stateful strategy's state included), planning errors with
the worker's traceback, close() leaving no process behind, the thread fallback, and identical plans
on two gloo ranks."""
from __future__ import annotations

import json
import os
import pickle
import re
import time
import warnings
from pathlib import Path

import pytest

from megatron_slimpack import CostModel, ParallelConfig, SlimPackConfig
from megatron_slimpack.megatron.data import PlannerError, PlannerIterator, plan_function
from megatron_slimpack.planner.strategies import new_planner
from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

COST = CostModel.analytic("tiny", "cpu")
PARALLEL = ParallelConfig(dp=2, pp=2)
# Plans are compared across processes: a deterministic budget, not the wall clock, stops CP-SAT.
CONFIG = SlimPackConfig(context_length=512, solver_time_limit_s=60, solver_deterministic_limit=0.05)


def _sampler() -> GlobalBatchSampler:
    return GlobalBatchSampler(load_lengths("longtail:n=2000", seed=3), 512, 8, seed=3, long_documents="split")


def _plan_fn(strategy: str = "slimpack"):
    return plan_function(new_planner(strategy), PARALLEL, COST, CONFIG.with_(strategy=strategy))


def _content(planned) -> tuple:
    """What must not differ between runs: the batch and the plan (metadata holds wall times)."""
    plan = planned.plan
    return planned.step, planned.batch.lengths, plan.to_dict(include_metadata=False), sorted(plan.metadata)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


class Exploding:
    """A picklable plan function that fails on batch `at`."""

    def __init__(self, at: int):
        self.inner, self.at = _plan_fn(), at

    def __call__(self, batch):
        if batch.step == self.at:
            raise ValueError(f"solver exploded on batch {batch.step}")
        return self.inner(batch)


class WhereAmI:
    """A picklable plan function that records where it ran in the plan's metadata."""

    def __init__(self):
        self.inner = _plan_fn()

    def __call__(self, batch):
        plan = self.inner(batch)
        plan.metadata["planned_in"] = {"pid": os.getpid(), "cuda": os.environ.get("CUDA_VISIBLE_DEVICES")}
        return plan


class Sleepy:
    """A picklable plan function that takes far longer than any test waits."""

    def __call__(self, batch):
        time.sleep(120)


class Ballast:
    """A picklable plan function whose plans carry 64 MB: the worker is still sending the first when
    it is killed."""

    def __init__(self):
        self.inner = _plan_fn()

    def __call__(self, batch):
        plan = self.inner(batch)
        plan.metadata["ballast"] = bytes(64 << 20)
        return plan


def _refuse_to_unpickle():
    raise RuntimeError("this plan function cannot be rebuilt in another process")


class ParentOnly:
    """Pickles, but cannot be unpickled: the worker process dies before it starts."""

    def __init__(self):
        self.inner = _plan_fn()

    def __call__(self, batch):
        return self.inner(batch)

    def __reduce__(self):
        return (_refuse_to_unpickle, ())


def test_the_plan_function_pickles_with_its_planner_state():
    plan_batch = _plan_fn("wlb-llm")
    sampler = _sampler()
    plan_batch(sampler.next_batch())
    copy = pickle.loads(pickle.dumps(plan_batch))
    assert copy.planner.state_dict() == plan_batch.planner.state_dict() and copy.planner.state_dict()["step"] == 1
    batch = sampler.next_batch()
    assert copy(batch).fingerprint() == plan_batch(batch).fingerprint()


def test_process_backend_plans_as_inline_planning():
    with PlannerIterator(_sampler(), _plan_fn(), plan_ahead=0, steps=4) as inline:
        reference = [_content(p) for p in inline]
    with PlannerIterator(_sampler(), _plan_fn(), plan_ahead=2, steps=4, backend="process") as iterator:
        seen = []
        for planned in iterator:
            assert iterator.backend == "process" and iterator.worker_pid != os.getpid()
            seen.append(_content(planned))
        assert planned.planning_time_s > 0 and planned.exposed_s >= 0
        assert planned.hidden_s == pytest.approx(max(0.0, planned.planning_time_s - planned.exposed_s))
        summary = iterator.planning_summary()
    assert seen == reference and [step for step, *_ in seen] == [0, 1, 2, 3]
    assert summary["steps"] == 4 and summary["planning_s"] > 0
    assert iterator.backend == "process" and iterator.worker_pid is None  # closed at the end


def test_planning_runs_in_the_worker_process_without_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with PlannerIterator(_sampler(), WhereAmI(), plan_ahead=1, steps=2) as iterator:
        where = [p.plan.metadata["planned_in"] for p in iterator]
        assert iterator.backend == "process"
    assert {w["pid"] for w in where} != {os.getpid()} and len({w["pid"] for w in where}) == 1
    assert [w["cuda"] for w in where] == ["", ""]  # the worker sees no GPU ...
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3"  # ... and this process's environment is unchanged


@pytest.mark.parametrize("strategy", ["slimpack", "wlb-llm"])
def test_process_backend_resumes_exactly(strategy):
    """Resuming from a checkpoint taken while the worker had planned ahead gives the next plans of
    an uninterrupted run: the worker restores the sampler and the planner's state (wlb-llm's delay
    queues) itself. Inline planning is the reference."""
    with PlannerIterator(_sampler(), _plan_fn(strategy), plan_ahead=0, steps=6) as inline:
        reference = [_content(p) for p in inline]
    first = PlannerIterator(_sampler(), _plan_fn(strategy), plan_ahead=2, steps=6, backend="process")
    seen = [_content(p) for _, p in zip(range(3), first)]
    state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
    first.close()
    if strategy == "wlb-llm":
        assert state["planner"]["step"] == 3 and state["planner"]["strategy"] == "wlb-llm"
    resumed = PlannerIterator(_sampler(), _plan_fn(strategy), plan_ahead=2, steps=6, backend="process")
    resumed.load_state_dict(state)
    seen += [_content(p) for p in resumed]
    assert resumed.backend == "process"
    assert seen == reference


def test_restarting_after_close_continues_after_the_last_consumed_batch():
    with PlannerIterator(_sampler(), _plan_fn("wlb-llm"), plan_ahead=0, steps=5) as inline:
        reference = [_content(p) for p in inline]
    for backend in ("process", "thread"):
        iterator = PlannerIterator(_sampler(), _plan_fn("wlb-llm"), plan_ahead=2, steps=5, backend=backend)
        seen = [_content(next(iterator)) for _ in range(2)]
        iterator.close()  # the worker had drawn and planned batches 2 and 3 already
        seen += [_content(p) for p in iterator]
        assert seen == reference, backend


def test_a_planning_error_surfaces_with_the_worker_traceback():
    iterator = PlannerIterator(_sampler(), Exploding(at=1), plan_ahead=1, steps=4, backend="process")
    assert next(iterator).step == 0
    pid = iterator.worker_pid
    with pytest.raises(PlannerError, match=r"planning failed: ValueError\('solver exploded on batch 1'\)") as caught:
        next(iterator)
    message = str(caught.value)
    assert f"Traceback in the planner worker process (pid {pid})" in message
    assert "in __call__" in message and "test_planner_process.py" in message  # where it was raised
    assert isinstance(caught.value.__cause__, ValueError)
    assert iterator.worker_pid is None and _gone(pid)  # the failed worker is cleaned up


@pytest.mark.parametrize("plan_fn", [Sleepy, Ballast])
def test_a_worker_killed_from_outside_is_an_error_not_a_hang(plan_fn):
    """Killed while planning (nothing sent), or in the middle of sending a plan (half a message in
    the pipe): next() raises instead of waiting forever."""
    import signal
    import threading

    iterator = PlannerIterator(_sampler(), plan_fn(), plan_ahead=1, steps=4, backend="process")
    iterator.start()
    pid = iterator.worker_pid
    assert iterator._worker.started.wait(60)
    time.sleep(3)  # Ballast: it has planned and is blocked writing 64 MB into the pipe
    os.kill(pid, signal.SIGKILL)
    outcome = []

    def take():
        try:
            next(iterator)
        except BaseException as error:
            outcome.append(error)

    reader = threading.Thread(target=take, daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "next() hung on a dead worker"
    assert len(outcome) == 1 and isinstance(outcome[0], PlannerError), outcome
    assert re.search(rf"worker process \(pid {pid}\) exited with code -9 without a result", str(outcome[0]))
    assert _gone(pid)


def test_close_stops_the_worker_promptly():
    """While it waits for a free slot, and while it is in the middle of planning a batch."""
    iterator = PlannerIterator(_sampler(), _plan_fn(), plan_ahead=1, steps=None, backend="process")
    next(iterator)
    pid = iterator.worker_pid
    time.sleep(0.5)  # it plans the next batches until its slot is full
    began = time.monotonic()
    iterator.close()
    assert time.monotonic() - began < 5 and _gone(pid)

    busy = PlannerIterator(_sampler(), Sleepy(), plan_ahead=1, steps=4, backend="process")
    busy.start()
    pid = busy.worker_pid
    time.sleep(0.5)
    began = time.monotonic()
    busy.close()
    assert time.monotonic() - began < 5 and _gone(pid)
    assert busy.worker_pid is None


def test_thread_fallback_and_inline():
    # A closure does not pickle: "auto" plans in a thread without a word, "process" warns.
    plan_batch = _plan_fn()
    closure = lambda batch: plan_batch(batch)  # noqa: E731
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with PlannerIterator(_sampler(), closure, plan_ahead=1, steps=2) as auto:
            assert [p.step for p in auto] == [0, 1] and auto.backend == "thread"
    with pytest.warns(RuntimeWarning, match="cannot plan in a worker process"):
        with PlannerIterator(_sampler(), closure, plan_ahead=1, steps=2, backend="process") as asked:
            assert [p.step for p in asked] == [0, 1] and asked.backend == "thread"
    assert asked.fallback_reason
    # Pickles here but not in the worker: it dies before it starts, the thread takes over.
    with pytest.warns(RuntimeWarning, match="before it started.*planning in a thread"):
        with PlannerIterator(_sampler(), ParentOnly(), plan_ahead=1, steps=2) as dead:
            assert [p.step for p in dead] == [0, 1] and dead.backend == "thread"
    with PlannerIterator(_sampler(), _plan_fn(), plan_ahead=0, steps=2, backend="process") as inline:
        assert [p.step for p in inline] == [0, 1] and inline.backend == "inline" and inline.worker_pid is None
    with pytest.raises(ValueError, match="backend must be one of"):
        PlannerIterator(_sampler(), _plan_fn(), backend="fork")


def _two_ranks_worker(rank, world_size, port, out):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    # Only rank 0 plans (in its worker process); rank 1's plan function must never be called.
    plan_fn = _plan_fn("wlb-llm") if rank == 0 else Exploding(at=0)
    iterator = PlannerIterator(_sampler(), plan_fn, plan_ahead=2, steps=4)
    prints, pids = [], set()
    for index, planned in enumerate(iterator):
        prints.append(planned.plan.fingerprint())
        pids.add(iterator.worker_pid)
        if index == 1:
            state = iterator.state_dict()
    record = {"prints": prints, "state": state, "backend": iterator.backend, "pids": sorted(map(str, pids))}
    gathered = [None] * world_size
    dist.all_gather_object(gathered, record)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_get_the_plans_of_the_worker_process(tmp_path):
    from conftest import run_multiprocess

    out = tmp_path / "ranks.json"
    run_multiprocess(_two_ranks_worker, 2, str(out), timeout_s=180)
    zero, one = json.loads(out.read_text())
    assert zero["backend"] == "process" and one["backend"] is None and one["pids"] == ["None"]
    assert zero["prints"] == one["prints"] and zero["state"] == one["state"]
    with PlannerIterator(_sampler(), _plan_fn("wlb-llm"), plan_ahead=0, steps=4) as local:
        assert [p.plan.fingerprint() for p in local] == zero["prints"]
