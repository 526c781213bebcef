"""Pipeline point-to-point as a program of grouped calls, and its deadlock check (docs/design.md section 3).

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

Virtual pipeline stages (`vpp` model chunks per rank, tasks `(kind, unit, chunk)`): chunk c of
stage s is virtual stage v = c * pp + s, and transfers run between neighbouring *virtual* stages
(the last stage's chunk c feeds stage 0's chunk c + 1; gradients go the other way). A transfer
names its virtual stages, so each one is unique even though two ranks exchange both kinds in
both directions (with pp = 2, rank 0 sends rank 1 activations of chunk c and gradients of chunk
c + 1). Nothing else changes: the program is still one global order, so the transfers between
two ranks are posted in the same order at both ends and match without tags (gloo matches per
peer in posting order; NCCL needs that anyway). Without virtual stages a virtual stage is the
pipeline stage, and every transfer, program and message is what it was before virtual stages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ...plan import task_chunk

Task = tuple  # ("F", unit) or ("B", unit); with virtual stages ("F", unit, chunk) / ("B", unit, chunk)


class P2PDeadlock(RuntimeError):
    """Stages whose point-to-point programs wait on each other forever."""


@dataclass(frozen=True)
class Transfer:
    """One tensor between neighbouring (virtual) stages: a forward unit's activation ("F",
    downstream) or a backward unit's input gradient ("B", upstream). `source` and `destination`
    are virtual stages (chunk * pp + stage; the pipeline stages without virtual stages)."""

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


def virtual_stage(task: Task, stage: int, num_stages: int) -> int:
    """The virtual stage a task of `stage` runs on: its chunk * num_stages + stage."""
    return task_chunk(task) * num_stages + stage


def incoming(task: Task, stage: int, num_stages: int, vpp: int = 1) -> Optional[Transfer]:
    """The tensor `task` (run by pipeline stage `stage` of `num_stages`) waits for, if any."""
    kind, unit = task[0], task[1]
    here = virtual_stage(task, stage, num_stages)
    if kind == "F":
        return Transfer("F", unit, here - 1, here) if here > 0 else None
    return Transfer("B", unit, here + 1, here) if here < num_stages * vpp - 1 else None


def outgoing(task: Task, stage: int, num_stages: int, vpp: int = 1) -> Optional[Transfer]:
    """The tensor `task` produces for a neighbouring virtual stage, if any."""
    kind, unit = task[0], task[1]
    here = virtual_stage(task, stage, num_stages)
    if kind == "F":
        return Transfer("F", unit, here, here + 1) if here < num_stages * vpp - 1 else None
    return Transfer("B", unit, here, here - 1) if here > 0 else None


def stage_name(virtual: int, num_stages: int, vpp: int = 1) -> str:
    """How messages name a virtual stage: "stage s", or "stage s chunk c" with virtual stages."""
    chunk, stage = divmod(virtual, num_stages)
    return f"stage {stage} chunk {chunk}" if vpp > 1 else f"stage {stage}"


def _task_name(task: Task) -> str:
    return f"{task[0]}{task[1]}" + (f" chunk {task[2]}" if len(task) > 2 else "")


def transfer_times(stage_tasks: Sequence[Sequence[Task]], vpp: int = 1) -> dict[Transfer, int]:
    """Each transfer's logical time: the clock when its consumer runs in a replay of all stages
    with receives blocking (see the module docstring). `vpp`: model chunks per stage."""
    num_stages = len(stage_tasks)
    produced: set[Transfer] = set()
    position, clock, times = [0] * num_stages, 0, {}
    progress = True
    while progress:
        progress = False
        for stage in range(num_stages):
            while position[stage] < len(stage_tasks[stage]):
                task = stage_tasks[stage][position[stage]]
                needed = incoming(task, stage, num_stages, vpp)
                if needed is not None and needed not in produced:
                    break
                if needed is not None:
                    times[needed] = clock
                sent = outgoing(task, stage, num_stages, vpp)
                if sent is not None:
                    produced.add(sent)
                clock += 1
                position[stage] += 1
                progress = True
    stuck = [stage for stage in range(num_stages) if position[stage] < len(stage_tasks[stage])]
    if stuck:
        waits = ", ".join(f"stage {s} waits at {_task_name(stage_tasks[s][position[s]])}" for s in stuck)
        raise P2PDeadlock(f"the plan's stage orders deadlock: {waits}")
    return times


def stage_program(stage_tasks: Sequence[Sequence[Task]], stage: int,
                  times: Optional[dict[Transfer, int]] = None, vpp: int = 1) -> list[P2PCall]:
    """The calls `stage` posts for its task list (`stage_tasks`: every stage's, so that all
    stages derive one global order; `vpp`: model chunks per stage)."""
    num_stages = len(stage_tasks)
    times = transfer_times(stage_tasks, vpp) if times is None else times
    tasks = stage_tasks[stage]
    mine = sorted((t for t in (*(incoming(task, stage, num_stages, vpp) for task in tasks),
                               *(outgoing(task, stage, num_stages, vpp) for task in tasks)) if t is not None),
                  key=lambda t: times[t])
    calls, posted, produced = [], 0, set()
    for position, task in enumerate(tasks):
        needed = incoming(task, stage, num_stages, vpp)
        # Through the receive this task needs (unless an earlier call posted it), then on while
        # the next transfers are sends already produced: they go out as early as the order allows.
        through = posted if needed is None or times[needed] < times[mine[posted]] else mine.index(needed, posted) + 1
        end = through
        while end < len(mine) and mine[end] in produced:
            end += 1
        if end > posted:
            calls.append(_call(position, mine[posted:end], stage, num_stages))
            posted = end
        produced.add(outgoing(task, stage, num_stages, vpp))
    if posted < len(mine):
        calls.append(_call(len(tasks), mine[posted:], stage, num_stages))
    return calls


def _call(before: int, transfers: Sequence[Transfer], stage: int, num_stages: int) -> P2PCall:
    # A transfer never stays on one stage (virtual stages need pp > 1): it is a send or a receive.
    return P2PCall(before, tuple(t for t in transfers if t.source % num_stages == stage),
                   tuple(t for t in transfers if t.destination % num_stages == stage))


def check_deadlock_free(stage_tasks: Sequence[Sequence[Task]], vpp: int = 1) -> None:
    """Raise P2PDeadlock if the stages' task lists, run with the programs `stage_program` writes,
    would wait on each other forever with every send blocking (see `find_deadlock`)."""
    times = transfer_times(stage_tasks, vpp)
    waits = find_deadlock([stage_program(stage_tasks, stage, times, vpp) for stage in range(len(stage_tasks))],
                          vpp)
    if waits:
        raise P2PDeadlock(f"the stage orders' point-to-point transfers deadlock: {waits}")


def find_deadlock(programs: Sequence[Sequence[P2PCall]], vpp: int = 1) -> str:
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
    return "; ".join(f"stage {s} waits in {_describe(programs[s][position[s]], len(programs), vpp)}"
                     for s in stuck)


def _describe(call: P2PCall, num_stages: int, vpp: int) -> str:
    parts = [f"send {t.kind}{t.unit} to {stage_name(t.destination, num_stages, vpp)}" for t in call.sends]
    parts += [f"receive {t.kind}{t.unit} from {stage_name(t.source, num_stages, vpp)}" for t in call.receives]
    return " + ".join(parts)
