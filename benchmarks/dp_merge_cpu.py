"""DP-Merge, measured on CPU and simulated: `slimpack` (merge groups on) vs `slimpack-nomerge`.

Measured: DP=2 (two gloo processes x 1 thread, tiny model, real text tokens), one global batch
made of one long document (the first `--outlier` tokens of the longest stdlib *.py file, the
piece the sampler would cut at that context length) plus short documents (random stdlib files of
at most `--max-short` tokens) filling the other replica's share. Both plans run in the same
processes, alternating, median of `--repeats` timed steps after one warm-up each.

Simulated (profiled CPU cost model): the same comparison while the outlier's share of the batch
grows, to show where merging stops paying.

    .venv/bin/python benchmarks/dp_merge_cpu.py [--outlier 8192] [--repeats 3]

Writes benchmarks/results/dp_merge_cpu.md.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STRATEGIES = ("slimpack", "slimpack-nomerge")


def outlier_batch(corpus, outlier: int, short_tokens: int, max_short: int, seed: int):
    """A GlobalBatch: one `outlier`-token piece of the longest file + short files up to `short_tokens`."""
    from megatron_slimpack.workload import GlobalBatch

    longest = int(corpus.lengths.argmax())
    if corpus.lengths[longest] < outlier:
        raise SystemExit(f"no text file has {outlier} tokens (longest: {corpus.lengths[longest]}); lower --outlier")
    rng = random.Random(seed)
    candidates = [i for i, n in enumerate(corpus.lengths) if n <= max_short and i != longest]
    rng.shuffle(candidates)
    lengths, sources, total = [outlier], [(longest, 0)], 0
    for document in candidates:
        n = int(corpus.lengths[document])
        if total + n > short_tokens:
            continue
        lengths.append(n)
        sources.append((document, 0))
        total += n
    return GlobalBatch(step=0, lengths=lengths, sample_ids=list(range(len(lengths))), sources=sources, stats=None)


def plan_both(lengths, cost, context_length: int, dp: int, pp: int = 1, forced_threshold: float | None = None):
    """Plans of both strategies; with `forced_threshold`, also "forced": slimpack with that
    (lower) merge threshold, i.e. merging where the default planner would not."""
    from megatron_slimpack.config import SlimPackConfig
    from megatron_slimpack.planner.strategies import plan_global_batch
    from megatron_slimpack.specs import ParallelConfig

    parallel = ParallelConfig(dp=dp, pp=pp, tp=1, sequence_parallel=False, zero1=False)
    configs = {name: SlimPackConfig(strategy=name, context_length=context_length) for name in STRATEGIES}
    if forced_threshold is not None:
        configs["forced"] = SlimPackConfig(context_length=context_length, merge_threshold=forced_threshold)
    return {name: plan_global_batch(lengths, parallel=parallel, cost=cost, config=config)
            for name, config in configs.items()}


def simulated_sweep(cost, context_length: int, dp: int, pp: int, short: int = 256) -> list[dict]:
    """Outlier share of the batch's tokens vs the simulated gain of merging."""
    from megatron_slimpack.simulator.dag import simulate

    rows = []
    total = dp * context_length
    for share in (0.05, 0.1, 0.2, 0.3, 0.4, 0.5):
        outlier = min(context_length, int(share * total))
        if rows and rows[-1]["outlier"] == outlier:  # capped at the context length
            continue
        lengths = [outlier] + [short] * ((total - outlier) // short)
        plans = plan_both(lengths, cost, context_length, dp, pp, forced_threshold=0.3)
        times = {name: simulate(plan, cost, detail=False).iteration_time_s for name, plan in plans.items()}
        sizes = {name: [len(r.dp_ranks) for r in plan.replicas if r.is_merge_group] for name, plan in plans.items()}
        rows.append({"dp": dp, "pp": pp, "share": outlier / sum(lengths), "outlier": outlier,
                     "merge": sizes["slimpack"], "forced_merge": sizes["forced"],
                     "gain": times["slimpack-nomerge"] / times["slimpack"],
                     "forced_gain": times["slimpack-nomerge"] / times["forced"], **times})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outlier", type=int, default=8192, help="tokens of the long document (= context length)")
    parser.add_argument("--max-short", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", default=str(ROOT / "benchmarks/results/profile_cpu_tiny.json"))
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/dp_merge_cpu.md"))
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)
    from megatron_slimpack.apps.fidelity import measure_plans
    from megatron_slimpack.costmodel import CostModel
    from megatron_slimpack.simulator.dag import simulate
    from megatron_slimpack.workload import TextCorpus

    cost = CostModel.from_profile(args.profile)
    corpus = TextCorpus()
    batch = outlier_batch(corpus, args.outlier, args.outlier, args.max_short, args.seed)
    plans = plan_both(batch.lengths, cost, args.outlier, dp=2)
    names = list(plans)
    began = time.perf_counter()
    steps = measure_plans([plans[n] for n in names], cost.model, batches=[batch] * len(names),
                          repeats=args.repeats, warmup=1)
    wall = time.perf_counter() - began
    measured = {name: statistics.median(s.iteration_time_s for s in steps if s.plan_index == i)
                for i, name in enumerate(names)}
    spread = {name: [round(s.iteration_time_s, 2) for s in steps if s.plan_index == i] for i, name in enumerate(names)}
    simulated = {name: simulate(plan, cost, detail=False).iteration_time_s for name, plan in plans.items()}

    lines = [
        "# DP-Merge on CPU: `slimpack` vs `slimpack-nomerge` (DP=2, model `tiny`)", "",
        f"One global batch of real text: a {args.outlier}-token piece of the longest stdlib file plus "
        f"{len(batch.lengths) - 1} short files ({sum(batch.lengths) - args.outlier} tokens); context {args.outlier}. "
        f"Two gloo processes x 1 thread, median of {args.repeats} timed steps after 1 warm-up; "
        f"simulator: profiled cost model ({Path(args.profile).name}). Wall time {wall:.0f} s.", "",
        "| strategy | merge groups | measured (s) | steps (s) | simulated (s) |",
        "|---|---|---:|---|---:|",
    ]
    for name, plan in plans.items():
        groups = [list(r.dp_ranks) for r in plan.replicas if r.is_merge_group] or "-"
        lines.append(f"| {name} | {groups} | {measured[name]:.2f} | {spread[name]} | {simulated[name]:.2f} |")
    lines += ["", f"Measured gain of merging: **{measured['slimpack-nomerge'] / measured['slimpack']:.2f}x** "
              f"(simulated {simulated['slimpack-nomerge'] / simulated['slimpack']:.2f}x).", "",
              "## Where merging stops paying (simulated, same cost model)", "",
              f"Context {args.outlier}, one outlier + {256}-token documents filling dp x context tokens.", "",
              "`forced`: slimpack with merge_threshold 0.3 (the default is 1.25), merging the outlier even "
              "where the default planner keeps it on one replica: where its gain drops below 1, merging no "
              "longer pays.", "",
              "| dp | pp | outlier tokens | outlier share | merge group sizes | slimpack (s) | nomerge (s) | gain "
              "| forced: sizes | forced (s) | forced gain |",
              "|---:|---:|---:|---:|---|---:|---:|---:|---|---:|---:|"]
    for dp, pp in ((2, 1), (4, 1), (4, 2)):
        for row in simulated_sweep(cost, args.outlier, dp, pp):
            lines.append(f"| {row['dp']} | {row['pp']} | {row['outlier']} | {row['share']:.0%} | {row['merge'] or '-'} "
                         f"| {row['slimpack']:.2f} | {row['slimpack-nomerge']:.2f} | {row['gain']:.2f}x | "
                         f"{row['forced_merge'] or '-'} | {row['forced']:.2f} | {row['forced_gain']:.2f}x |")
    lines += ["", "Machine: 2 shared CPU cores (other jobs may run: measured figures vary between runs)."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
