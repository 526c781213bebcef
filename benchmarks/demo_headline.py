"""The main job's headline, measured: `slimpack demo` run `--runs` times, each run's paired speedup of
SlimPack over megatron-fixed with its bootstrap 95% interval, the predicted speedup and each
strategy's measured/predicted step time, in one result file stamped with the commit, the date and
the machine's load.

    python benchmarks/demo_headline.py [--runs 3] [--out benchmarks/results/demo.md] [-- DEMO OPTIONS]

Each run is the demo with its defaults (or the options after `--`): the cost model it plans with
is this machine's own (a quick profile, cached per machine and library versions, made by the first
run). The load average before each run is recorded: the README's figure is a quiet machine's
(load well under the core count); beside other work the demo prints "too noisy to decide" rather
than a loss figure without its interval.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from paper_table import current_commit  # benchmarks/ is the script's folder

ROOT = Path(__file__).resolve().parents[1]


def run_demo(options: list[str]) -> tuple[dict, float]:
    """One demo run's summary.json and the 1-minute load average before it."""
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as out_dir:
        subprocess.run([sys.executable, "-m", "megatron_slimpack.apps.cli", "demo", "--out-dir", out_dir, *options],
                       cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        return json.loads((Path(out_dir) / "summary.json").read_text()), load


def row(index: int, summary: dict, load: float) -> str:
    paired, rows = summary["paired"], summary["rows"]
    return (f"| {index} | {load:.2f} | {summary['predicted_speedup']:.3f}x | {paired['median']:.3f}x | "
            f"[{paired['low']:.3f}, {paired['high']:.3f}] | {paired['verdict']} | "
            f"{rows['megatron-fixed']['measured_over_predicted']:.2f} | "
            f"{rows['slimpack']['measured_over_predicted']:.2f} | "
            f"{summary['max_loss_rel_diff']:.1e} | {summary['wall_s']:.0f} |")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    demo_options = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "demo.md"))
    args = parser.parse_args(argv)
    results = [run_demo(demo_options) for _ in range(args.runs)]
    summary = results[0][0]
    lines = [
        "# The main job's headline: `slimpack demo`, measured",
        "",
        f"`python benchmarks/demo_headline.py --runs {args.runs}"
        + (f" -- {' '.join(demo_options)}" if demo_options else "")
        + f"` at commit {current_commit() or 'unknown'}, "
        f"{datetime.date.today().isoformat()}, on a machine with {os.cpu_count()} cores. Demo options: "
        f"{summary['options']['steps']} steps of {summary['options']['global_batch_size']} x "
        f"{summary['options']['context_length']} tokens, PP={summary['options']['pp']}, {summary['options']['model']} "
        f"model; planned with the {summary['predicted_by']}.",
        "",
        "Speedup: SlimPack over megatron-fixed (Megatron's fixed-length grouping with prefixes kept: the same "
        "objective), the median of paired step-time ratios with its bootstrap 95% interval; measured/predicted: "
        "median step time over the simulator's prediction with the same cost model.",
        "",
        "| run | load before | predicted | measured | 95% interval | verdict | measured/predicted fixed | "
        "measured/predicted slimpack | max loss rel. diff | wall (s) |",
        "|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
        *[row(index + 1, summary, load) for index, (summary, load) in enumerate(results)],
        "",
    ]
    text = "\n".join(lines)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
