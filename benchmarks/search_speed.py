"""`slimpack compare`'s search, one process against several, or this tree's search against another
revision's, on the same inputs in one run.

    python benchmarks/search_speed.py [--gpus 32] [--context-length 65536] [--global-batch-size 32]
                                      [--steps 1] [--model llama-7b] [--workload text] [--workers 2]
                                      [--out benchmarks/results/search_speed.md]
    python benchmarks/search_speed.py --against REV [--strategies a,b] [--side-by-side] [...]
                                      [--out benchmarks/results/search_against.md]
    python benchmarks/search_speed.py --against REV --strategies slimpack --plannings 14 [...]

With `--against REV`, the git revision REV is checked out to a temporary worktree and each side
runs the comparison (one worker, no cache, the same batches) in a process of its own, one after
the other (`--side-by-side`: both at once, one core each); the report gives each strategy's search
time on both sides, their ratio, and whether the chosen layout and mean iteration time are the same.
With `--plannings N` (one strategy), each side runs only the first N plannings of the search's
screening of the first batch, in the search's own order: a cell whose whole search takes hours
(a 150B model on 256 GPUs) is timed planning by planning, each with its first-batch time or
rejection on both sides.

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
import json
import os
import subprocess
import sys
import tempfile
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


# One side of `--against`: run in a process of its own with the tree under test first on sys.path;
# it reads the inputs as JSON and prints one JSON object per strategy.
ONE_SIDE = """
import json, sys
inputs = json.loads(sys.stdin.read())
from megatron_slimpack.apps.comparison import run_comparison
from megatron_slimpack.config import SlimPackConfig
from megatron_slimpack.costmodel import CostModel
cost = CostModel.analytic(inputs["model"], "h100-sxm")
config = SlimPackConfig(context_length=inputs["context_length"],
                        solver_deterministic_limit=inputs["solver_deterministic_limit"])
result = run_comparison(workload=inputs["workload"], model=inputs["model"], hardware="h100-sxm", cost=cost,
                        gpus=inputs["gpus"], global_batch_size=inputs["global_batch_size"],
                        steps=len(inputs["batches"]), strategies=inputs["strategies"], config=config,
                        show_progress=False, batches=inputs["batches"], workers=1)
rows = {name: {"layout": found.parallel.describe(), "mean_s": found.mean_iteration_time_s,
               "search_s": found.search_time_s} for name, found in result.results.items()}
rows.update({name: {"failed": str(why)} for name, why in result.failures.items()})
print(json.dumps({"rows": rows}))
"""


# One side of `--plannings`: the search of one strategy on the first batch, each planning
# (`layouts._plan_and_simulate`) timed and the search stopped after the first N.
FIRST_PLANNINGS = """
import json, sys, time
inputs = json.loads(sys.stdin.read())
from megatron_slimpack.config import SlimPackConfig
from megatron_slimpack.costmodel import CostModel
from megatron_slimpack.planner import layouts
cost = CostModel.analytic(inputs["model"], "h100-sxm")
config = SlimPackConfig(context_length=inputs["context_length"],
                        solver_deterministic_limit=inputs["solver_deterministic_limit"])
# Untimed first: a small search of the strategy, so that each side's compiled loops are compiled
# (or loaded from its numba cache) before the plannings are timed.
layouts.best_layout(inputs["strategies"], [[4096] * 6 + [16384] * 2 + [300] * 40],
                    CostModel.analytic("llama-7b", "h100-sxm"), 8, 16384, SlimPackConfig(context_length=16384))
planned, original = [], layouts._plan_and_simulate
class Enough(Exception):
    pass
def timed(run, lengths, cost, step, *args, **kwargs):
    started = time.perf_counter()
    rejection = original(run, lengths, cost, step, *args, **kwargs)
    result = rejection.kind if rejection else run.reports[-1].iteration_time_s
    planned.append({"layout": run.parallel.describe(), "result": result, "s": time.perf_counter() - started})
    if len(planned) == inputs["plannings"]:
        raise Enough
    return rejection
layouts._plan_and_simulate = timed
try:
    layouts.best_layout(inputs["strategies"], inputs["batches"][:1], cost, inputs["gpus"], inputs["context_length"],
                        config)
except Enough:
    pass
print(json.dumps({"plannings": planned}))
"""


def run_side(tree: Path, inputs: dict, script: str = ONE_SIDE) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    process = subprocess.Popen([sys.executable, "-c", script], cwd=tree, env=env, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    assert process.stdin is not None
    process.stdin.write(json.dumps(inputs))
    process.stdin.close()
    return process


def side_result(process: subprocess.Popen, tree: Path) -> dict:
    assert process.stdout is not None
    output = process.stdout.read()
    if process.wait() != 0:
        raise SystemExit(f"search_speed: the comparison with the code in {tree} failed (exit {process.returncode})")
    return json.loads(output.strip().splitlines()[-1])


def against(args, batches) -> int:
    """This tree's search against revision `args.against`'s on the same batches."""
    commit = current_commit() or "unknown"  # the tree searched (edits made while it runs are not in it)
    inputs = {"model": args.model, "workload": args.workload, "gpus": args.gpus, "context_length": args.context_length,
              "global_batch_size": args.global_batch_size, "strategies": args.strategies, "batches": batches,
              "solver_deterministic_limit": args.solver_deterministic_limit}
    script = ONE_SIDE
    if args.plannings:
        inputs["plannings"], script = args.plannings, FIRST_PLANNINGS
    with tempfile.TemporaryDirectory() as scratch:
        old_tree = Path(scratch) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", "--quiet", str(old_tree), args.against], cwd=ROOT,
                       check=True)
        try:
            if args.side_by_side:
                running = [run_side(old_tree, inputs, script), run_side(ROOT, inputs, script)]
                old, new = (side_result(process, tree) for process, tree in zip(running, (old_tree, ROOT)))
            else:
                old = side_result(run_side(old_tree, inputs, script), old_tree)
                new = side_result(run_side(ROOT, inputs, script), ROOT)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old_tree)], cwd=ROOT, check=False)
    if args.plannings:
        return _plannings_report(args, commit, old["plannings"], new["plannings"])
    rows, same = [], True
    for name, was in old["rows"].items():
        now = new["rows"].get(name, {})
        agrees = was.get("layout") == now.get("layout") and was.get("mean_s") == now.get("mean_s") \
            and was.get("failed") == now.get("failed")
        same &= agrees
        if "failed" in was or "failed" in now:
            rows.append(f"| {name} | no feasible layout | | | | | {'yes' if agrees else 'NO'} |")
            continue
        differs = f"NO: {was['layout']}, {was['mean_s']:.3f} s before"
        speedup = was["search_s"] / now["search_s"]
        rows.append(f"| {name} | {now['layout']} | {now['mean_s']:.3f} | {was['search_s']:.1f} | "
                    f"{now['search_s']:.1f} | {speedup:.2f}x | {'yes' if agrees else differs} |")
    old_s = sum(row.get("search_s", 0.0) for row in old["rows"].values())
    new_s = sum(row.get("search_s", 0.0) for row in new["rows"].values())
    return _report(args.out, [
        f"# Compare search: this tree against {args.against}",
        "",
        f"`python benchmarks/search_speed.py --against {args.against} --model {args.model} --workload {args.workload} "
        f"--gpus {args.gpus} --context-length {args.context_length} --global-batch-size {args.global_batch_size} "
        f"--steps {args.steps} --strategies {args.strategies}{' --side-by-side' if args.side_by_side else ''}` "
        f"at commit {commit}, on a machine with {os.cpu_count()} cores; the sides ran "
        f"{'at once, one core each' if args.side_by_side else 'one after the other'}. One worker each, no cache, "
        f"CP-SAT stopped at {args.solver_deterministic_limit} deterministic units.",
        "",
        f"- searches' time, every strategy: {old_s:.1f} s with {args.against}, {new_s:.1f} s now: "
        f"**{old_s / new_s:.2f}x**",
        f"- same layout and mean iteration time for every strategy: {'yes' if same else 'NO'}",
        "",
        f"| strategy | layout | mean iteration (s) | search, {args.against} (s) | search, now (s) | speedup | same |",
        "|---|---|---:|---:|---:|---:|---|",
        *rows,
    ], same)


def _plannings_report(args, commit: str, old: list[dict], new: list[dict]) -> int:
    """The `--plannings` report: each planning's layout, result and time on both sides."""
    rows, same = [], len(old) == len(new)
    for was, now in zip(old, new):
        agrees = was["layout"] == now["layout"] and was["result"] == now["result"]
        same &= agrees
        result = f"{now['result']:.3f}" if isinstance(now["result"], float) else now["result"]
        rows.append(f"| {now['layout']} | {result} | {was['s']:.1f} | {now['s']:.1f} | {was['s'] / now['s']:.2f}x | "
                    f"{'yes' if agrees else 'NO: ' + str(was['result'])} |")
    old_s, new_s = sum(p["s"] for p in old), sum(p["s"] for p in new)
    return _report(args.out, [
        f"# {args.strategies}'s first {args.plannings} plannings: this tree against {args.against}",
        "",
        f"`python benchmarks/search_speed.py --against {args.against} --strategies {args.strategies} "
        f"--plannings {args.plannings} --model {args.model} --workload {args.workload} --gpus {args.gpus} "
        f"--context-length {args.context_length} --global-batch-size {args.global_batch_size}"
        f"{' --side-by-side' if args.side_by_side else ''}` at commit {commit}, on a machine with {os.cpu_count()} "
        f"cores; the sides ran {'at once, one core each' if args.side_by_side else 'one after the other'}. The "
        f"search's screening of the first batch, in its own order, stopped after {args.plannings} plannings; each "
        "planning's time includes its simulation. CP-SAT stopped at "
        f"{args.solver_deterministic_limit} deterministic units.",
        "",
        f"- plannings' time: {old_s:.1f} s with {args.against}, {new_s:.1f} s now: **{old_s / new_s:.2f}x**",
        f"- same layouts in the same order, same first-batch times and rejections: {'yes' if same else 'NO'}",
        "",
        f"| layout | first-batch time (s) or rejection | {args.against} (s) | now (s) | speedup | same |",
        "|---|---:|---:|---:|---:|---|",
        *rows,
    ], same)


def _report(out: str, lines: list[str], same: bool) -> int:
    """Write the report to `out` and print it; the exit status says whether the sides agree."""
    text = "\n".join(lines + [""])
    Path(out).write_text(text)
    print(text)
    return 0 if same else 1


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
    parser.add_argument("--against", metavar="REV", help="compare this tree's search with git revision REV's")
    parser.add_argument("--strategies", default="all", help="with --against: the strategies compared")
    parser.add_argument("--side-by-side", action="store_true", help="with --against: run both sides at once")
    parser.add_argument("--plannings", type=int, default=0,
                        help="with --against and one strategy: time only the first N plannings of its screening")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.out = args.out or str(ROOT / "benchmarks" / "results" /
                               ("search_against.md" if args.against else "search_speed.md"))
    if args.plannings and (not args.against or "," in args.strategies or args.strategies == "all"):
        parser.error("--plannings needs --against and one strategy (--strategies NAME)")
    # The workloads hold documents longer than the context: cut at it, each piece a sample of its
    # own (the paper's setting).
    sampler = GlobalBatchSampler(load_lengths(args.workload, seed=0), args.context_length, args.global_batch_size,
                                 seed=0, long_documents="split")
    batches = [sampler.next_batch().lengths for _ in range(args.steps)]
    if args.against:
        return against(args, batches)
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
    return _report(args.out, [
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
    ], same)


if __name__ == "__main__":
    sys.exit(main())
