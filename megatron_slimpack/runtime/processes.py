"""Spawning a few local processes (gloo on loopback) for CPU runs and tests, never leaving any
behind: the first failing rank's traceback, or the ranks still running at the timeout (a stalled
collective), is raised in the parent."""
from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Callable


class SpawnError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(rank, world_size, port, fn, args, errors):
    try:
        os.environ["SLIMPACK_RANK"] = str(rank)
        from .host_memory import keep_freed_host_memory

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
