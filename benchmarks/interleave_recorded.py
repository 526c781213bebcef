"""A strategy's grid rows with virtual pipeline stages, tried at the layout the grid recorded for
it (for strategies whose full layout search with vpp is too slow to run for every cell).

The grid's layout search with vpp costs SlimPack tens of CPU-minutes per 70B/150B cell, so this
script searches vpp only: for each cell, the strategy's recorded layout (tp, pp, cp, dp, recompute)
with every vpp the layout search would try there (1 included), through the same `best_layout`
(the first batch screens every vpp, interleave cascade included; the fastest on it runs all the
cell's batches). Rows are written in paper_table.json's format, and with `--merge` replace the
strategy's rows of those cells in benchmarks/results/paper_table.{json,md,png}; each records its
commit with "vpp at recorded layout", and benchmarks/results/interleaved_<strategy>.md lists every
cell: the first-batch time of each vpp, the row before and the row after.

    python benchmarks/interleave_recorded.py --strategy slimpack --cells llama-70b/131072/128/wikipedia,... \
        --jobs 2 --out /tmp/vpp/slimpack.json
    python benchmarks/interleave_recorded.py --merge /tmp/vpp/slimpack.json [more.json ...]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from grid_plans_moved import layout_of  # noqa: E402
from paper_table import (  # noqa: E402
    _parse_cell,
    cell_batches,
    cell_key,
    current_commit,
    grid_order,
    load_config,
    merge_cells,
    plot,
    render,
    row_of,
)

from megatron_slimpack.config import SlimPackConfig  # noqa: E402
from megatron_slimpack.costmodel import CostModel  # noqa: E402
from megatron_slimpack.planner.layouts import _virtual_stage_counts, best_layout  # noqa: E402
from megatron_slimpack.specs import ParallelConfig  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def run_cell(job: tuple) -> dict:
    """One strategy on one cell, vpp searched at its recorded layout; the cell in paper_table.json's
    format plus `screened` (first-batch time per layout) and `recorded` (the row it had)."""
    bench, strategy, (model, context, cluster, dataset), recorded, steps, seed, commit = job
    print(f"[vpp] {strategy} {model} {context} {cluster} {dataset}: {recorded['layout']}", file=sys.stderr,
          flush=True)
    gpus, hardware = bench["cluster_gpus"][cluster]
    cost = CostModel.analytic(bench["model_presets"][model], hardware)
    plain = ParallelConfig(**layout_of(recorded["layout"]))
    layouts = [plain.with_(vpp=vpp) for vpp in _virtual_stage_counts(cost.model.num_layers, plain.pp)]
    started = time.perf_counter()
    result = best_layout(strategy, cell_batches(bench, context, dataset, steps, seed), cost, gpus, context,
                         SlimPackConfig(), layouts=layouts, finalists=1)
    row = {**row_of(result), "commit": f"{commit} vpp at recorded layout"}
    return {"model": model, "context": context, "gpus": gpus, "dataset": dataset, "steps": steps,
            "seconds": time.perf_counter() - started, "strategies": {strategy: row}, "failures": {},
            "screened": [[p.describe(), t] for p, t in result.screened],
            "rejected": [str(r) for r in result.rejected], "recorded": recorded, "strategy": strategy}


def report(strategy: str, cells: list[dict]) -> str:
    lines = [
        f"# {strategy}'s grid rows with virtual pipeline stages at its recorded layout\n",
        f"Made by `benchmarks/interleave_recorded.py`: for each cell, {strategy}'s recorded layout with every vpp "
        "the layout search tries there, screened on the first batch by the grid's `best_layout` (interleave "
        "cascade included); the fastest on it ran all 10 batches. Not a full layout search with vpp: the other "
        "shapes (tp, pp, cp, dp, recompute) keep the plain search's choice.\n",
        "| model | context | GPUs | dataset | first batch per layout (s) | row before | s before | row after | s after "
        "| change | commit |",
        "|---|---:|---:|---|---|---|---:|---|---:|---:|---|",
    ]
    for cell in cells:
        before, now = cell["recorded"], cell["strategies"][strategy]
        screened = "; ".join(f"{layout.split()[2] if 'vpp' in layout else 'vpp1'} {seconds:.1f}"
                             for layout, seconds in sorted(cell["screened"]))
        change = 100 * (now["mean_s"] / before["mean_s"] - 1)
        lines.append(f"| {cell['model']} | {cell['context'] // 1024}K | {cell['gpus']} | {cell['dataset']} | "
                     f"{screened} | {before['layout']} | {before['mean_s']:.1f} | {now['layout']} | "
                     f"{now['mean_s']:.1f} | {change:+.1f}% | {now['commit']} |")
    rejected = [f"- {cell['model']} {cell['context'] // 1024}K {cell['dataset']}: {reason}"
                for cell in cells for reason in cell["rejected"]]
    if rejected:
        lines += ["", "Layouts not run over every batch, and why:", "", *rejected]
    return "\n".join(lines) + "\n"


def load_cells(paths: list[str]) -> list[dict]:
    cells = [cell for path in paths for cell in json.loads(Path(path).read_text())]
    for cell in cells:  # one strategy's row per cell
        cell.setdefault("strategy", next(iter(cell["strategies"])))
    return cells


def merge(paths: list[str], config: Path) -> None:
    """Merge the rows of `paths` into the grid and report them, one file per strategy."""
    order = grid_order(load_config(config))
    table = RESULTS / "paper_table.json"
    cells = load_cells(paths)
    rows = [{key: cell[key] for key in ("model", "context", "gpus", "dataset", "steps", "seconds", "strategies",
                                        "failures")} for cell in cells]
    merged = merge_cells(json.loads(table.read_text()), rows, order)
    table.write_text(json.dumps(merged, indent=1))
    (RESULTS / "paper_table.md").write_text(render(merged, order))
    plot(merged, RESULTS / "paper_speedup.png")
    rank = {key: index for index, key in enumerate(order)}
    cells.sort(key=lambda cell: rank.get(cell_key(cell), len(rank)))
    for strategy in sorted({cell["strategy"] for cell in cells}):
        path = RESULTS / f"interleaved_{strategy}.md"
        path.write_text(report(strategy, [cell for cell in cells if cell["strategy"] == strategy]))
        print(path.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench" / "paper.yaml"))
    parser.add_argument("--strategy", default="slimpack", help="whose recorded layout and row (slimpack, wlb-llm)")
    parser.add_argument("--cells", help="model/context/gpus/dataset,... (cells of the grid with a row of it)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", help="where the rows go (JSON), one cell at a time as they finish")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge rows written by --out into the grid")
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, Path(args.config))
        return
    if not (args.cells and args.out):
        parser.error("give --cells and --out (or --merge)")
    bench = load_config(Path(args.config))
    table = {cell_key(cell): cell for cell in json.loads((RESULTS / "paper_table.json").read_text())}
    jobs = []
    for text in args.cells.split(","):
        model, context, cluster, dataset = _parse_cell(text, bench)
        cell = table.get((model, context, bench["cluster_gpus"][cluster][0], dataset))
        if cell is None or args.strategy not in cell["strategies"]:
            raise SystemExit(f"{text}: the grid has no {args.strategy} row for this cell to start from")
        jobs.append((bench, args.strategy, (model, context, cluster, dataset), cell["strategies"][args.strategy],
                     args.steps, args.seed, current_commit()))
    out, done = Path(args.out), []
    out.parent.mkdir(parents=True, exist_ok=True)
    with multiprocessing.Pool(max(1, min(args.jobs, len(jobs)))) as pool:
        for cell in pool.imap_unordered(run_cell, jobs):
            done.append(cell)
            out.write_text(json.dumps(done, indent=1))
            row = cell["strategies"][args.strategy]
            print(f"[vpp] done {args.strategy} {cell['model']} {cell['context']} {cell['dataset']}: "
                  f"{row['layout']} {row['mean_s']:.1f} s "
                  f"(was {cell['recorded']['layout']} {cell['recorded']['mean_s']:.1f} s) in {cell['seconds']:.0f} s",
                  file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
