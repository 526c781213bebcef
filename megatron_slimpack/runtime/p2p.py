"""Pipeline point-to-point as a program of grouped calls, and its deadlock check (design.md 3).

On NCCL a send may not complete until the peer posts the matching receive, and one
communicator's operations run in the order each rank posts them. A pipeline whose neighbours
post their transfers in different orders then deadlocks: in 1F1B's steady state stage s sends an
activation down while stage s + 1 sends a gradient up, and SlimPack's memory-driven orders
(chains of slices, asymmetric units) interleave the two directions in many more ways. Megatron's
`p2p_communication.py` pairs its transfers by construction; our orders are arbitrary, so the
program is derived from them:

1. `transfer_times`: replay every stage's task list with receives blocking (a task that needs a
   tensor runs after the task that produces it) on one logical clock; a transfer's time is the
   clock when its consumer runs. Every stage then posts its transfers in that one global order.
2. `stage_program`: before each task a stage posts, in that order and as one call
   (`batch_isend_irecv`), the transfers up to and including the one the task receives, then on
   while the next ones are sends already produced (so activations go out as early as the order
   allows). The sends among the first were produced by earlier tasks: a send ordered before a
   receive is never produced after that receive's consumer (it would have a later time). What is
   left goes out after the last task. A receive is waited on just before its consumer runs.

All ranks post one global order, so the earliest unfinished transfer always has both ends posted:
no deadlock, even when every send blocks. `check_deadlock_free` replays the programs under that
strict model and raises `P2PDeadlock` naming where stages wait (a plan whose orders cannot run at
all fails already in step 1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

Task = tuple  # ("F", unit) or ("B", unit)


class P2PDeadlock(RuntimeError):
    """Stages whose point-to-point programs wait on each other forever."""


@dataclass(frozen=True)
class Transfer:
    """One tensor between neighbouring stages: a forward unit's activation ("F", downstream) or a
    backward unit's input gradient ("B", upstream)."""

    kind: str
    unit: int
    source: int
    destination: int


@dataclass(frozen=True)
class P2PCall:
    """Transfers posted together before task `before` of the stage's task list (the list's
    length: after its last task)."""

    before: int
    sends: tuple[Transfer, ...]
    receives: tuple[Transfer, ...]


def incoming(task: Task, stage: int, num_stages: int) -> Optional[Transfer]:
    kind, unit = task
    if kind == "F":
        return Transfer("F", unit, stage - 1, stage) if stage > 0 else None
    return Transfer("B", unit, stage + 1, stage) if stage < num_stages - 1 else None


def outgoing(task: Task, stage: int, num_stages: int) -> Optional[Transfer]:
    kind, unit = task
    if kind == "F":
        return Transfer("F", unit, stage, stage + 1) if stage < num_stages - 1 else None
    return Transfer("B", unit, stage, stage - 1) if stage > 0 else None


def transfer_times(stage_tasks: Sequence[Sequence[Task]]) -> dict[Transfer, int]:
    """Each transfer's logical time: the clock when its consumer runs in a replay of all stages
    with receives blocking (see the module docstring)."""
    num_stages = len(stage_tasks)
    produced: set[Transfer] = set()
    position, clock, times = [0] * num_stages, 0, {}
    progress = True
    while progress:
        progress = False
        for stage in range(num_stages):
            while position[stage] < len(stage_tasks[stage]):
                task = stage_tasks[stage][position[stage]]
                needed = incoming(task, stage, num_stages)
                if needed is not None and needed not in produced:
                    break
                if needed is not None:
                    times[needed] = clock
                sent = outgoing(task, stage, num_stages)
                if sent is not None:
                    produced.add(sent)
                clock += 1
                position[stage] += 1
                progress = True
    stuck = [stage for stage in range(num_stages) if position[stage] < len(stage_tasks[stage])]
    if stuck:
        waits = ", ".join(f"stage {s} waits at {stage_tasks[s][position[s]][0]}{stage_tasks[s][position[s]][1]}"
                          for s in stuck)
        raise P2PDeadlock(f"the plan's stage orders deadlock: {waits}")
    return times


def stage_program(stage_tasks: Sequence[Sequence[Task]], stage: int,
                  times: Optional[dict[Transfer, int]] = None) -> list[P2PCall]:
    """The calls `stage` posts for its task list (`stage_tasks`: every stage's, so that all
    stages derive one global order)."""
    num_stages = len(stage_tasks)
    times = transfer_times(stage_tasks) if times is None else times
    tasks = stage_tasks[stage]
    mine = sorted((t for t in (*(incoming(task, stage, num_stages) for task in tasks),
                               *(outgoing(task, stage, num_stages) for task in tasks)) if t is not None),
                  key=lambda t: times[t])
    calls, posted, produced = [], 0, set()
    for position, task in enumerate(tasks):
        needed = incoming(task, stage, num_stages)
        # Through the receive this task needs (unless an earlier call posted it), then on while
        # the next transfers are sends already produced: they go out as early as the order allows.
        through = posted if needed is None or times[needed] < times[mine[posted]] else mine.index(needed, posted) + 1
        end = through
        while end < len(mine) and mine[end] in produced:
            end += 1
        if end > posted:
            calls.append(_call(position, mine[posted:end], stage))
            posted = end
        produced.add(outgoing(task, stage, num_stages))
    if posted < len(mine):
        calls.append(_call(len(tasks), mine[posted:], stage))
    return calls


def _call(before: int, transfers: Sequence[Transfer], stage: int) -> P2PCall:
    return P2PCall(before, tuple(t for t in transfers if t.source == stage),
                   tuple(t for t in transfers if t.destination == stage))


def check_deadlock_free(stage_tasks: Sequence[Sequence[Task]]) -> None:
    """Raise P2PDeadlock if the stages' task lists, run with the programs `stage_program` writes,
    would wait on each other forever with every send blocking (see `find_deadlock`)."""
    times = transfer_times(stage_tasks)
    waits = find_deadlock([stage_program(stage_tasks, stage, times) for stage in range(len(stage_tasks))])
    if waits:
        raise P2PDeadlock(f"the stage orders' point-to-point transfers deadlock: {waits}")


def find_deadlock(programs: Sequence[Sequence[P2PCall]]) -> str:
    """Replay the stages' programs with blocking calls (a call completes once the peers have posted
    every one of its transfers); '' if all finish, else where each stuck stage waits."""
    position = [0] * len(programs)
    posted_sends: set[Transfer] = set()
    posted_receives: set[Transfer] = set()

    def post(stage: int) -> None:
        if position[stage] < len(programs[stage]):
            call = programs[stage][position[stage]]
            posted_sends.update(call.sends)
            posted_receives.update(call.receives)

    for stage in range(len(programs)):
        post(stage)
    progress = True
    while progress:
        progress = False
        for stage, program in enumerate(programs):
            while position[stage] < len(program):
                call = program[position[stage]]
                if not (all(t in posted_receives for t in call.sends)
                        and all(t in posted_sends for t in call.receives)):
                    break
                position[stage] += 1
                post(stage)
                progress = True
    stuck = [stage for stage, program in enumerate(programs) if position[stage] < len(program)]
    return "; ".join(f"stage {s} waits in {_describe(programs[s][position[s]])}" for s in stuck)


def _describe(call: P2PCall) -> str:
    parts = [f"send {t.kind}{t.unit} to stage {t.destination}" for t in call.sends]
    parts += [f"receive {t.kind}{t.unit} from stage {t.source}" for t in call.receives]
    return " + ".join(parts)
