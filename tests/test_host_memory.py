"""CPU workers keep freed host memory: a large tensor freed and allocated again reuses warm pages
instead of a fresh mmap that page-faults on every 4 KiB."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

SCRIPT = """
import resource, torch
from megatron_slimpack.runtime.host_memory import keep_freed_host_memory
applied = keep_freed_host_memory()
elements = (64 << 20) // 4  # 64 MiB: above glibc's largest mmap threshold
torch.empty(elements).fill_(1.0)  # grow the heap once
faults = []
for _ in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    torch.empty(elements).fill_(1.0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, sorted(faults)[len(faults) // 2])  # the median: a rare heap extension is not the point
"""


def faults_per_allocation(keep: str) -> tuple[bool, float]:
    env = dict(os.environ, SLIMPACK_KEEP_HOST_MEMORY=keep)
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()[-2:]
    return applied == "True", float(faults)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt")
def test_freed_host_memory_is_reused_without_page_faults():
    pages = (64 << 20) // 4096
    applied, kept = faults_per_allocation("1")
    assert applied
    assert kept < 0.05 * pages
    opted_out, fresh = faults_per_allocation("0")
    assert not opted_out
    assert fresh > 0.5 * pages  # glibc's default: a fresh mmap, every page faulted in again
