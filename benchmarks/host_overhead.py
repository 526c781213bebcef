"""Host work per training step at the 70B 128K plan shape, against the simulated H100 step.

    python benchmarks/host_overhead.py [--plan plan.json] [--save-plan plan.json] [--device cpu|cuda]

The plan: one global batch of 1024 x 128K tokens of Wikipedia documents (about 133,000
documents), llama-70b on 128 H100s in SlimPack's layout for that cell of the paper grid
(tp4 pp8 dp4, selective recompute), planned by the project's planner with the analytic H100 cost
model (20-90 s on the shared 2-core VM; `--plan` loads a saved one). Without the shipped
lengths (../shared/data/wikipedia_lengths.txt) the `longtail` generator stands in. The simulated
step is the project's DAG simulator on the same plan and cost model.

Every rank of a data-parallel replica does the same host work whatever its pipeline stage or
tensor rank, so the figures are per data-parallel rank, over the replica plans it runs (its
DP-Merge groups, then its own):

  checks      the plan's digest (compared over the ranks every step: one 16-byte all_gather,
              not timed here) and the stage-order deadlock check, which runs once per plan:
              "new plan" is a step whose plan this rank has not checked yet (every training
              step: each global batch has its own plan), "same plan" a step that reruns one;
  layouts     the DP-Merge layouts (which rank holds which token) of its merge groups' MicroPacks;
  batches     every MicroPack's model inputs: tokens, labels, loss mask, positions, boundaries
              (`build_batch`; `build_cp_batch` for a merge group's MicroPacks, layouts included).

The step's host time is the slowest rank's (the others wait for it in the first transfer), and
is printed as a share of the simulated step: the bound is 5%. The token source reads ids from
an int32 buffer and widens them to int64, as megatron's indexed dataset does. `--device cuda`
builds the batches in pinned memory and copies them non_blocking (host time only: the copies
run on the stream). Each figure is the fastest of `--repeats` runs (the machine may be shared).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

ROOT = Path(__file__).resolve().parents[1]
WIKIPEDIA = ROOT.parent / "shared" / "data" / "wikipedia_lengths.txt"
BOUND = 0.05


class BufferCorpus:
    """Token ids of every sample from one shared random int32 buffer (sample s starts at a
    pseudo-random offset), clipped at the sample's end, widened to int64 per read."""

    def __init__(self, lengths: dict[int, int], vocab: int = 128256, size: int = 1 << 23, seed: int = 0):
        self.lengths = lengths
        self.buffer = np.random.default_rng(seed).integers(0, vocab, size=size + max(lengths.values()) + 1,
                                                           dtype=np.int32)
        self.size = size

    def tokens(self, sample_id: int, start: int, end: int) -> np.ndarray:
        at = (sample_id * 2654435761) % self.size
        return self.buffer[at + start:at + min(end + 1, self.lengths[sample_id])].astype(np.int64)


def make_plan(args):
    from megatron_slimpack import CostModel, GlobalBatchSampler, ParallelConfig, Plan, SlimPackConfig, load_lengths
    from megatron_slimpack import plan as plan_batch

    cost = CostModel.analytic(args.model, args.hardware)
    if args.plan:
        return Plan.from_json(args.plan), cost, 0.0
    workload = args.workload or (f"file:{WIKIPEDIA}" if WIKIPEDIA.exists() else "longtail")
    # Wikipedia and longtail hold documents longer than the context: cut at it (the paper's setting).
    sampler = GlobalBatchSampler(load_lengths(workload), args.context, args.global_batch_size, seed=args.seed,
                                 long_documents="split")
    batch = sampler.next_batch()
    parallel = ParallelConfig(dp=args.dp, pp=args.pp, tp=args.tp, recompute=args.recompute)
    started = time.perf_counter()
    plan = plan_batch(batch.lengths, parallel=parallel, cost=cost, sources=batch.sources,
                      config=SlimPackConfig(strategy="slimpack", context_length=args.context))
    planning_s = time.perf_counter() - started
    if args.save_plan:
        plan.to_json(args.save_plan)
    return plan, cost, planning_s


def timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    out = fn()
    return (time.perf_counter() - started) * 1e3, out


def rank_host_work(plan, dp_rank: int, source, device: str) -> dict:
    """ms of each kind of host work of one data-parallel rank's step."""
    from megatron_slimpack.runtime import KVStore, build_batch
    from megatron_slimpack.runtime.attention.context_parallel import build_cp_batch, build_layout
    from megatron_slimpack.runtime.pipeline import schedule

    merged, own = schedule._pick_replicas(plan, dp_rank)
    replicas = merged + [own]
    groups = _one_process_groups()(dp_rank=dp_rank, merge_groups={}, stages=len(own.stage_orders))
    schedule._checked_plans.clear()

    def checks():
        schedule._check_replicas(plan, replicas, groups, True)

    new_plan_ms, _ = timed(checks)
    same_plan_ms, _ = timed(checks)
    store = KVStore()

    def layouts():
        for replica in merged:
            k, rank = len(replica.dp_ranks), replica.dp_ranks.index(dp_rank)
            for mp in replica.micropacks:
                build_layout(mp, None, k, rank, device)

    layout_ms, _ = timed(layouts)

    def batches():
        for replica in merged:
            k, rank = len(replica.dp_ranks), replica.dp_ranks.index(dp_rank)
            for mp in replica.micropacks:
                build_cp_batch(mp, source, store, group=None, group_size=k, group_rank=rank, device=device)
        for mp in own.micropacks:
            build_batch(mp, source, store, device)

    batch_ms, _ = timed(batches)
    return {"micropacks": sum(len(r.micropacks) for r in replicas),
            "slices": sum(len(mp.slices) for r in replicas for mp in r.micropacks),
            "tokens": sum(r.num_tokens for r in replicas), "new_plan_ms": new_plan_ms,
            "same_plan_ms": same_plan_ms, "layout_ms": layout_ms, "batch_ms": batch_ms}


def _one_process_groups():
    """`ScheduleGroups` of one rank of a `stages`-stage pipeline, without process groups: the
    host work is timed in one process (where the digest exchange is a no-op)."""
    from megatron_slimpack.runtime.pipeline.schedule import ScheduleGroups

    @dataclass
    class OneProcess(ScheduleGroups):
        stages: int = 1

        @property
        def pp_size(self) -> int:
            return self.stages

    return OneProcess


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", help="a saved plan (JSON) instead of planning one")
    parser.add_argument("--save-plan", help="write the planned plan here (JSON)")
    parser.add_argument("--workload", help="length source (default: the shipped Wikipedia lengths)")
    parser.add_argument("--model", default="llama-70b")
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--global-batch-size", type=int, default=1024, help="sequences of --context tokens")
    parser.add_argument("--dp", type=int, default=4)
    parser.add_argument("--pp", type=int, default=8)
    parser.add_argument("--tp", type=int, default=4)
    parser.add_argument("--recompute", default="selective")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="where the batches go: cpu, or cuda (pinned, non_blocking)")
    parser.add_argument("--repeats", type=int, default=2, help="time each rank's work this often, keep the fastest")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from megatron_slimpack.simulator.dag import simulate

    plan, cost, planning_s = make_plan(args)
    step_s = simulate(plan, cost, detail=False).iteration_time_s
    fingerprint_ms, _ = timed(plan.fingerprint)
    source = BufferCorpus(plan.sample_lengths())
    print(f"plan: {plan.parallel.describe()}, {len(plan.samples)} samples, {plan.num_tokens} tokens, "
          f"{sum(len(r.micropacks) for r in plan.replicas)} MicroPacks, "
          f"{sum(len(mp.slices) for r in plan.replicas for mp in r.micropacks)} slices, "
          f"{sum(r.is_merge_group for r in plan.replicas)} DP-Merge groups"
          + (f" (planned in {planning_s:.1f} s)" if planning_s else ""))
    print(f"simulated step ({args.hardware}, analytic cost model): {step_s * 1e3:.0f} ms")
    print(f"for reference, Plan.fingerprint() (JSON + sha256): {fingerprint_ms:.0f} ms")
    print(f"host work per data-parallel rank, device={args.device}, one CPU thread:")
    print("| dp rank | MicroPacks | slices | tokens | checks, new plan ms | checks, same plan ms | layouts ms "
          "| batches ms (layouts incl.) | batches ms / MicroPack | host ms / step (new plan) | share of step |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for dp_rank in range(plan.parallel.dp):
        runs = []
        for _ in range(max(args.repeats, 1)):
            runs.append(rank_host_work(plan, dp_rank, source, args.device))
            if args.device.startswith("cuda"):
                torch.cuda.synchronize()
        row = {key: min(run[key] for run in runs) for key in runs[0]}
        row["step_ms"] = row["new_plan_ms"] + row["batch_ms"]
        row["steady_ms"] = row["same_plan_ms"] + row["batch_ms"]
        rows.append(row)
        print(f"| {dp_rank} | {row['micropacks']} | {row['slices']} | {row['tokens']} | {row['new_plan_ms']:.0f} "
              f"| {row['same_plan_ms']:.0f} | {row['layout_ms']:.0f} | {row['batch_ms']:.0f} "
              f"| {row['batch_ms'] / row['micropacks']:.2f} | {row['step_ms']:.0f} "
              f"| {row['step_ms'] / (step_s * 1e3):.3%} |")
    worst = max(rows, key=lambda r: r["step_ms"])
    steady = max(r["steady_ms"] for r in rows)
    share, steady_share = worst["step_ms"] / (step_s * 1e3), steady / (step_s * 1e3)
    per_mp = worst["step_ms"] / worst["micropacks"]
    print(f"host ms/step (slowest rank, new plan): {worst['step_ms']:.0f} ms = {share:.3%} of the simulated step "
          f"({per_mp:.2f} ms per MicroPack); same plan rerun: {steady:.0f} ms = {steady_share:.3%}")
    print(f"bound {BOUND:.0%}: {'within' if share < BOUND else 'EXCEEDED'}")


if __name__ == "__main__":
    main()
