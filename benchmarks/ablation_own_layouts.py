"""What each part of SlimPack is worth when every variant gets its own best layout.

`ablation.py` holds the layout fixed at SlimPack's; here each variant goes through the grid's
layout search (`best_layout`: TP, PP, CP / base merge, DP, recompute and virtual stages, the first
batch screening every layout, the fastest finalists run on every batch) for the cell's 128 H100s,
on the cell's first `--batches` Wikipedia global batches (the grid's sampler, seed 0):
  - slimpack, slimpack-sym (no asymmetric units), slimpack-nomerge (no DP-Merge) and
    "no slicing" (slimpack with `slice_tokens` = the context: a document is cut only where no
    MicroPack can hold it), the analytic H100 cost model and the grid's simulator.
Rows are written as each cell finishes (`--out`, JSON), and `--report` turns them into
benchmarks/results/ablation_own_layouts.md.

    python benchmarks/ablation_own_layouts.py --cells llama-13b/262144,llama-13b/131072 --jobs 2 \
        --out /tmp/ablation_own.json
    python benchmarks/ablation_own_layouts.py --report /tmp/ablation_own.json
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from paper_table import cell_batches, current_commit, load_config, row_of  # noqa: E402

import megatron_slimpack as ms  # noqa: E402
from megatron_slimpack.planner.layouts import NoFeasibleLayout, best_layout  # noqa: E402

VARIANTS = ("slimpack", "slimpack-sym", "slimpack-nomerge", "no slicing")
GPUS = 128


def search_variant(job: tuple) -> dict:
    """One variant of one cell through the layout search; its row (paper_table's figures) or why
    no layout fits."""
    bench, model, context, variant, batches, commit = job
    print(f"[ablation] {model} {context // 1024}K {variant} ...", file=sys.stderr, flush=True)
    cluster = next(name for name, (gpus, _) in bench["cluster_gpus"].items() if gpus == GPUS)
    cost = ms.CostModel.analytic(bench["model_presets"][model], bench["cluster_gpus"][cluster][1])
    strategy = "slimpack" if variant == "no slicing" else variant
    extra = {"slice_tokens": context} if variant == "no slicing" else {}
    started = time.perf_counter()
    try:
        result = best_layout(strategy, batches, cost, GPUS, context, ms.SlimPackConfig(context_length=context, **extra))
        row = row_of(result)
    except NoFeasibleLayout as error:
        row = {"error": str(error).splitlines()[0]}
    return {"model": model, "context": context, "variant": variant, "batches": len(batches), "commit": commit,
            "seconds": time.perf_counter() - started, **row}


def report(rows: list[dict], note: str = "") -> str:
    cells = sorted({(r["model"], r["context"]) for r in rows}, key=lambda c: (int(c[0].split("-")[1][:-1]), -c[1]))
    by_key = {(r["model"], r["context"], r["variant"]): r for r in rows}
    lines = ["# Ablation: each variant in its own best layout\n",
             __doc__.split("\n\n")[1] + "\n",
             "Mean simulated iteration time over the batches; ratio against `slimpack`'s own best (> 1: slower "
             "without the part); the layout each search found; the commit each row ran at.\n",
             "| model | context | " + " | ".join(VARIANTS) + " |", "|---|---:|" + "---|" * len(VARIANTS)]
    for model, context in cells:
        base = by_key.get((model, context, "slimpack"), {}).get("mean_s")
        texts = []
        for variant in VARIANTS:
            row = by_key.get((model, context, variant))
            if row is None:
                texts.append("not run")
            elif "error" in row:
                texts.append(f"no layout fits ({row['commit']})")
            else:
                ratio = f" = {row['mean_s'] / base:.3f}x" if base and variant != "slimpack" else ""
                texts.append(f"{row['mean_s']:.1f} s{ratio} ({row['layout']}; {row['commit']})")
        lines.append(f"| {model} | {context // 1024}K | " + " | ".join(texts) + " |")
    failures = [f"- {r['model']} {r['context'] // 1024}K {r['variant']}: {r['error']}" for r in rows if "error" in r]
    if failures:
        lines += ["", "Where no layout fits, the search's reason:", "", *failures]
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cells", help="model/context,... (default: 13B, 70B and 150B at 256K and 128K)")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--out", help="rows (JSON), written as each search finishes")
    parser.add_argument("--report", nargs="+", metavar="JSON", help="render rows into ablation_own_layouts.md")
    parser.add_argument("--note", default="", help="with --report: a paragraph under the table (what was not run)")
    args = parser.parse_args()
    if args.report:
        rows = [row for path in args.report for row in json.loads(Path(path).read_text())]
        path = HERE / "results" / "ablation_own_layouts.md"
        path.write_text(report(rows, args.note))
        print(path.read_text())
        return
    if not args.out:
        parser.error("give --out (or --report)")
    bench = load_config(HERE.parent / "configs" / "bench" / "paper.yaml")
    cells = ([(m, int(c)) for m, c in (text.split("/") for text in args.cells.split(","))] if args.cells else
             [(m, c * 1024) for m in ("llama-13b", "llama-70b", "llama-150b") for c in (256, 128)])
    variants = args.variants.split(",")
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    commit = current_commit()
    jobs = [(bench, model, context, variant, cell_batches(bench, context, "wikipedia", args.batches, 0), commit)
            for model, context in cells for variant in variants]
    out, done = Path(args.out), []
    with multiprocessing.Pool(max(1, min(args.jobs, len(jobs)))) as pool:
        for row in pool.imap_unordered(search_variant, jobs):
            done.append(row)
            out.write_text(json.dumps(done, indent=1))
            figure = row.get("layout", row.get("error", ""))[:80]
            print(f"[ablation] done {row['model']} {row['context'] // 1024}K {row['variant']}: "
                  f"{row.get('mean_s', float('nan')):.1f} s {figure} in {row['seconds']:.0f} s", file=sys.stderr,
                  flush=True)


if __name__ == "__main__":
    main()
