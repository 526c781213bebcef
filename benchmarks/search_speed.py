"""`slimpack compare`'s search, one process against several, on the same inputs in one run.

    python benchmarks/search_speed.py [--gpus 32] [--context-length 65536] [--global-batch-size 32]
                                      [--steps 1] [--model llama-7b] [--workload text] [--workers 2]
                                      [--out benchmarks/results/search_speed.md]

Runs `run_comparison` over every strategy twice without the search cache: with one worker (the
strategies one after another) and with `--workers` processes (one strategy per worker at a time,
`apps.comparison._search_in_parallel`). CP-SAT stops on a deterministic limit
(`--solver-deterministic-limit`, default 0.2), so both runs plan the same batches the same way
under any load, and the benchmark checks that they choose the same layout with the same mean
iteration time for every strategy. It reports each run's wall time, the CPU time of the serial
run's strategies (their `search_time_s`), the speedup ratio, and the longest strategy: with as many
workers as strategies the wall time can fall no lower than it. The result file is stamped with the
commit and the machine's core count.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paper_table import current_commit  # noqa: E402  (benchmarks/ is the script's folder)

from megatron_slimpack.apps.comparison import run_comparison  # noqa: E402
from megatron_slimpack.config import SlimPackConfig  # noqa: E402
from megatron_slimpack.costmodel import CostModel  # noqa: E402
from megatron_slimpack.workload import GlobalBatchSampler, load_lengths  # noqa: E402


def compare(args, batches, workers: int):
    cost = CostModel.analytic(args.model, "h100-sxm")
    config = SlimPackConfig(context_length=args.context_length,
                            solver_deterministic_limit=args.solver_deterministic_limit)
    started = time.perf_counter()
    result = run_comparison(workload=args.workload, model=args.model, hardware="h100-sxm", cost=cost, gpus=args.gpus,
                            global_batch_size=args.global_batch_size, steps=args.steps, config=config,
                            show_progress=False, batches=batches, workers=workers)
    return result, time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--workload", default="text")
    parser.add_argument("--gpus", type=int, default=32)
    parser.add_argument("--context-length", type=int, default=65536)
    parser.add_argument("--global-batch-size", type=int, default=32)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--solver-deterministic-limit", type=float, default=0.2)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "search_speed.md"))
    args = parser.parse_args(argv)
    sampler = GlobalBatchSampler(load_lengths(args.workload, seed=0), args.context_length, args.global_batch_size,
                                 seed=0)
    batches = [sampler.next_batch().lengths for _ in range(args.steps)]
    serial, serial_s = compare(args, batches, 1)
    parallel, parallel_s = compare(args, batches, args.workers)
    rows, same = [], True
    for name, found in serial.results.items():
        other = parallel.results.get(name)
        agrees = (other is not None and other.parallel == found.parallel
                  and other.mean_iteration_time_s == found.mean_iteration_time_s)
        same &= agrees
        rows.append(f"| {name} | {found.parallel.describe()} | {found.mean_iteration_time_s:.3f} | "
                    f"{found.search_time_s:.1f} | {'yes' if agrees else 'NO'} |")
    same &= serial.failures == parallel.failures
    cpu_s = sum(found.search_time_s for found in serial.results.values())
    longest = max(serial.results.values(), key=lambda found: found.search_time_s)
    text = "\n".join([
        f"# Compare search: 1 worker against {args.workers}",
        "",
        f"`python benchmarks/search_speed.py --model {args.model} --workload {args.workload} --gpus {args.gpus} "
        f"--context-length {args.context_length} --global-batch-size {args.global_batch_size} --steps {args.steps} "
        f"--workers {args.workers}` at commit {current_commit() or 'unknown'}, on a machine with "
        f"{os.cpu_count()} cores. Every strategy, "
        f"no cache, CP-SAT stopped at {args.solver_deterministic_limit} deterministic units.",
        "",
        f"- wall time: {serial_s:.1f} s with 1 worker, {parallel_s:.1f} s with {args.workers}: "
        f"**{serial_s / parallel_s:.2f}x**",
        f"- searches' own time in the serial run: {cpu_s:.1f} s; the longest, {longest.strategy}: "
        f"{longest.search_time_s:.1f} s (no worker count goes below it)",
        f"- same layout and mean iteration time for every strategy: {'yes' if same else 'NO'}",
        "",
        "| strategy | layout | mean iteration (s) | search, serial run (s) | same with workers |",
        "|---|---|---:|---:|---|",
        *rows,
        "",
    ])
    Path(args.out).write_text(text)
    print(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
