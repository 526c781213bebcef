"""The simulator's list scheduler, compiled with numba.

A layout search simulates every plan it screens: 10^4-10^5 tasks per plan (each replica's units
on every virtual stage), and the scheduling loop ran as Python bytecode once per task and edge
(cProfile of SlimPack's 256K search: 11% of it, the largest single function). `list_schedule` is
`dag._run`'s loop over flat arrays, with the same floating-point operations in the same order
and the same last-in-first-out order of released tasks (a link's transfers queue in the order
their senders finish, so the order changes times), so a schedule is the same to the last bit
(`tests/test_simulator.py` checks it against the Python loop). Compiled code is cached on disk.
"""
from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def _arrive(after: int, arrived: float, ready_at: np.ndarray, missing: np.ndarray, stack: np.ndarray,
            top: int) -> int:
    """An input of task `after` arrives: it is ready no earlier, and released (pushed) with its
    last input. Returns the stack's new top."""
    if arrived > ready_at[after]:
        ready_at[after] = arrived
    missing[after] -= 1
    if missing[after] == 0:
        stack[top] = after
        top += 1
    return top


@numba.njit(cache=True, nogil=True)
def list_schedule(duration: np.ndarray, missing: np.ndarray, program_start: np.ndarray, program_next: np.ndarray,
                  release_start: np.ndarray, release_offsets: np.ndarray, send_offset: np.ndarray,
                  send_seconds: np.ndarray, device_start: np.ndarray, devices: np.ndarray, links: int):
    """Start, end and data-chain end of every task, the transfers (sending task, start, end) and
    how many tasks ran (fewer than all: a cycle). `missing` (changed in place): each task's
    unarrived inputs. Successors as CSR arrays, each task's in the order the Python loop visits
    them: program successors (`program_start[t]:program_start[t + 1]` of `program_next`), data
    releases (offsets from the task), then its p2p send (`send_offset`, 0: none) over the links of
    its `devices` (2 per device: downstream, upstream)."""
    n = len(duration)
    ready_at = np.zeros(n)
    chain_ready = np.zeros(n)
    start = np.zeros(n)
    end = np.zeros(n)
    chain_end = np.zeros(n)
    link_free = np.zeros(links)
    sent_by = np.empty(n, dtype=np.int64)
    sent_at = np.empty(n)
    arrived_at = np.empty(n)
    transfers = 0
    stack = np.empty(n, dtype=np.int64)  # every task is pushed once, when its last input arrives
    top = 0
    for task in range(n):
        if missing[task] == 0:
            stack[top] = task
            top += 1
    done = 0
    while top > 0:
        top -= 1
        task = stack[top]
        done += 1
        began = ready_at[task]
        finished = began + duration[task]
        end[task] = finished
        start[task] = began
        chain = chain_ready[task] + duration[task]
        chain_end[task] = chain
        for k in range(program_start[task], program_start[task + 1]):
            top = _arrive(program_next[k], finished, ready_at, missing, stack, top)
        for k in range(release_start[task], release_start[task + 1]):
            after = task + release_offsets[k]
            if chain > chain_ready[after]:
                chain_ready[after] = chain
            top = _arrive(after, finished, ready_at, missing, stack, top)
        offset = send_offset[task]
        if offset != 0:
            # Non-blocking send: FIFO on the link of each sending device, in issue order.
            seconds = send_seconds[task]
            link = 1 if offset < 0 else 0
            sent = finished
            for k in range(device_start[task], device_start[task + 1]):
                free = link_free[2 * devices[k] + link]
                if free > sent:
                    sent = free
            arrived = sent + seconds
            for k in range(device_start[task], device_start[task + 1]):
                link_free[2 * devices[k] + link] = arrived
            if seconds > 0:
                sent_by[transfers] = task
                sent_at[transfers] = sent
                arrived_at[transfers] = arrived
                transfers += 1
            after = task + offset
            if chain + seconds > chain_ready[after]:
                chain_ready[after] = chain + seconds
            top = _arrive(after, arrived, ready_at, missing, stack, top)
    return start, end, chain_end, sent_by[:transfers], sent_at[:transfers], arrived_at[:transfers], done


@numba.njit(cache=True, nogil=True)
def program_successors(before: np.ndarray, after: np.ndarray, n: int):
    """Each task's program successors as CSR arrays (`starts`, `successors`): `after[k]` follows
    `before[k]` on a device, listed per task in the order of the pairs (the devices' programs in
    turn), as a stable sort by `before` orders them. A counting sort: linear in the pairs (a 150B
    plan's millions of tasks made `argsort` a twentieth of a simulation)."""
    starts = np.zeros(n + 1, dtype=np.int64)
    for task in before:
        starts[task + 1] += 1
    for task in range(n):
        starts[task + 1] += starts[task]
    filled = starts[:-1].copy()
    successors = np.empty(len(before), dtype=np.int64)
    for k in range(len(before)):
        task = before[k]
        successors[filled[task]] = after[k]
        filled[task] += 1
    return starts, successors
