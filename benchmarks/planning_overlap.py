"""Does planning slow the training loop?

A training-like loop runs on the main thread while the planner iterator plans the next global
batches beside it, three ways, over the same batches:

  no planning   the loop alone;
  thread        `PlannerIterator(backend="thread")`: planning in a thread of this process, which
                holds the GIL (the planner is mostly pure Python) against the loop;
  process       `PlannerIterator(backend="process")`: planning in a spawned worker process.

Each step is `next(iterator)` and then the same fixed work, about `--step-s` seconds alone (by
default as long as drawing and planning one batch inline), in one of three mixes:

  launch-bound  tiny torch ops only: each is Python + dispatch holding the GIL, like a GPU
                training thread that launches kernels back to back;
  gpu-like      30% tiny ops, 70% sleeping (GIL released, no CPU: the thread waits for the device);
  cpu-compute   10% tiny ops, 90% single-threaded 512x512 matmuls (GIL released, one core busy).

The planning workload: Wikipedia document lengths, llama-7b, global batch `--global-batch-size` x
`--context` tokens on dp x pp x tp GPUs (SlimPack, analytic H100 cost model), plan_ahead 1, and
next() broadcasting each plan over a one-rank gloo group, as in a Megatron run (the source rank
pays for serialising the plan: the thread backend's worker thread pickles it, the process
backend's main thread unpickles what the worker sent; `--no-distributed`: no group). For each
mix and variant: the mean step time (the first `--warmup` steps left out: the worker process starts
then) and its ratio to no planning, the planner's time per batch, what next() exposed, and the main
thread's CPU time per step.

    python benchmarks/planning_overlap.py [--steps 8] [--out benchmarks/results/planning_overlap.md]

torch is imported inside functions: the spawned worker re-imports this script and needs none of it.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from pathlib import Path

WIKIPEDIA = "file:../shared/data/wikipedia_lengths.txt"
MIXES = {"launch-bound": (1.0, 0.0, 0.0), "gpu-like": (0.3, 0.7, 0.0), "cpu-compute": (0.1, 0.0, 0.9)}


class Step:
    """The training-like work of one step on the main thread: `launches` tiny torch ops, then
    `sleep_s` seconds waiting (GIL released), then `matmuls` 512x512 matmuls."""

    def __init__(self, launches: int, sleep_s: float, matmuls: int, size: int = 512):
        import torch

        self.launches, self.sleep_s, self.matmuls = launches, sleep_s, matmuls
        self.small = torch.ones(64)
        self.a, self.b = torch.randn(size, size), torch.randn(size, size)

    def __call__(self) -> None:
        x = self.small
        for _ in range(self.launches):
            x = x * 1.0000001  # a tiny op: dispatch overhead only, like a kernel launch
        if self.sleep_s:
            time.sleep(self.sleep_s)
        for _ in range(self.matmuls):
            self.a @ self.b


def _seconds(step: Step, repeat: int = 3) -> float:
    step()
    began = time.perf_counter()
    for _ in range(repeat):
        step()
    return (time.perf_counter() - began) / repeat


def calibrate(step_s: float) -> dict[str, Step]:
    """One Step per mix, each about `step_s` seconds alone."""
    launch_s = _seconds(Step(10000, 0.0, 0)) / 10000
    matmul_s = _seconds(Step(0, 0.0, 20)) / 20
    return {name: Step(round(launch * step_s / launch_s), sleep * step_s, round(matmul * step_s / matmul_s))
            for name, (launch, sleep, matmul) in MIXES.items()}


def make_iterator(backend: str, args, lengths, steps: int):
    import megatron_slimpack as ms
    from megatron_slimpack.megatron.data import PlannerIterator, plan_function
    from megatron_slimpack.planner.strategies import new_planner
    from megatron_slimpack.workload import GlobalBatchSampler

    cost = ms.CostModel.analytic(args.model, "h100-sxm")
    parallel = ms.ParallelConfig(dp=args.dp, pp=args.pp, tp=args.tp)
    config = ms.SlimPackConfig(context_length=args.context)
    # Wikipedia holds documents longer than the context: cut at it (the paper's setting).
    sampler = GlobalBatchSampler(lengths, args.context, args.global_batch_size, seed=0, long_documents="split")
    return PlannerIterator(sampler, plan_function(new_planner("slimpack"), parallel, cost, config),
                           plan_ahead=args.plan_ahead, steps=steps, broadcast=args.distributed, backend=backend)


def run(variant: str, step: Step, args, lengths) -> dict:
    steps = args.warmup + args.steps
    times, cpu, exposed, planning, prints = [], [], [], [], []
    iterator = None if variant == "no planning" else make_iterator(variant, args, lengths, steps)
    for _ in range(steps):
        began, began_cpu = time.perf_counter(), time.thread_time()
        if iterator is not None:
            planned = next(iterator)
        step()
        times.append(time.perf_counter() - began)
        cpu.append(time.thread_time() - began_cpu)
        if iterator is not None:
            exposed.append(planned.exposed_s)
            planning.append(planned.planning_time_s)
            prints.append(planned.plan.fingerprint() if args.check_plans else None)
    backend = iterator.backend if iterator is not None else "-"
    if iterator is not None:
        iterator.close()
    kept = slice(args.warmup, None)
    mean = statistics.mean
    return {"variant": variant, "backend": backend, "step_s": mean(times[kept]),
            "step_s_median": statistics.median(times[kept]), "step_s_max": max(times[kept]),
            "cpu_s": mean(cpu[kept]), "planning_s": mean(planning[kept]) if planning else 0.0,
            "exposed_s": mean(exposed[kept]) if exposed else 0.0, "plans": prints}


def load_average() -> str:
    try:
        return " ".join(f"{value:.1f}" for value in os.getloadavg())
    except OSError:
        return "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mix and variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps (worker start-up)")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--global-batch-size", type=int, default=512)
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--model", default="llama-7b")
    parser.add_argument("--plan-ahead", type=int, default=1)
    parser.add_argument("--mixes", default=",".join(MIXES), help="comma-separated, from: " + ", ".join(MIXES))
    parser.add_argument("--step-s", type=float, default=0.0,
                        help="step time alone (default: drawing and planning one batch inline, measured)")
    parser.add_argument("--no-distributed", dest="distributed", action="store_false",
                        help="plan without a process group (default: a one-rank gloo group, so next() broadcasts "
                             "the plan as in a Megatron run)")
    parser.add_argument("--no-check-plans", dest="check_plans", action="store_false",
                        help="skip comparing the thread's and the process's plans (fingerprints)")
    parser.add_argument("--out", default="benchmarks/results/planning_overlap.md")
    args = parser.parse_args()

    import torch

    from megatron_slimpack.workload import load_lengths

    torch.set_num_threads(1)
    if args.distributed:
        import tempfile

        import torch.distributed as dist

        store = Path(tempfile.mkdtemp()) / "store"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    load_before = load_average()
    lengths = load_lengths(WIKIPEDIA)
    probe = make_iterator("thread", args, lengths, 3)
    probe.plan_ahead, probe.distributed = 0, False  # inline, no broadcast: the planner's time, with the draw
    drawn_and_planned = []
    for _ in range(3):
        began = time.perf_counter()
        planned = next(probe)
        drawn_and_planned.append(time.perf_counter() - began)
    plan_alone_s = statistics.mean(p.planning_time_s for p in probe.history[1:])
    if args.step_s <= 0:
        args.step_s = statistics.mean(drawn_and_planned[1:])
    samples = len(planned.batch.lengths)
    steps = calibrate(args.step_s)
    lines = ["| step mix | variant | mean step s | median step s | max step s | mean / no planning "
             "| median / no planning | main-thread CPU s per step | planning s per batch | exposed s per step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    identical = []
    for mix in args.mixes.split(","):
        # The loop alone before and after the planning variants: the baseline is their mean, and
        # the two rows show how much the machine drifted meanwhile.
        names = ("no planning", "thread", "process", "no planning")
        rows = [run(name, steps[mix], args, lengths) for name in names]
        base = statistics.mean(row["step_s"] for row in rows if row["variant"] == "no planning")
        base_median = statistics.mean(row["step_s_median"] for row in rows if row["variant"] == "no planning")
        identical.append(rows[1]["plans"] == rows[2]["plans"])
        for index, row in enumerate(rows):
            variant = row["variant"] + (" (again)" if index == len(rows) - 1 else "")
            if row["backend"] not in ("-", row["variant"]):  # it fell back to another backend
                variant += f" ({row['backend']})"
            lines.append(f"| {mix} | {variant} | {row['step_s']:.3f} | {row['step_s_median']:.3f} "
                         f"| {row['step_s_max']:.3f} | **{row['step_s'] / base:.2f}** "
                         f"| {row['step_s_median'] / base_median:.2f} | {row['cpu_s']:.3f} | {row['planning_s']:.3f} "
                         f"| {row['exposed_s']:.3f} |")
        print("\n".join(lines[-len(rows):]), flush=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    text = (
        f"Planning beside a training-like loop: Python {platform.python_version()}, {cores} cores, torch "
        f"{torch.__version__} with 1 thread; load average (1, 5, 15 min) {load_before} before, {load_average()} "
        f"after. Planning: Wikipedia lengths, {args.model}, global batch {args.global_batch_size} x "
        f"{args.context // 1024}K tokens ({samples} documents in the last probe batch), dp{args.dp} pp{args.pp} "
        f"tp{args.tp}, SlimPack, plan_ahead {args.plan_ahead}"
        + (", next() broadcasting each plan over a one-rank gloo group (as in a Megatron run)" if args.distributed
           else ", no process group") + f": {plan_alone_s:.2f} s to plan a batch alone, "
        f"{args.step_s:.2f} s with its draw. Each step: next() and then {args.step_s:.2f} s of work alone (mixes "
        f"in the script's docstring); ratios to the mean of the two no-planning runs of the mix. Mean over "
        f"{args.steps} steps after {args.warmup} warm-up steps, the same "
        f"batches in every variant"
        + (f" (thread and process plans identical: {all(identical)})" if args.check_plans else "") + ".\n\n"
        + "\n".join(lines) + "\n\n"
        "`planning s per batch`: the planner's wall time in the worker (the worker process pauses its own cyclic "
        "garbage collector while it plans; a thread cannot without pausing the training loop's). `exposed`: how "
        "long next() waited, the process's plan transfer (unpickling on the main thread) included. `main-thread "
        "CPU`: CPU time of the loop's thread per step (waiting for the GIL is not CPU time).\n")
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
