"""Which paper-grid cells' SlimPack plans a planner change moves (the rule: re-run only those).

For every grid cell (`benchmarks/results/paper_table.json`) with a pipelined SlimPack layout, the
cell's first global batch is planned at the layout the grid recorded for SlimPack, with a
deterministic solver limit, and its fingerprint and simulated makespan are printed as one JSON
line. Run it under the checkout before the change and the one after, then diff:

    python benchmarks/grid_plans_moved.py --checkout /path/to/old > old.jsonl
    python benchmarks/grid_plans_moved.py --checkout .             > new.jsonl
    python benchmarks/grid_plans_moved.py --diff old.jsonl new.jsonl

Only the recorded layout is planned: a change could still make another layout the best for a
cell (the full layout search is the grid run itself).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = HERE / "results" / "paper_table.json"


def layout_of(text: str) -> dict:
    """'tp4 pp8 vpp2 cp2 dp2 rc-selective' -> ParallelConfig keywords (vpp only where written)."""
    parts = text.split()
    sizes = {part.rstrip("0123456789"): int(part.lstrip("abcdefghijklmnopqrstuvwxyz"))
             for part in parts if not part.startswith("rc-")}
    recompute = next((part[3:] for part in parts if part.startswith("rc-")), "none")
    return dict(tp=sizes["tp"], pp=sizes["pp"], vpp=sizes.get("vpp", 1), cp=sizes["cp"], dp=sizes["dp"],
                recompute=recompute)


def plan_cells(checkout: Path, cells: list[str]) -> None:
    sys.path[:0] = [str(checkout), str(checkout / "benchmarks")]
    import paper_table

    import megatron_slimpack as ms
    from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

    bench = paper_table.load_config(checkout / "configs" / "bench" / "paper.yaml")
    cluster_of = {gpus: name for name, (gpus, _) in bench["cluster_gpus"].items()}
    for cell in json.loads(TABLE.read_text()):
        layout = cell["strategies"]["slimpack"]["layout"]
        key = f"{cell['model']}-{cell['context'] // 1024}K-{cell['gpus']}-{cell['dataset']}"
        if layout_of(layout)["pp"] == 1 or (cells and key not in cells):
            continue
        _, hardware = bench["cluster_gpus"][cluster_of[cell["gpus"]]]
        cost = ms.CostModel.analytic(bench["model_presets"][cell["model"]], hardware)
        lengths = load_lengths(bench["workloads"][cell["dataset"]], seed=0)
        # The grid's corpora hold documents longer than its contexts: cut at it (the paper's setting).
        batch = GlobalBatchSampler(lengths, cell["context"], bench["global_batch_size"][cell["context"]],
                                   seed=0, long_documents="split").next_batch()
        config = ms.SlimPackConfig(strategy="slimpack", context_length=cell["context"], solver_time_limit_s=120.0,
                                   solver_deterministic_limit=0.5)
        began = time.perf_counter()
        plan = ms.plan(batch.lengths, parallel=ms.ParallelConfig(**layout_of(layout)), cost=cost, config=config,
                       sources=batch.sources)
        print(json.dumps({"cell": key, "layout": layout, "fingerprint": plan.fingerprint(),
                          "makespan_s": ms.simulate(plan, cost).iteration_time_s,
                          "plan_s": time.perf_counter() - began}), flush=True)


def diff(old_path: str, new_path: str) -> None:
    old = {row["cell"]: row for row in map(json.loads, Path(old_path).read_text().splitlines())}
    print("| cell | layout | plan | makespan before -> after (s) |\n|---|---|---|---|")
    for row in map(json.loads, Path(new_path).read_text().splitlines()):
        before = old[row["cell"]]
        moved = "moved" if before["fingerprint"] != row["fingerprint"] else "same"
        change = 100 * (row["makespan_s"] / before["makespan_s"] - 1)
        print(f"| {row['cell']} | {row['layout']} | {moved} | {before['makespan_s']:.2f} -> "
              f"{row['makespan_s']:.2f} ({change:+.2f}%) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkout", type=Path, default=HERE.parent, help="the project checkout to plan with")
    parser.add_argument("--cells", nargs="*", default=[], help="only these cells (e.g. llama-70b-128K-128-wikipedia)")
    parser.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"), help="compare two outputs as a Markdown table")
    args = parser.parse_args()
    if args.diff:
        diff(*args.diff)
    else:
        plan_cells(args.checkout.resolve(), args.cells)


if __name__ == "__main__":
    main()
