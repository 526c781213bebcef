"""Simulator fidelity on this CPU: profile the model on a grid, then run K *different* real
steps (PP=2, gloo, real text lengths, plans from a separate seed) and compare measured with
simulated iteration time, per-task time and per-stage peak activation memory.

    .venv/bin/python benchmarks/fidelity.py [--plans 3] [--repeats 3] [--reprofile [--concurrent 2]]

Writes benchmarks/results/fidelity.md and per-step overlaid Gantt charts (measured vs
simulated) under benchmarks/results/fidelity/.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--plans", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--context-length", type=int, default=2048)
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--strategy", action="append")
    parser.add_argument("--profile", default=str(ROOT / "benchmarks/results/profile_cpu_tiny.json"))
    parser.add_argument("--reprofile", action="store_true")
    parser.add_argument("--concurrent", type=int, default=2,
                        help="processes profiling at once when re-profiling (2: the validation's PP=2 contention)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/fidelity.md"))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from megatron_slimpack.apps.fidelity import summary_table, validate
    from megatron_slimpack.apps.profiler import describe_fit, profile
    from megatron_slimpack.costmodel import CostModel

    if args.reprofile or not Path(args.profile).exists():
        profile(args.model, pp=2, concurrent=args.concurrent).write(args.profile)
    import json

    fit = json.loads(Path(args.profile).read_text())["fit"]
    cost = CostModel.from_profile(args.profile)
    strategies = args.strategy or ["slimpack", "megatron-fixed"]
    comparisons, figures = validate(cost, plans=args.plans, pp=2, dp=1, strategies=strategies,
                                    context_length=args.context_length, global_batch_size=args.global_batch_size,
                                    repeats=args.repeats, seed=100, out_dir=Path(args.out).parent / "fidelity")
    import os

    load = os.getloadavg()
    errors = sorted(100 * e for e in figures["iteration_errors"])
    lines = [
        "# Simulator fidelity on this machine (2 shared CPU cores, PP=2 over gloo, model "
        f"`{cost.model.name}`, fp32, torch attention)",
        "",
        "Profile: `slimpack profile` grid " + json.dumps(fit.get("grid"))
        + f" (1 thread per process, {fit.get('concurrent_processes', 1)} processes measuring at once), "
        "fitted by least squares; "
        f"validation: {args.plans} global batches of real text lengths (context {args.context_length}, "
        f"{args.global_batch_size} contexts each, sampler seed 100, not the profiling shapes), planned by "
        f"{', '.join(strategies)}, each run 1 + {args.repeats} times (first discarded).",
        "",
        "## Fit of the profile (error per term)",
        "",
        "```",
        describe_fit(fit),
        "```",
        "",
        "## Measured vs simulated",
        "",
        summary_table(comparisons),
        f"**Iteration-time MAPE {100 * figures['iteration_mape']:.1f}%** over all {len(errors)} timed steps "
        f"(of the per-plan medians: {100 * figures['iteration_mape_of_medians']:.1f}%); "
        f"per-task (F/B unit) MAPE {100 * figures['task_mape']:.1f}%; "
        f"**per-stage peak activation memory MAPE {100 * figures['memory_mape']:.1f}%**.",
        "",
        "Distribution of the per-step iteration-time error (|sim - meas| / meas, %): "
        + ", ".join(f"{e:.1f}" for e in errors)
        + (f" (median {statistics.median(errors):.1f}%)" if errors else ""),
        "",
    ]
    if "corrected_iteration_mape" in figures:
        corrected = sorted(100 * e for e in figures["corrected_iteration_errors"])
        drift = figures["drift"]
        lines += [
            "### Drift-corrected",
            "",
            f"The machine's speed is not the profile's (shared cores, other jobs): the same "
            f"1024-token reference forward + backward, timed when profiling ({1e3 * cost.reference['seconds']:.0f} ms) "
            f"and again right before each validation step on every rank, ran {min(drift):.2f}-{max(drift):.2f}x "
            "as long before the steps. Scaling each simulated time by that step's drift leaves the cost model's own "
            f"error: **iteration-time MAPE {100 * figures['corrected_iteration_mape']:.1f}%** "
            f"(per step, %: {', '.join(f'{e:.1f}' for e in corrected)}), per-task MAPE "
            f"{100 * figures['corrected_task_mape']:.1f}%.",
            "",
        ]
    lines += [
        f"Machine load average during the run (1/5/15 min): {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} on "
        f"{os.cpu_count()} shared cores.",
        "",
        "Targets: iteration time <= 10%, peak memory <= 5%. Gantt charts (measured top, simulated bottom, one time "
        "axis) and Chrome traces per plan: `benchmarks/results/fidelity/`.",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
