"""Spawning a few local processes (gloo on loopback) for CPU runs and tests, never leaving any
behind: the first failing rank's traceback, or the ranks still running at the timeout (a stalled
collective), is raised in the parent."""
from __future__ import annotations

import os
import random
import socket
import time
import traceback
from typing import Callable

from .host_memory import keep_freed_host_memory


class SpawnError(RuntimeError):
    pass


def free_port() -> int:
    """A port that is free now, drawn below the kernel's ephemeral range: a port the kernel hands out
    (bind to 0) is soon handed out again, to gloo's own connections among others, and the rendezvous
    that binds it a moment later then fails with EADDRINUSE."""
    low = max(_ephemeral_range_start() - 12000, 1024)
    for _ in range(100):
        port = random.randrange(low, low + 12000)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise SpawnError(f"no free port in {low}-{low + 11999} after 100 tries")


def _ephemeral_range_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):  # not Linux: IANA's dynamic range starts at 49152
        return 49152


def _run(rank, world_size, port, fn, args, errors):
    try:
        os.environ["SLIMPACK_RANK"] = str(rank)
        keep_freed_host_memory()  # CPU workers: no page-fault storm per MicroPack
        fn(rank, world_size, port, *args)
    except BaseException:  # report to the parent instead of dying silently
        errors.put((rank, traceback.format_exc()))
        raise


def spawn(fn: Callable, world_size: int, args: tuple = (), timeout_s: float = 600.0) -> None:
    """Run fn(rank, world_size, port, *args) in `world_size` spawned processes."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    errors = context.SimpleQueue()
    port = free_port()
    procs = [context.Process(target=_run, args=(r, world_size, port, fn, args, errors)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    stalled = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for rank in stalled:
        procs[rank].kill()
        procs[rank].join()
    failures = []
    while not errors.empty():
        failures.append(errors.get())
    if failures:
        rank, text = failures[0]
        raise SpawnError(f"rank {rank} failed:\n{text}")
    if stalled:
        raise SpawnError(f"ranks {stalled} did not finish within {timeout_s:.0f}s (a stalled collective?)")
