"""What each part of SlimPack is worth, holding the layout fixed.

For each cell (Wikipedia lengths, 128 H100s, the analytic cost model and the simulator of the
grid), the first `--batches` global batches are planned and simulated:
  - slimpack, slimpack-sym (no asymmetric units), slimpack-nomerge (no DP-Merge: SlimPack's cp K
    becomes K times the replicas) and "no slicing" (slimpack with `slice_tokens` = the context:
    no document is cut unless a MicroPack cannot hold it), all in the layout the grid recorded
    for SlimPack;
  - megatron-fixed in the layout the grid recorded for it.
Each variant in its own best layout is the grid's job (`benchmarks/paper_table.py`), not this
script's: here only the part changes.

    python benchmarks/ablation.py [--batches 3] > benchmarks/results/ablation.md
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import paper_table  # noqa: E402
from grid_plans_moved import layout_of  # noqa: E402

import megatron_slimpack as ms  # noqa: E402
from megatron_slimpack.workload import GlobalBatchSampler, load_lengths  # noqa: E402

CELLS = [(model, context) for model in ("llama-13b", "llama-70b", "llama-150b") for context in (256, 128)]
VARIANTS = ("slimpack", "slimpack-sym", "slimpack-nomerge", "no slicing", "megatron-fixed")


def variant_setup(variant: str, recorded: dict, context: int) -> tuple[str, dict, dict]:
    """(strategy, ParallelConfig keywords, extra SlimPackConfig keywords) of one variant."""
    if variant == "megatron-fixed":
        return variant, layout_of(recorded["megatron-fixed"]["layout"]), {}
    layout = layout_of(recorded["slimpack"]["layout"])
    if variant == "slimpack-nomerge":
        return variant, dict(layout, cp=1, dp=layout["dp"] * layout["cp"]), {}
    if variant == "no slicing":
        return "slimpack", layout, {"slice_tokens": context}
    return variant, layout, {}


def run_variant(variant, recorded, context, batches, cost) -> dict:
    strategy, layout, extra = variant_setup(variant, recorded, context)
    config = ms.SlimPackConfig(strategy=strategy, context_length=context, solver_time_limit_s=120.0,
                               solver_deterministic_limit=0.5, **extra)
    parallel = ms.ParallelConfig(**layout)
    times, bounds, fits = [], [], True
    for batch in batches:
        try:
            plan = ms.plan(batch.lengths, parallel=parallel, cost=cost, config=config, sources=batch.sources)
        except Exception as error:  # the variant cannot plan this batch in this layout (memory)
            return {"layout": parallel.describe(), "error": f"{type(error).__name__}: {str(error).splitlines()[0]}"}
        report = ms.simulate(plan, cost)
        times.append(report.iteration_time_s)
        bounds.append(report.lower_bound_s)
        fits = fits and report.fits_memory
    return {"layout": parallel.describe(), "mean_s": statistics.mean(times), "bound_s": statistics.mean(bounds),
            "fits": fits}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    bench = paper_table.load_config(HERE.parent / "configs" / "bench" / "paper.yaml")
    table = {(c["model"], c["context"] // 1024, c["gpus"], c["dataset"]): c
             for c in json.loads((HERE / "results" / "paper_table.json").read_text())}
    cluster = next(name for name, (gpus, _) in bench["cluster_gpus"].items() if gpus == 128)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    print(f"# Ablation: what each part of SlimPack is worth (commit {commit})\n")
    print(__doc__.split("\n\n")[1] + "\n")
    print(f"{args.batches} global batches per cell (sampler seed 0), mean simulated iteration time; ratios "
          "against `slimpack` in the same layout (> 1: slower without the part).\n")
    print("| model | context | " + " | ".join(VARIANTS) + " |")
    print("|---|---:|" + "---:|" * len(VARIANTS))
    results = {}
    for model, context_k in CELLS:
        recorded = table[(model, context_k, 128, "wikipedia")]["strategies"]
        context = context_k * 1024
        _, hardware = bench["cluster_gpus"][cluster]
        cost = ms.CostModel.analytic(bench["model_presets"][model], hardware)
        # Wikipedia holds documents longer than every grid context: cut at it, each piece a sample
        # of its own (the paper's setting).
        sampler = GlobalBatchSampler(load_lengths(bench["workloads"]["wikipedia"], seed=0), context,
                                     bench["global_batch_size"][context], seed=0, long_documents="split")
        batches = [sampler.next_batch() for _ in range(args.batches)]
        row = {variant: run_variant(variant, recorded, context, batches, cost) for variant in VARIANTS}
        results[f"{model}-{context_k}K"] = row
        base = row["slimpack"].get("mean_s")
        cells = []
        for variant in VARIANTS:
            figures = row[variant]
            if "error" in figures:
                cells.append(f"does not plan ({figures['layout']})")
                continue
            ratio = f" = {figures['mean_s'] / base:.3f}x" if base and variant != "slimpack" else ""
            memory = "" if figures["fits"] else ", over memory"
            cells.append(f"{figures['mean_s']:.1f} s{ratio} ({figures['layout']}{memory})")
        print(f"| {model} | {context_k}K | " + " | ".join(cells) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
