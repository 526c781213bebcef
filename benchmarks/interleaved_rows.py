"""Rows of the paper grid re-run with virtual pipeline stages searched, merged into
benchmarks/results/paper_table.{json,md,png}, and what moved, old figure next to new, in
benchmarks/results/interleaved.md.

The rows are run by paper_table.py into a scratch table (so that a long run does not touch the
committed one), e.g.:

    python benchmarks/paper_table.py --cells llama-70b/131072/128/wikipedia,... \
        --strategies megatron-fixed,megatron-stock --steps 10 --fresh --out /tmp/vpp/paper_table.md
    python benchmarks/interleaved_rows.py /tmp/vpp/paper_table.json [more.json ...] \
        --before <(git show eadb9f2:benchmarks/results/paper_table.json)

Each merged row keeps the commit it ran at; rows not re-run keep theirs (and their layouts were
searched without virtual stages).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from paper_table import cell_key, grid_order, load_config, merge_cells, plot, render  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def moved_rows(old: list[dict], new_cells: list[dict], merged: list[dict]) -> str:
    """One line per re-run (cell, strategy): layout and mean time before and after, and SlimPack's
    speedup over megatron-fixed before and after in that cell."""
    before = {cell_key(cell): cell for cell in old}
    after = {cell_key(cell): cell for cell in merged}
    lines = ["| model | context | GPUs | dataset | strategy | layout before | s before | layout after | s after "
             "| change | SlimPack vs megatron-fixed before | after | commit |",
             "|---|---:|---:|---|---|---|---:|---|---:|---:|---:|---:|---|"]
    for cell in new_cells:
        key = cell_key(cell)
        old_cell, now = before.get(key, {"strategies": {}}), after[key]
        for name, figures in cell["strategies"].items():
            was = old_cell["strategies"].get(name)
            was_text = (f"{was['layout']} | {was['mean_s']:.2f}" if was else "- | -")
            change = f"{100 * (figures['mean_s'] / was['mean_s'] - 1):+.1f}%" if was else "-"
            speedups = [c["strategies"].get("slimpack", {}).get("speedup") for c in (old_cell, now)]
            speedup_text = " | ".join(f"{s:.2f}x" if s else "-" for s in speedups)
            lines.append(f"| {key[0]} | {key[1] // 1024}K | {key[2]} | {key[3]} | {name} | {was_text} | "
                         f"{figures['layout']} | {figures['mean_s']:.2f} | {change} | {speedup_text} | "
                         f"{figures.get('commit', '-')} |")
    return "\n".join(lines) + "\n"


def rows_at(cells: list[dict], commits: set[str]) -> list[dict]:
    """The cells with only their rows that ran at one of `commits` (cells with none left out)."""
    kept = []
    for cell in cells:
        mine = {name: figures for name, figures in cell["strategies"].items() if figures.get("commit") in commits}
        if mine:
            kept.append({**cell, "strategies": mine, "failures": {}})
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="paper_table.json files of re-run cells")
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench" / "paper.yaml"))
    parser.add_argument("--before", help="the table the 'before' columns come from (default: the current one, "
                                         "before this merge)")
    parser.add_argument("--report", help="write the moved rows to this file of benchmarks/results/ with --intro "
                                         "as its text (default: interleaved.md, the re-run with vpp searched)")
    parser.add_argument("--intro", default="", help="the report's title and text, Markdown")
    parser.add_argument("--only-commit", help="take only the rows that ran at these commits, comma-separated (runs "
                                              "made in a whole copy of the table, which holds every other row too)")
    args = parser.parse_args()
    order = grid_order(load_config(Path(args.config)))
    table = RESULTS / "paper_table.json"
    old = json.loads(Path(args.before).read_text() if args.before else table.read_text())
    new_cells = [cell for path in args.runs for cell in json.loads(Path(path).read_text())]
    if args.only_commit:
        new_cells = rows_at(new_cells, set(args.only_commit.split(",")))
    merged = merge_cells(json.loads(table.read_text()), json.loads(json.dumps(new_cells)), order)
    table.write_text(json.dumps(merged, indent=1))
    (RESULTS / "paper_table.md").write_text(render(merged, order))
    plot(merged, RESULTS / "paper_speedup.png")
    if args.report:
        (RESULTS / args.report).write_text(args.intro.rstrip() + "\n\n" + moved_rows(old, new_cells, merged))
        print((RESULTS / args.report).read_text())
        return
    (RESULTS / "interleaved.md").write_text(
        "# Grid rows re-run with virtual pipeline stages searched\n\n"
        "Each row: a strategy of a cell re-run by `benchmarks/paper_table.py` (10 batches, as the grid) with vpp "
        "searched; the layout and mean iteration time from the search without virtual stages (before: the table "
        "at eadb9f2) and with them (after), and SlimPack's speedup over megatron-fixed in that cell with each. "
        "Made by `benchmarks/interleaved_rows.py`; each row names the commit it ran at.\n\n"
        + moved_rows(old, new_cells, merged))
    print((RESULTS / "interleaved.md").read_text())


if __name__ == "__main__":
    main()
