"""Memory accounting of the simulated step: allocations as (start, end, bytes) intervals per device.

The DAG simulator fills a `MemoryLedger` with every buffer a device holds for a while
(activations of an in-flight MicroPack, a slice's KV cache, the recompute transient of a
backward task) and then asks for each device's timeline and peak. Static memory (weights,
gradients, optimizer state) sits under every timeline.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class MemoryTimeline:
    """Bytes held by one device (data-parallel rank, pipeline stage) over the step.

    `points` are (time_s, bytes) pairs: the level from that time until the next point.
    """

    rank: int
    stage: int
    peak_bytes: float
    points: list[tuple[float, float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"rank": self.rank, "stage": self.stage, "peak_bytes": self.peak_bytes,
                "points": [[t, b] for t, b in self.points]}

    @classmethod
    def from_dict(cls, data: dict) -> "MemoryTimeline":
        return cls(int(data["rank"]), int(data["stage"]), float(data["peak_bytes"]),
                   [(float(t), float(b)) for t, b in data["points"]])


class MemoryLedger:
    """Collects allocation intervals per device; vectorised so thousands of MicroPacks stay cheap."""

    def __init__(self, num_devices: int):
        self._starts: list[list[np.ndarray]] = [[] for _ in range(num_devices)]
        self._ends: list[list[np.ndarray]] = [[] for _ in range(num_devices)]
        self._bytes: list[list[np.ndarray]] = [[] for _ in range(num_devices)]

    def hold(self, device: int, starts, ends, nbytes) -> None:
        """Buffers of `nbytes` allocated at `starts` and freed at `ends` (arrays or scalars)."""
        starts = np.atleast_1d(np.asarray(starts, dtype=float))
        ends = np.broadcast_to(np.asarray(ends, dtype=float), starts.shape)
        nbytes = np.broadcast_to(np.asarray(nbytes, dtype=float), starts.shape)
        keep = nbytes != 0
        if keep.any():
            self._starts[device].append(starts[keep])
            self._ends[device].append(ends[keep])
            self._bytes[device].append(nbytes[keep])

    def timeline(self, device: int, static_bytes: float, with_points: bool = True) -> tuple[float, list]:
        """(peak bytes, timeline points). At equal times frees come before allocations: a
        backward that ends when the next forward starts hands its memory over."""
        if not self._starts[device]:
            return static_bytes, [(0.0, static_bytes)]
        starts = np.concatenate(self._starts[device])
        ends = np.concatenate(self._ends[device])
        nbytes = np.concatenate(self._bytes[device])
        times = np.concatenate([starts, ends])
        deltas = np.concatenate([nbytes, -nbytes])
        # By time, then by change (frees first): complex numbers sort by real part, then imaginary,
        # a third faster than np.lexsort on millions of intervals
        order = np.argsort(times + 1j * deltas)
        times, levels = times[order], static_bytes + np.cumsum(deltas[order])
        peak = max(static_bytes, float(levels.max()))
        if not with_points:
            return peak, []
        # Keep the last level at each distinct time (frees sort first, so no peak is lost).
        last_at_time = np.append(times[1:] != times[:-1], True)
        points = [(0.0, static_bytes)] + list(zip(times[last_at_time].tolist(), levels[last_at_time].tolist()))
        return peak, points
