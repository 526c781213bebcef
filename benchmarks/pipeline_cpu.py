"""Measured CPU pipeline run (PP=2, two gloo processes, tiny model, real text lengths):
tokens/s of `slimpack`, `megatron-fixed` and `slimpack-sym` in the same run, next to the
simulator's prediction for each plan (profiled cost model when benchmarks/results/
profile_cpu_tiny.json exists, else the analytic "cpu" model).

    .venv/bin/python benchmarks/pipeline_cpu.py [--steps 2] [--repeats 2] [--context-length 2048]

Writes benchmarks/results/pipeline_cpu.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRATEGIES = ("slimpack", "megatron-fixed", "slimpack-sym")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=2, help="global batches")
    parser.add_argument("--global-batch-size", type=int, default=4, help="contexts per global batch")
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=str(ROOT / "benchmarks/results/profile_cpu_tiny.json"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/pipeline_cpu.md"))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from megatron_slimpack.apps.fidelity import measure_plans, text_plans
    from megatron_slimpack.costmodel import CostModel
    from megatron_slimpack.simulator.dag import simulate

    if Path(args.profile).exists():
        cost, source = CostModel.from_profile(args.profile), f"profiled ({Path(args.profile).name})"
    else:
        cost, source = CostModel.analytic(args.model, "cpu", dtype_bytes=4, attention_backend="torch"), "analytic cpu"
    planned = text_plans(cost, strategies=STRATEGIES, pp=2, dp=1, context_length=args.context_length,
                         global_batch_size=args.global_batch_size, steps=args.steps, seed=args.seed)
    began = time.perf_counter()
    steps = measure_plans([p for _, _, p in planned], cost.model, batches=[b for _, b, _ in planned],
                          repeats=args.repeats, warmup=1)
    wall = time.perf_counter() - began
    rows = {name: {"tokens": 0, "measured_s": 0.0, "simulated_s": 0.0, "micropacks": 0, "units": []}
            for name in STRATEGIES}
    for index, (name, _batch, plan) in enumerate(planned):
        measured = statistics.median(s.iteration_time_s for s in steps if s.plan_index == index)
        row = rows[name]
        row["tokens"] += plan.num_tokens
        row["measured_s"] += measured
        row["simulated_s"] += simulate(plan, cost, detail=False).iteration_time_s
        row["micropacks"] += len(plan.replicas[0].micropacks)
        row["units"].append(f"{len(plan.replicas[0].forward_units)}F/{len(plan.replicas[0].backward_units)}B")
    base = rows["megatron-fixed"]["tokens"] / rows["megatron-fixed"]["measured_s"]
    lines = [
        f"# Measured CPU pipeline run (PP=2, 2 gloo processes x 1 thread, model `{cost.model.name}`)",
        "",
        f"Real text lengths (`load_lengths(\"text\")`, stdlib *.py files, byte tokens from `TextCorpus`), "
        f"context {args.context_length}, {args.steps} global batches of {args.global_batch_size} contexts, "
        f"median of {args.repeats} timed steps after 1 warm-up per plan; the same processes run every strategy. "
        f"Simulator: {source} cost model. Total wall time {wall:.0f} s.",
        "",
        "| strategy | tokens | MicroPacks | units per batch | measured (s) | measured tokens/s | vs megatron-fixed "
        "| simulated (s) | simulated tokens/s | sim. error |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in rows.items():
        tps = row["tokens"] / row["measured_s"]
        sim_tps = row["tokens"] / row["simulated_s"]
        error = (row["simulated_s"] - row["measured_s"]) / row["measured_s"]
        lines.append(f"| {name} | {row['tokens']} | {row['micropacks']} | {', '.join(row['units'])} | "
                     f"{row['measured_s']:.2f} | {tps:,.0f} | {tps / base:.2f}x | {row['simulated_s']:.2f} | "
                     f"{sim_tps:,.0f} | {100 * error:+.1f}% |")
    import os

    load = os.getloadavg()
    lines += ["", f"Machine: {os.cpu_count()} shared CPU cores, "
              f"load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
              "(1/5/15 min) at the end of the run: other developers' jobs compete for the cores, so absolute "
              "times (and the simulator's error against a profile taken under different load) vary between runs; "
              "the strategies ran interleaved in the same processes, so their ratio is the fairer comparison.", ""]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
