"""The paper-scale comparison: every cell of configs/bench/paper.yaml simulated with
`slimpack compare` machinery — each strategy in its best memory-feasible layout for the cell's
GPUs, the same cost model and simulator — over consecutive global batches.

Cells are merged into benchmarks/results/paper_table.json (a cell run again replaces its old
figures; each row records the commit it ran at), which is rendered to paper_table.md (mean
iteration time, spread over the batches, speedup over megatron-fixed and, where it was run, over
megatron-stock, chosen layout) and paper_speedup.png after every finished cell, so a long grid run
keeps what it finished.

megatron-stock (stock `pretrain_gpt.py`: attention across the documents of a sequence) trains a
different semantic: it is a reference column, never "the fastest other strategy".

    python benchmarks/paper_table.py --jobs 2              # the whole grid (many hours on 2 cores)
    python benchmarks/paper_table.py --models llama-7b --contexts 262144 --gpus 128 \
        --datasets wikipedia --steps 10 --strategies megatron-fixed,slimpipe,wlb-llm,slimpack
    python benchmarks/paper_table.py --contexts 262144 --gpus 128 --strategies megatron-stock \
        --commit "$(git rev-parse --short HEAD)+stock"   # one column added to cells run before
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megatron_slimpack.apps.comparison import REFERENCE, STOCK, competitors, run_comparison  # noqa: E402
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


def cell_batches(bench: dict, context: int, dataset: str, steps: int, seed: int) -> list[list[int]]:
    """The cell's consecutive global batches (document lengths), the same for every strategy."""
    batch_size = bench["global_batch_size"][context]
    # The grid's corpora hold documents longer than its contexts: cut at the context, each piece a
    # sample of its own (the paper's setting, and what Megatron's fixed-length packing does to them).
    sampler = GlobalBatchSampler(load_lengths(bench["workloads"][dataset], seed=seed), context, batch_size, seed=seed,
                                 long_documents="split")
    return [sampler.next_batch().lengths for _ in range(steps)]


def row_of(layout) -> dict:
    """A strategy's figures in a cell, from its `LayoutResult`."""
    times = layout.best.iteration_times_s
    return {
        "layout": layout.parallel.describe(), "mean_s": layout.mean_iteration_time_s,
        "min_s": min(times), "max_s": max(times), "stdev_s": statistics.pstdev(times),
        "bubble": statistics.mean(r.bubble_ratio for r in layout.reports),
        "peak_gib": layout.best.peak_memory_bytes / 2**30,
        "lower_bound_s": statistics.mean(r.lower_bound_s for r in layout.reports),
    }


def run_cell(bench: dict, model: str, context: int, cluster: str, dataset: str, strategies: str, steps: int,
             seed: int) -> dict:
    gpus, hardware = bench["cluster_gpus"][cluster]
    preset = bench["model_presets"][model]
    cost = CostModel.analytic(preset, hardware)
    batch_size = bench["global_batch_size"][context]
    batches = cell_batches(bench, context, dataset, steps, seed)
    started = time.perf_counter()
    result = run_comparison(workload=bench["workloads"][dataset], model=preset, hardware=hardware, cost=cost, gpus=gpus,
                            context_length=context, global_batch_size=batch_size, steps=steps, strategies=strategies,
                            seed=seed, show_progress=True, batches=batches)
    cell = {"model": model, "context": context, "gpus": gpus, "dataset": dataset, "steps": steps,
            "seconds": time.perf_counter() - started, "strategies": {}, "failures": result.failures}
    for name, layout in result.results.items():
        cell["strategies"][name] = row_of(layout)
    set_speedups(cell)
    return cell


def set_speedups(cell: dict) -> None:
    """Each strategy's speedup over the cell's megatron-fixed (`speedup`) and over its
    megatron-stock (`speedup_vs_stock`); None where the cell has no such row."""
    reference, stock = cell["strategies"].get(REFERENCE), cell["strategies"].get(STOCK)
    for figures in cell["strategies"].values():
        figures["speedup"] = reference["mean_s"] / figures["mean_s"] if reference else None
        figures["speedup_vs_stock"] = stock["mean_s"] / figures["mean_s"] if stock else None


def cell_key(cell: dict) -> tuple:
    return cell["model"], cell["context"], cell["gpus"], cell["dataset"]


def merge_cells(old: list[dict], new: list[dict], order: list[tuple]) -> list[dict]:
    """Old cells updated with the new ones, strategy by strategy (a cell re-run for some
    strategies keeps the others' rows; speedups are recomputed against the cell's reference), in
    the config's grid order (keys outside it last)."""
    merged = {cell_key(cell): cell for cell in old}
    for cell in new:
        previous = merged.get(cell_key(cell))
        if previous and previous["steps"] == cell["steps"]:
            strategies = {**previous["strategies"], **cell["strategies"]}
            failures = {n: r for n, r in previous["failures"].items() if n not in cell["strategies"]}
            cell = {**previous, **cell, "strategies": strategies, "failures": {**failures, **cell["failures"]}}
        for name in cell["strategies"]:
            cell["failures"].pop(name, None)
        set_speedups(cell)
        merged[cell_key(cell)] = cell
    rank = {key: index for index, key in enumerate(order)}
    return sorted(merged.values(), key=lambda cell: (rank.get(cell_key(cell), len(rank)), cell_key(cell)))


def header(cells: list[dict], grid_size: int) -> str:
    steps = sorted({cell["steps"] for cell in cells})
    gpus = sorted({cell["gpus"] for cell in cells})
    return (f"Simulated paper grid: {len(cells)} of the config's {grid_size} cells, {'/'.join(map(str, steps))} "
            f"consecutive global batches per cell on {'/'.join(map(str, gpus))} H100s (analytic H100 cost model), "
            "each strategy in its best memory-feasible layout found by the same search, same simulator; the "
            "commit each row ran at is in the last column (`python benchmarks/paper_table.py --cells "
            "model/context/gpus/dataset,... --steps 10 --strategies megatron-fixed,slimpipe,wlb-llm,slimpack`).\n\n"
            "Mean iteration time = simulated time of all the cell's plans divided by its batches; for wlb-llm this "
            "includes the final flush of the documents it still delays, which the min-max spread over the batch "
            "plans does not (so its mean can lie above its max).\n\n")


def render(cells: list[dict], order: list[tuple]) -> str:
    """paper_table.md: how it was made, the grid at a glance, then every strategy of every cell."""
    text = (header(cells, len(order))
            + "SlimPack's speedup over megatron-fixed / over the fastest other strategy, per cell:\n\n"
            + summary(cells, order) + "\n")
    if any(STOCK in cell["strategies"] or STOCK in cell["failures"] for cell in cells):
        text += (f"SlimPack's speedup over megatron-fixed (per-document attention) / over {STOCK} (stock "
                 "`pretrain_gpt.py` without `--reset-attention-mask`: each fixed-length sequence attends causally "
                 "across its document boundaries, a different training semantic, so a reference and never the "
                 "fastest other strategy above), per cell where it was run; the second is what a user switching "
                 "from stock Megatron-LM would see (a row whose commit reads `<commit>+stock` ran the "
                 f"{STOCK} code on top of that commit, before it was committed):\n\n"
                 + summary(cells, order, versus=STOCK) + "\n")
    return text + markdown(cells)


def grid_order(bench: dict) -> list[tuple]:
    """Every cell of the config as (model, context, gpus, dataset), in the table's order."""
    return [(model, context, bench["cluster_gpus"][cluster][0], dataset) for model in bench["models"]
            for context in bench["context_lengths"] for cluster in bench["clusters"] for dataset in bench["datasets"]]


def summary(cells: list[dict], order: list[tuple], strategy: str = "slimpack", versus: str | None = None) -> str:
    """The grid at a glance: one row per (model, context), one column per (GPUs, dataset); each
    entry is `strategy`'s speedup over megatron-fixed, then over the fastest other strategy
    (`competitors`: its variants and megatron-stock left out), or why there is none. `versus`
    (megatron-stock): the second figure is over that strategy instead ("not run" where the cell
    has no row of it)."""
    columns = list(dict.fromkeys((gpus, dataset) for _, _, gpus, dataset in order))
    rows = list(dict.fromkeys((model, context) for model, context, _, _ in order))
    by_key = {cell_key(cell): cell for cell in cells}
    lines = ["| model | context | " + " | ".join(f"{dataset}, {gpus} GPUs" for gpus, dataset in columns) + " |",
             "|---|---:|" + "---:|" * len(columns)]
    for model, context in rows:
        entries = [_summary_entry(by_key.get((model, context, gpus, dataset)), strategy, versus)
                   for gpus, dataset in columns]
        lines.append(f"| {model} | {context // 1024}K | " + " | ".join(entries) + " |")
    return "\n".join(lines) + "\n"


def _summary_entry(cell: dict | None, strategy: str, versus: str | None = None) -> str:
    if cell is None:
        return "not run"
    if versus is not None and versus not in cell["strategies"]:
        return "no feasible layout" if versus in cell["failures"] else "not run"
    mine = cell["strategies"].get(strategy)
    if mine is None:
        return "no feasible layout" if strategy in cell["failures"] else "not run"
    over_reference = f"{mine['speedup']:.2f}x" if mine["speedup"] else "-"
    if versus is not None:
        return f"{over_reference} / {cell['strategies'][versus]['mean_s'] / mine['mean_s']:.2f}x"
    others = [cell["strategies"][name]["mean_s"] for name in competitors(cell["strategies"], strategy)]
    return f"{over_reference} / {min(others) / mine['mean_s']:.2f}x" if others else over_reference


def markdown(cells: list[dict]) -> str:
    lines = ["| model | context | GPUs | dataset | strategy | layout | iteration s (mean) | spread (min-max) "
             f"| speedup vs megatron-fixed | speedup vs {STOCK} | bubble | / lower bound | peak GiB | commit |",
             "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for cell in cells:
        where = f"| {cell['model']} | {cell['context'] // 1024}K | {cell['gpus']} | {cell['dataset']}"
        for name, f in cell["strategies"].items():
            speedup = f"{f['speedup']:.2f}x" if f["speedup"] else "-"
            over_stock = f"{f['speedup_vs_stock']:.2f}x" if f.get("speedup_vs_stock") else "-"
            lines.append(
                f"{where} | {name} | {f['layout']} | {f['mean_s']:.2f} | {f['min_s']:.2f}-{f['max_s']:.2f} "
                f"| {speedup} | {over_stock} | {100 * f['bubble']:.1f}% | {f['mean_s'] / f['lower_bound_s']:.3f} "
                f"| {f['peak_gib']:.1f} | {f.get('commit') or cell.get('commit') or '-'} |")
        for name, reason in cell["failures"].items():
            lines.append(f"{where} | {name} | no feasible layout: {reason} |" + " |" * 8)
    return "\n".join(lines) + "\n"


def plot(cells: list[dict], path: Path) -> None:
    """One bar chart per model: each strategy's speedup over megatron-fixed in every cell run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(c["model"] for c in cells))
    names = sorted({n for c in cells for n in c["strategies"]})
    width = 0.8 / max(len(names), 1)
    widest = max(sum(c["model"] == m for c in cells) for m in models)
    figure, axes = plt.subplots(len(models), 1, figsize=(max(6, 1.1 * widest + 2), 3.2 * len(models)), squeeze=False)
    for axis, model in zip(axes[:, 0], models):
        mine = [c for c in cells if c["model"] == model]
        for i, name in enumerate(names):
            values = [c["strategies"].get(name, {}).get("speedup") or 0 for c in mine]
            axis.bar([x + i * width for x in range(len(mine))], values, width, label=name)
        axis.axhline(1.0, color="black", linewidth=0.8)
        labels = [f"{c['context'] // 1024}K/{c['gpus']}\n{c['dataset']}" for c in mine]
        axis.set_xticks([x + width * (len(names) - 1) / 2 for x in range(len(mine))], labels, fontsize=7)
        axis.set_xlim(-0.5, widest - 0.2)  # the same bar width in every row
        axis.set_title(model, fontsize=9)
        axis.set_ylabel("speedup over\nmegatron-fixed", fontsize=8)
    axes[0, 0].legend(fontsize=7, ncol=len(names))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def current_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _parse_cell(text: str, bench: dict) -> tuple[str, int, str, str]:
    """'llama-7b/262144/128/wikipedia' -> (model, context, cluster name, dataset)."""
    try:
        model, context, gpus, dataset = text.strip().split("/")
        cluster = next(c for c in bench["clusters"] if bench["cluster_gpus"][c][0] == int(gpus))
        context = int(context)
    except (ValueError, StopIteration):
        raise SystemExit(f"--cells: cannot read {text!r}; write model/context/gpus/dataset with a GPU count of one "
                         f"of the config's clusters, e.g. llama-7b/262144/128/wikipedia") from None
    if model not in bench["models"] or context not in bench["context_lengths"] or dataset not in bench["datasets"]:
        raise SystemExit(f"--cells: {text!r} is not in the config's grid (models {bench['models']}, contexts "
                         f"{bench['context_lengths']}, datasets {bench['datasets']})")
    return model, context, cluster, dataset


def _run_cell_job(job: tuple) -> dict:
    bench, model, context, cluster, dataset, strategies, steps, seed = job
    print(f"[paper] {model} {context} {cluster} {dataset}", file=sys.stderr, flush=True)
    return run_cell(bench, model, context, cluster, dataset, strategies, steps, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench" / "paper.yaml"))
    parser.add_argument("--models", help="comma-separated subset of the config's models")
    parser.add_argument("--contexts", help="comma-separated subset of context lengths")
    parser.add_argument("--gpus", help="comma-separated subset of GPU counts")
    parser.add_argument("--datasets", help="comma-separated subset of datasets")
    parser.add_argument("--cells", help="explicit cells, run in this order: model/context/gpus/dataset,... "
                        "(instead of the cross product of the subsets above)")
    parser.add_argument("--strategies", default="all")
    parser.add_argument("--steps", type=int, default=10, help="consecutive global batches per cell")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="cells planned at once, one process each")
    parser.add_argument("--fresh", action="store_true", help="start a new table instead of merging into --out")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "paper_table.md"))
    parser.add_argument("--commit", help="what each new row records as its commit (default: git rev-parse --short "
                        "HEAD; say so where the code run is not that commit, e.g. 'abc1234+stock')")
    args = parser.parse_args()
    bench = load_config(Path(args.config))

    def pick(values, text, cast=str):
        return [v for v in values if text is None or cast(v) in [cast(t) for t in text.split(",")]]

    clusters = [c for c in bench["clusters"]
                if args.gpus is None or str(bench["cluster_gpus"][c][0]) in args.gpus.split(",")]
    order = grid_order(bench)
    cells_wanted = [(model, context, cluster, dataset)
                    for model in pick(bench["models"], args.models)
                    for context in pick(bench["context_lengths"], args.contexts, int)
                    for cluster in clusters
                    for dataset in pick(bench["datasets"], args.datasets)]
    if args.cells:
        cells_wanted = [_parse_cell(text, bench) for text in args.cells.split(",")]
    jobs = [(bench, *cell, args.strategies, args.steps, args.seed) for cell in cells_wanted]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    saved = out.with_suffix(".json")
    cells = [] if args.fresh or not saved.exists() else json.loads(saved.read_text())
    commit = args.commit or current_commit()
    with multiprocessing.Pool(max(1, min(args.jobs, len(jobs)))) as pool:
        for cell in pool.imap_unordered(_run_cell_job, jobs):
            for figures in cell["strategies"].values():
                figures["commit"] = commit
            cells = merge_cells(cells, [cell], order)
            # Written after every cell: a long grid run keeps what it finished.
            out.write_text(render(cells, order))
            saved.write_text(json.dumps(cells, indent=1))
            plot(cells, out.with_name("paper_speedup.png"))
    print(render(cells, order))


if __name__ == "__main__":
    main()
