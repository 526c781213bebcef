"""The planner iterator's worker process: planning off the training process's GIL.

Most of the planner is pure Python (1-7 s per global batch at paper scale). Run in a thread of the
training process, it holds the GIL against the thread that launches the kernels, and the objects
it allocates make the cyclic garbage collector of the training process pause that thread too.
`PlannerProcess` runs the same loop as the thread backend of `data.PlannerIterator` in a spawned
daemon process instead:

* the worker is started with picklable pieces: the sampler, the plan function (`data.plan_function`
  returns a picklable `StrategyPlanFunction`: strategy planner, ParallelConfig, CostModel,
  SlimPackConfig) and the iterator's checkpoint (sampler and planner state after the last batch
  consumed), which the worker restores itself: the sampler and a stateful strategy's state
  (WLB-LLM's delay queues) live in the worker from then on;
* it draws and plans batches in order and sends each, with the sampler and planner state after it,
  through a queue of `plan_ahead` slots (at most `plan_ahead` planned batches wait, and one more
  is being planned, as with the thread). The plan travels pickled: the training process unpickles
  it with the cyclic collector paused (a few hundred thousand small tuples), and broadcasts the
  same bytes to the other ranks;
* the worker plans with the cyclic garbage collector paused (it only pauses the worker);
* a planning error comes back with the worker's traceback; `close()` stops the worker (a short
  grace period, then SIGTERM, then SIGKILL); the worker also stops when the training process is
  gone (checked between batches and while it waits for a slot). A worker that dies in the middle of
  a message is an end of file, not a read that never returns;
* where a worker process cannot be had, the iterator plans in a thread: the job does not pickle
  or no process can be spawned (a daemonic parent), both at construction, or the worker dies
  before it starts (`WorkerStartError`: the spawned interpreter cannot import the program...).

A spawned interpreter imports the training program's main module again (as `__mp_main__`, like
any `multiprocessing` "spawn" child; code under `if __name__ == "__main__":` does not run), so the
worker costs one more Python process with those imports on the source rank of each planning group.
It is spawned with `CUDA_VISIBLE_DEVICES=""`: the planner needs no GPU, and an import that
initialises CUDA (pretrain_gpt.py's imports, re-run) must not open a context on the rank's device.
"""
from __future__ import annotations

import os
import pickle
import queue
import signal
import threading
import time
import traceback
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Optional, cast

from ..planner.strategies import cyclic_gc_paused
from .planned import DONE, PlannedBatch, PlannerError, plan_one, restore_position

PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
_POLL_S = 0.1
# The worker's environment differs from the training process's in these variables only.
WORKER_ENVIRONMENT = {"CUDA_VISIBLE_DEVICES": ""}
_environment_lock = threading.Lock()


class WorkerStartError(RuntimeError):
    """The worker process could not be started or died before it ran (the iterator falls back to
    planning in a thread)."""


@contextmanager
def _environment(changes: dict):
    """`os.environ` with `changes` while a child is spawned (it inherits the environment then)."""
    with _environment_lock:
        saved = {name: os.environ.get(name) for name in changes}
        os.environ.update(changes)
        try:
            yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def dump_planned(planned) -> tuple[bytes, bytes]:
    """A `PlannedBatch` as two pickles: (step, batch, figures and states) and the plan. The worker
    sends them; the source rank broadcasts the same bytes to the other ranks."""
    meta = {"step": planned.step, "batch": planned.batch, "planning_time_s": planned.planning_time_s,
            "sampler_state": planned.sampler_state, "planner_state": planned.planner_state}
    return pickle.dumps(meta, protocol=PICKLE_PROTOCOL), pickle.dumps(planned.plan, protocol=PICKLE_PROTOCOL)


def load_planned(meta: bytes, plan: bytes):
    """The `PlannedBatch` of `dump_planned`'s bytes (unpickled with the cyclic collector paused)."""

    with cyclic_gc_paused():
        data, loaded = pickle.loads(meta), pickle.loads(plan)
    return PlannedBatch(data["step"], data["batch"], loaded, data["planning_time_s"],
                        sampler_state=data["sampler_state"], planner_state=data["planner_state"])


@dataclass
class WorkerJob:
    """Everything the worker needs, pickled once when it starts."""

    sampler: Any
    plan_fn: Any
    sampler_state: dict
    planner_state: Optional[dict]
    drawn: int  # batches consumed so far (the `steps` limit counts from 0)
    steps: Optional[int]
    parent_pid: int


# ---- the worker (child process) ---------------------------------------------------------------
def _gone(stop, parent_pid: int) -> bool:
    return stop.is_set() or os.getppid() != parent_pid


def _send(results, message, stop, parent_pid: int) -> bool:
    """Queue `message`; False when asked to stop (or orphaned) before it found a slot."""
    while not _gone(stop, parent_pid):
        try:
            results.put(message, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _pickled_error(error: BaseException) -> Optional[bytes]:
    try:
        blob = pickle.dumps(error, protocol=PICKLE_PROTOCOL)
        pickle.loads(blob)
        return blob
    except Exception:
        return None


def worker_main(job: WorkerJob, results, stop, started) -> None:
    """The worker process: restore the checkpoint, then draw, plan and send batches in order."""
    started.set()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle

    try:
        restore_position(job.sampler, job.plan_fn, job.sampler_state, job.planner_state)
        drawn = job.drawn
        while (job.steps is None or drawn < job.steps) and not _gone(stop, job.parent_pid):
            with cyclic_gc_paused():
                message = ("item", *dump_planned(plan_one(job.sampler, job.plan_fn)))
            drawn += 1
            if not _send(results, message, stop, job.parent_pid):
                return
        _send(results, ("done",), stop, job.parent_pid)
    except BaseException as error:  # surfaced by the iterator's next() as PlannerError
        _send(results, ("error", repr(error), traceback.format_exc(), _pickled_error(error)), stop, job.parent_pid)
    finally:
        if _gone(stop, job.parent_pid):
            results.cancel_join_thread()  # exit now, without flushing what nobody will read


# ---- the training-process side ------------------------------------------------------------------
def _terminate(process) -> None:
    """Stop `process` at once (finalizer: the iterator was dropped or the interpreter exits)."""
    try:
        if process.is_alive():
            process.terminate()
            process.join(2.0)
        if process.is_alive():
            process.kill()
            process.join(2.0)
    except (AssertionError, ValueError, OSError):  # already closed, or not our child any more
        pass


class PlannerProcess:
    """A spawned daemon process planning ahead for a `PlannerIterator` (see the module docstring).

    `get()` returns `(PlannedBatch, dump_planned bytes)` in order, `(planned.DONE, None)` after the last
    batch, raises `data.PlannerError` for a planning error (or a worker that died) and
    `WorkerStartError` when the worker died before it started. Raises at construction when the
    job cannot be pickled or the process cannot be spawned."""

    name = "process"

    def __init__(self, job: WorkerJob, plan_ahead: int, *, grace_s: float = 0.5):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.grace_s = grace_s
        self.results = context.Queue(maxsize=max(1, int(plan_ahead)))
        self.stop = context.Event()
        self.started = context.Event()
        self.process: Optional[BaseProcess] = context.Process(  # None once closed
            target=worker_main, args=(job, self.results, self.stop, self.started), name="slimpack-planner", daemon=True)
        with _environment(WORKER_ENVIRONMENT):
            self.process.start()  # pickles the job: raises here if a piece does not pickle
        self.pid = self.process.pid
        # Only the worker writes to the queue: without this process's copy of the write end, a worker
        # that dies in the middle of a message is an end of file for get(), not a read that never ends.
        writer = getattr(self.results, "_writer", None)
        if writer is not None:
            writer.close()
        self._finalizer = weakref.finalize(self, _terminate, self.process)

    @property
    def _worker(self) -> BaseProcess:
        """`process`, for the methods that run only before `close`."""
        return cast(BaseProcess, self.process)

    def get(self, timeout_s: Optional[float] = None):
        """The worker's next message; PlannerError when it died without one, or sent none within
        `timeout_s` (then it is terminated: a hung worker)."""
        began = time.monotonic()
        while True:
            try:
                message = self.results.get(timeout=_POLL_S)
                break
            except queue.Empty:
                if self._worker.is_alive():
                    if timeout_s is not None and time.monotonic() - began > timeout_s:
                        raise self._hung(timeout_s) from None
                    continue
            except (EOFError, OSError):  # it died, maybe in the middle of a message
                raise self._died() from None
            try:  # it may have sent its last message just before it exited
                message = self.results.get(timeout=_POLL_S)
                break
            except (queue.Empty, EOFError, OSError):
                raise self._died() from None
        kind = message[0]
        if kind == "item":
            _, meta, plan = message
            return load_planned(meta, plan), (meta, plan)
        if kind == "done":
            return DONE, None
        _, text, trace, pickled = message
        cause = None
        if pickled is not None:
            try:
                cause = pickle.loads(pickled)
            except Exception:
                cause = None
        raise PlannerError(f"planning failed: {text}\n\nTraceback in the planner worker process (pid {self.pid}):\n"
                           f"{trace.rstrip()}") from cause

    def _died(self) -> Exception:
        """The error for a worker that exited without its next message."""

        self._worker.join(1.0)
        code = self._worker.exitcode
        if not self.started.is_set():
            return WorkerStartError(f"the planner worker process (pid {self.pid}) exited with code {code} before it "
                                    "started (see its traceback above)")
        return PlannerError(f"planning failed: the planner worker process (pid {self.pid}) exited with code {code} "
                            "without a result (killed, or out of memory?)")

    def _hung(self, timeout_s: float) -> Exception:
        pid = self.pid
        _terminate(self.process)
        return PlannerError(f"planning failed: the planner worker process (pid {pid}) sent no plan in {timeout_s:g} s "
                            "(hung, or slower than --slimpack-planner-timeout allows); it was stopped")

    def close(self) -> None:
        """Stop the worker: it exits by itself if it is waiting for a free slot; one still planning
        after `grace_s` is terminated (then killed). Returns once it is gone."""
        if self.process is None:
            return
        self.stop.set()
        began = time.monotonic()
        while self.process.is_alive() and time.monotonic() - began < self.grace_s:
            self.process.join(0.05)
        _terminate(self.process)
        self._finalizer.detach()
        self.results.close()
        self.results.join_thread()
        try:
            self.process.close()
        except ValueError:
            pass
        self.process = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.is_alive()


__all__ = ["PlannerProcess", "WorkerJob", "WorkerStartError", "dump_planned", "load_planned"]
