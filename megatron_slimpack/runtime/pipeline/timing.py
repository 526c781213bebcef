"""Measured timelines of pipeline steps: per-task start/end on every rank, gathered to rank 0.

`Timeline` is what `slimpack_forward_backward(..., timeline=...)` fills in. Every rank starts its
clock at the same moment (a barrier over the timing group, then the clock's origin), records
each task it runs, and `gather()` collects everything on the group's first rank.

Clocks: on the CPU `time.perf_counter()`. Where a GPU is present (`clock="auto"`), the host only
launches work, so host times would measure launches: each stamp is then also a CUDA event recorded
on the current stream (`EventStamp`, a float holding the host time until resolved), and `gather()`
waits for the device once and turns every stamp into its event's time since the origin event.

Record fields match the simulator's `TaskRecord` (rank, stage, replica, kind, unit, start, end, detail), so
`simulator.report.write_chrome_trace` / `write_gantt` draw measured and simulated steps alike:

* kind "F" / "B": compute of a forward / backward unit on a stage (after its input arrived, up to
  posting its output send). `rank` is the data-parallel rank, `stage` the pipeline stage, `chunk`
  the model chunk (virtual pipeline stages; 0 without; for RECV the receiving chunk, for P2P the
  sending one).
* kind "RECV": time blocked in a receive (`detail` "F 0->1": activation of forward unit `unit`
  sent by stage 0 to stage 1; "B 1->0": gradient of backward unit `unit`).
* kind "P2P": a non-blocking send from posting to observed completion (completion is polled at
  task boundaries, so the end is an upper bound to within one task); `detail` as for RECV.
* kind "DP": the gradient reduction after the last backward (finalize_model_grads / all-reduce).

Tensor-parallel ranks other than 0 record too but their records are dropped at gather time (they
mirror TP rank 0's). Memory: when `track_memory` is on, the stage executor also records, per
stage, the saved-tensor bytes of each MicroPack's forward (unique storages, parameters excluded)
and the peak over the step of (live MicroPacks' saved bytes + KV-store bytes) in
`peak_activation_bytes`.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.distributed as dist

from ...simulator.dag import TaskRecord
from ...simulator.report import write_chrome_trace, write_gantt


@dataclass(slots=True)
class TimedTask(TaskRecord):
    """A measured task: the simulator's record plus the tensor-parallel rank that measured it."""

    tp_rank: int = 0


@dataclass
class StageMemory:
    """Activation memory measured on one (rank, stage): bytes in the autograd graph."""

    rank: int
    stage: int
    micropack_bytes: dict = field(default_factory=dict)  # MicroPack index -> saved-tensor bytes
    peak_activation_bytes: int = 0  # max over the step of live saved bytes + KV store bytes
    tp_rank: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


class SavedBytesMeter:
    """Counts the bytes autograd saves inside the context: unique storages, parameters excluded."""

    def __init__(self, excluded_storages: set[int]):
        self._excluded = excluded_storages
        self._seen: dict = {}
        self.shared: set[int] = set()  # storages split into per-MicroPack views: count the view

    def _pack(self, tensor):
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer in self.shared:
            self._seen.setdefault((pointer, tensor.storage_offset()), tensor.numel() * tensor.element_size())
        elif pointer not in self._excluded:
            self._seen.setdefault(pointer, storage.nbytes())
        return tensor

    def __enter__(self):
        self._seen = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())


class EventStamp(float):
    """A time stamp of the CUDA-event clock: the host time (seconds since the origin) as its float
    value, and the CUDA event recorded with it; `Timeline.gather` replaces it by the event's time."""

    __slots__ = ("event",)
    event: Any

    def __new__(cls, host_seconds: float, event):
        stamp = super().__new__(cls, host_seconds)
        stamp.event = event
        return stamp


def _new_event():
    """A CUDA event with timing, recorded now on the current stream."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _wait_for_device() -> None:
    torch.cuda.synchronize()


class Timeline:
    """Collects this rank's task timings for one step; `gather()` brings all ranks' to rank 0.

    Usage: pass `timeline=Timeline()` (or `timeline=True`, then read `result.timeline`) to
    `slimpack_forward_backward`. After the call, on the first rank of `group` (default: the
    world), `timeline.records` holds every rank's records and `timeline.memory` every stage's
    memory figures; elsewhere they hold this rank's only.
    """

    def __init__(self, group=None, track_memory: bool = False, gather: bool = True, clock: str = "auto"):
        """clock: "auto" (CUDA events where this process uses a GPU, else the host's: decided at
        `start`), "cuda" or "host"."""
        if clock not in ("auto", "cuda", "host"):
            raise ValueError(f"Timeline clock {clock!r}: choose auto, cuda or host")
        self.clock = clock
        self._origin_event = None
        self.group = group
        self.track_memory = track_memory
        self.do_gather = gather
        self.records: list[TimedTask] = []
        self.memory: list[StageMemory] = []
        self.origin: float = 0.0
        self.rank = self.stage = self.replica = self.tp_rank = 0

    # ---- recording (called by the schedule and its stage executor) ----------------------
    def start(self, *, rank: int, stage: int, tp_rank: int = 0, sync: bool = True) -> None:
        """Barrier over the group (so every rank's clock starts together), then zero the clock."""
        self.rank, self.stage, self.replica, self.tp_rank = rank, stage, rank, tp_rank
        self.records = []
        self.memory = []
        if sync and dist.is_initialized() and dist.get_world_size(self.group) > 1:
            dist.barrier(group=self.group)
        if self.clock == "auto":
            # A process that never initialised CUDA runs its steps on the CPU even on a GPU machine.
            self.clock = "cuda" if torch.cuda.is_available() and torch.cuda.is_initialized() else "host"
        self.origin = time.perf_counter()
        self._origin_event = _new_event() if self.clock == "cuda" else None

    def now(self) -> float:
        """Seconds since `start`: a plain float on the host clock, an `EventStamp` on the CUDA one."""
        host = time.perf_counter() - self.origin
        return EventStamp(host, _new_event()) if self._origin_event is not None else host

    def resolve(self) -> None:
        """Turn the records' CUDA-event stamps into seconds since the origin event: one wait for the
        device, then each event's elapsed time (a no-op on the host clock)."""
        origin = self._origin_event
        stamped = [r for r in self.records if isinstance(r.start, EventStamp) or isinstance(r.end, EventStamp)]
        if origin is None or not stamped:
            return
        _wait_for_device()

        def seconds(stamp: float) -> float:
            return origin.elapsed_time(stamp.event) / 1e3 if isinstance(stamp, EventStamp) else float(stamp)

        for record in stamped:
            record.start, record.end = seconds(record.start), seconds(record.end)

    def record(self, kind: str, unit: int, start: float, end: float, detail: str = "", chunk: int = 0) -> None:
        self.records.append(TimedTask(self.rank, self.stage, self.replica, kind, unit, start, end, detail,
                                      chunk=chunk, tp_rank=self.tp_rank))

    def gather(self) -> None:
        """Resolve this rank's CUDA-event stamps, then collect all ranks' records (and memory) on
        the group's first rank."""
        self.resolve()
        if not self.do_gather or not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return
        size = dist.get_world_size(self.group)
        mine = ([r.to_dict() for r in self.records], [m.to_dict() for m in self.memory])
        dst = dist.get_global_rank(self.group, 0) if self.group is not None else 0
        everyone: list[Any] | None = [None] * size if dist.get_rank() == dst else None
        dist.gather_object(mine, everyone, dst=dst, group=self.group)
        if everyone is None:
            return
        records, memory = [], []
        for task_dicts, memory_dicts in everyone:
            records += [TimedTask(**t) for t in task_dicts if t["tp_rank"] == 0]
            memory += [StageMemory(**m) for m in memory_dicts if m["tp_rank"] == 0]
        records.sort(key=lambda r: (r.rank, r.stage, r.start))
        memory.sort(key=lambda m: (m.rank, m.stage))
        self.records, self.memory = records, memory

    # ---- queries and outputs ----------------------------------------------------------------
    @property
    def iteration_time_s(self) -> float:
        return max((r.end for r in self.records), default=0.0)

    def compute_records(self) -> list[TimedTask]:
        return [r for r in self.records if r.kind in ("F", "B")]

    def peak_activation_bytes(self) -> dict[tuple[int, int], int]:
        return {(m.rank, m.stage): m.peak_activation_bytes for m in self.memory}

    def to_dict(self) -> dict:
        return {"records": [r.to_dict() for r in self.records], "memory": [m.to_dict() for m in self.memory]}

    def write_chrome_trace(self, path: str | Path, metadata: Optional[Mapping[str, Any]] = None) -> Path:
        return write_chrome_trace([r.to_dict() for r in self.records], path,
                                  {"source": "measured", **dict(metadata or {})})

    def write_gantt(self, path: str | Path, title: Optional[str] = None) -> Path:
        return write_gantt([r.to_dict() for r in self.records], path, title=title or "measured step")

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict()))
        return path


def overlay_records(measured, simulated, *, measured_label: str = "measured",
                    simulated_label: str = "simulated") -> list[dict]:
    """Measured and simulated records in one list for a single Chrome trace / Gantt chart: measured
    devices keep their ranks, simulated ones are shifted to ranks after them (and named)."""
    measured = [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in measured]
    simulated = [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in simulated]
    shift = 1 + max((int(r["rank"]) for r in measured), default=-1)
    out = [{**r, "name": f"{measured_label} {r['kind']}{r['unit'] if r['unit'] >= 0 else ''}"} for r in measured]
    out += [{**r, "rank": int(r["rank"]) + shift,
             "name": f"{simulated_label} {r['kind']}{r['unit'] if r['unit'] >= 0 else ''}"}
            for r in simulated]
    return out


def write_overlay_gantt(measured, simulated, path: str | Path, title: str = "") -> Path:
    """Two stacked Gantt panels on one time axis: measured (top) and simulated (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"F": "#4C72B0", "B": "#DD8452", "DP": "#8C8C8C", "RECV": "#DDDDDD", "P2P": "#55A868"}
    panels = [("measured", [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in measured]),
              ("simulated", [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in simulated])]
    horizon = max((r["end"] for _, records in panels for r in records), default=1.0) or 1.0
    devices = sorted({(int(r["rank"]), int(r["stage"])) for _, records in panels for r in records})
    fig, axes = plt.subplots(2, 1, figsize=(12, 1.6 + 0.8 * max(1, len(devices))), sharex=True)
    for ax, (label, records) in zip(axes, panels):
        row_of = {d: i for i, d in enumerate(devices)}
        for r in records:
            kind = r["kind"]
            if kind not in ("F", "B", "DP"):
                continue
            row = row_of[(int(r["rank"]), int(r["stage"]))]
            ax.broken_barh([(r["start"], r["end"] - r["start"])], (row - 0.4, 0.8 if kind != "DP" else 0.3),
                           facecolors=colours[kind], edgecolor="white", linewidth=0.3)
            if kind in ("F", "B") and r["end"] - r["start"] > horizon / 50:
                ax.text((r["start"] + r["end"]) / 2, row, f"{kind}{r['unit']}", ha="center", va="center",
                        fontsize=6, color="white", clip_on=True)
        ax.set_yticks(range(len(devices)), [f"r{a} s{b}" for a, b in devices])
        ax.set_ylim(len(devices) - 0.5, -0.5)
        ax.set_ylabel(label)
    axes[-1].set_xlabel("time (s)")
    axes[-1].set_xlim(0, horizon * 1.01)
    if title:
        axes[0].set_title(title, loc="left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
