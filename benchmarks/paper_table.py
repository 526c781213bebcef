"""The paper-scale comparison (issue 3): every cell of configs/bench/paper.yaml simulated with
`slimpack compare` machinery — each strategy in its best memory-feasible layout for the cell's
GPUs, the same cost model and simulator — over consecutive global batches.

Writes benchmarks/results/paper_table.md (mean iteration time, spread over the batches, speedup
over megatron-fixed, chosen layout) and benchmarks/results/paper_speedup.png.

    python benchmarks/paper_table.py                       # the whole grid (hours on 2 cores)
    python benchmarks/paper_table.py --models llama-7b --contexts 262144 --gpus 128 \
        --datasets wikipedia --steps 10 --strategies megatron-fixed,wlb-llm,slimpack
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_slimpack.comparison import REFERENCE, run_comparison  # noqa: E402
from megatron_slimpack.costmodel import CostModel  # noqa: E402
from megatron_slimpack.workload import GlobalBatchSampler, load_lengths  # noqa: E402


def load_config(path: Path) -> dict:
    bench = yaml.safe_load(path.read_text())
    configs = path.parent.parent
    bench["model_presets"] = {m: yaml.safe_load((configs / "models" / f"{m}.yaml").read_text())["preset"]
                              for m in bench["models"]}
    bench["cluster_gpus"] = {}
    for name in bench["clusters"]:
        cluster = yaml.safe_load((configs / "clusters" / f"{name}.yaml").read_text())
        bench["cluster_gpus"][name] = (cluster["nodes"] * cluster["gpus_per_node"], cluster["hardware"])
    bench["workloads"] = {d: yaml.safe_load((configs / "datasets" / f"{d}.yaml").read_text())["workload"]
                          for d in bench["datasets"]}
    return bench


def run_cell(bench: dict, model: str, context: int, cluster: str, dataset: str, strategies: str, steps: int,
             seed: int) -> dict:
    gpus, hardware = bench["cluster_gpus"][cluster]
    preset = bench["model_presets"][model]
    cost = CostModel.analytic(preset, hardware)
    batch_size = bench["global_batch_size"][context]
    sampler = GlobalBatchSampler(load_lengths(bench["workloads"][dataset], seed=seed), context, batch_size, seed=seed)
    batches = [sampler.next_batch().lengths for _ in range(steps)]
    started = time.perf_counter()
    result = run_comparison(workload=bench["workloads"][dataset], model=preset, hardware=hardware, cost=cost, gpus=gpus,
                            context_length=context, global_batch_size=batch_size, steps=steps, strategies=strategies,
                            seed=seed, show_progress=True, batches=batches)
    cell = {"model": model, "context": context, "gpus": gpus, "dataset": dataset, "steps": steps,
            "seconds": time.perf_counter() - started, "strategies": {}, "failures": result.failures}
    for name, layout in result.results.items():
        times = layout.best.iteration_times_s
        cell["strategies"][name] = {
            "layout": layout.parallel.describe(), "mean_s": layout.mean_iteration_time_s,
            "min_s": min(times), "max_s": max(times), "stdev_s": statistics.pstdev(times),
            "bubble": statistics.mean(r.bubble_ratio for r in layout.reports),
            "peak_gib": layout.best.peak_memory_bytes / 2**30,
            "lower_bound_s": statistics.mean(r.lower_bound_s for r in layout.reports),
        }
    reference = cell["strategies"].get(REFERENCE)
    for figures in cell["strategies"].values():
        figures["speedup"] = reference["mean_s"] / figures["mean_s"] if reference else None
    return cell


def markdown(cells: list[dict]) -> str:
    lines = ["| model | context | GPUs | dataset | strategy | layout | iteration s (mean) | spread (min-max) "
             "| speedup vs megatron-fixed | bubble | / lower bound | peak GiB |",
             "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for cell in cells:
        for name, f in cell["strategies"].items():
            speedup = f"{f['speedup']:.2f}x" if f["speedup"] else "-"
            lines.append(
                f"| {cell['model']} | {cell['context'] // 1024}K | {cell['gpus']} | {cell['dataset']} | {name} "
                f"| {f['layout']} | {f['mean_s']:.2f} | {f['min_s']:.2f}-{f['max_s']:.2f} | {speedup} "
                f"| {100 * f['bubble']:.1f}% | {f['mean_s'] / f['lower_bound_s']:.3f} | {f['peak_gib']:.1f} |")
        for name, reason in cell["failures"].items():
            lines.append(f"| {cell['model']} | {cell['context'] // 1024}K | {cell['gpus']} | {cell['dataset']} | {name} "
                         f"| no feasible layout: {reason} | | | | | | |")
    return "\n".join(lines) + "\n"


def plot(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c['model']}\n{c['context'] // 1024}K/{c['gpus']}\n{c['dataset']}" for c in cells]
    names = sorted({n for c in cells for n in c["strategies"]})
    width = 0.8 / max(len(names), 1)
    figure, axis = plt.subplots(figsize=(max(6, 1.6 * len(cells)), 4))
    for i, name in enumerate(names):
        values = [c["strategies"].get(name, {}).get("speedup") or 0 for c in cells]
        axis.bar([x + i * width for x in range(len(cells))], values, width, label=name)
    axis.axhline(1.0, color="black", linewidth=0.8)
    axis.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(cells))], labels, fontsize=7)
    axis.set_ylabel("simulated speedup over megatron-fixed")
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench" / "paper.yaml"))
    parser.add_argument("--models", help="comma-separated subset of the config's models")
    parser.add_argument("--contexts", help="comma-separated subset of context lengths")
    parser.add_argument("--gpus", help="comma-separated subset of GPU counts")
    parser.add_argument("--datasets", help="comma-separated subset of datasets")
    parser.add_argument("--strategies", default="all")
    parser.add_argument("--steps", type=int, default=10, help="consecutive global batches per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "paper_table.md"))
    args = parser.parse_args()
    bench = load_config(Path(args.config))

    def pick(values, text, cast=str):
        return [v for v in values if text is None or cast(v) in [cast(t) for t in text.split(",")]]

    clusters = [c for c in bench["clusters"] if args.gpus is None or str(bench["cluster_gpus"][c][0]) in args.gpus.split(",")]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = (f"Simulated paper grid ({args.steps} consecutive global batches per cell, analytic H100 cost model, "
              "each strategy in its best memory-feasible layout).\n\n")
    cells = []
    for model in pick(bench["models"], args.models):
        for context in pick(bench["context_lengths"], args.contexts, int):
            for cluster in clusters:
                for dataset in pick(bench["datasets"], args.datasets):
                    print(f"[paper] {model} {context} {cluster} {dataset}", file=sys.stderr, flush=True)
                    cells.append(run_cell(bench, model, context, cluster, dataset, args.strategies, args.steps, args.seed))
                    # Written after every cell: a long grid run keeps what it finished.
                    out.write_text(header + markdown(cells))
                    out.with_suffix(".json").write_text(json.dumps(cells, indent=1))
    plot(cells, out.with_name("paper_speedup.png"))
    print(header + markdown(cells))


if __name__ == "__main__":
    main()
