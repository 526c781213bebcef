"""The paper grid's bookkeeping (benchmarks/paper_table.py): merging re-run cells strategy by
strategy, and the at-a-glance summary of SlimPack's speedups."""
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def paper_table():
    spec = importlib.util.spec_from_file_location("paper_table", ROOT / "benchmarks" / "paper_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _figures(mean_s: float, commit: str = "old") -> dict:
    return {"layout": "tp1 pp1 cp1 dp8", "mean_s": mean_s, "min_s": mean_s, "max_s": mean_s, "bubble": 0.0,
            "lower_bound_s": mean_s, "peak_gib": 1.0, "speedup": None, "commit": commit}


def _cell(model: str, dataset: str, strategies: dict, failures: dict | None = None) -> dict:
    return {"model": model, "context": 65536, "gpus": 128, "dataset": dataset, "steps": 10,
            "strategies": strategies, "failures": failures or {}}


ORDER = [("llama-7b", 65536, 128, "wikipedia"), ("llama-7b", 65536, 128, "github"),
         ("llama-13b", 65536, 128, "wikipedia"), ("llama-13b", 65536, 128, "github")]


def test_grid_order_covers_the_config(paper_table):
    bench = paper_table.load_config(ROOT / "configs" / "bench" / "paper.yaml")
    order = paper_table.grid_order(bench)
    assert len(order) == len(set(order)) == (len(bench["models"]) * len(bench["context_lengths"])
                                             * len(bench["clusters"]) * len(bench["datasets"]))
    assert order[0] == (bench["models"][0], bench["context_lengths"][0], 128, bench["datasets"][0])


def test_rerun_strategy_replaces_only_its_row_and_speedups_follow(paper_table):
    old = [_cell("llama-7b", "wikipedia", {"megatron-fixed": _figures(120.0), "wlb-llm": _figures(110.0),
                                           "slimpack": _figures(100.0)})]
    rerun = [_cell("llama-7b", "wikipedia", {"slimpack": _figures(96.0, commit="new")})]
    [cell] = paper_table.merge_cells(old, rerun, ORDER)
    assert cell["strategies"]["slimpack"]["commit"] == "new"
    assert cell["strategies"]["wlb-llm"]["commit"] == "old"
    assert cell["strategies"]["slimpack"]["speedup"] == pytest.approx(120.0 / 96.0)
    assert cell["strategies"]["megatron-fixed"]["speedup"] == pytest.approx(1.0)


def test_rows_run_in_a_whole_copy_of_the_table_merge_by_their_commit(paper_table):
    """Re-runs made in a copy of the whole table (benchmarks/interleaved_rows.py --only-commit):
    only the rows that ran at the commit are merged, so two copies that each re-ran other rows do
    not undo each other."""
    spec = importlib.util.spec_from_file_location("interleaved_rows", ROOT / "benchmarks" / "interleaved_rows.py")
    rows = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rows)
    table = [_cell("llama-7b", "wikipedia", {"megatron-fixed": _figures(120.0), "wlb-llm": _figures(110.0),
                                             "slimpack": _figures(100.0)})]
    copy_a = [_cell("llama-7b", "wikipedia", {"megatron-fixed": _figures(120.0), "wlb-llm": _figures(108.0, "new"),
                                              "slimpack": _figures(100.0)}),
              _cell("llama-7b", "github", {"slimpack": _figures(90.0)})]
    copy_b = [_cell("llama-7b", "wikipedia", {"megatron-fixed": _figures(120.0), "wlb-llm": _figures(110.0),
                                              "slimpack": _figures(97.0, "new")})]
    picked = rows.rows_at(copy_a, {"new"}) + rows.rows_at(copy_b, {"new", "other"})
    assert [list(cell["strategies"]) for cell in picked] == [["wlb-llm"], ["slimpack"]]
    [cell] = paper_table.merge_cells(table, picked, ORDER)
    assert (cell["strategies"]["wlb-llm"]["mean_s"], cell["strategies"]["slimpack"]["mean_s"]) == (108.0, 97.0)


def test_cells_are_kept_in_grid_order(paper_table):
    later = _cell("llama-13b", "github", {"megatron-fixed": _figures(1.0)})
    earlier = _cell("llama-7b", "github", {"megatron-fixed": _figures(1.0)})
    merged = paper_table.merge_cells([later], [earlier], ORDER)
    assert [paper_table.cell_key(c) for c in merged] == [ORDER[1], ORDER[3]]


def test_summary_shows_both_speedups_failures_and_missing_cells(paper_table):
    cells = paper_table.merge_cells([], [
        _cell("llama-7b", "wikipedia", {"megatron-fixed": _figures(150.0), "slimpipe": _figures(120.0),
                                        "slimpack": _figures(100.0), "slimpack-sym": _figures(90.0)}),
        _cell("llama-7b", "github", {"megatron-fixed": _figures(150.0)}, failures={"slimpack": "memory"}),
        _cell("llama-13b", "wikipedia", {"wlb-llm": _figures(99.0), "slimpack": _figures(100.0)}),
    ], ORDER)
    lines = paper_table.summary(cells, ORDER).splitlines()
    assert lines[0] == "| model | context | wikipedia, 128 GPUs | github, 128 GPUs |"
    # SlimPack's own variants are not "other strategies"; a cell without the reference has no first figure.
    assert lines[2] == "| llama-7b | 64K | 1.50x / 1.20x | no feasible layout |"
    assert lines[3] == "| llama-13b | 64K | - / 0.99x | not run |"


def test_stock_is_a_reference_column_never_the_fastest_other(paper_table):
    """megatron-stock (cross-document attention, a different training semantic): every row gets its
    speedup over it, a second summary puts SlimPack's next to the one over megatron-fixed, and the
    first summary's "fastest other strategy" never counts it, even where it is the fastest."""
    cells = paper_table.merge_cells([], [
        _cell("llama-7b", "wikipedia", {"megatron-fixed": _figures(150.0), "wlb-llm": _figures(130.0),
                                        "slimpack": _figures(100.0), "megatron-stock": _figures(50.0)}),
        _cell("llama-7b", "github", {"megatron-fixed": _figures(150.0), "slimpack": _figures(100.0)}),
        _cell("llama-13b", "wikipedia", {"megatron-fixed": _figures(150.0), "slimpack": _figures(100.0)},
              failures={"megatron-stock": "memory"}),
    ], ORDER)
    stock_run = cells[0]["strategies"]
    assert stock_run["slimpack"]["speedup_vs_stock"] == pytest.approx(0.5)
    assert stock_run["megatron-fixed"]["speedup_vs_stock"] == pytest.approx(50.0 / 150.0)
    assert cells[1]["strategies"]["slimpack"]["speedup_vs_stock"] is None
    assert paper_table.summary(cells, ORDER).splitlines()[2] == "| llama-7b | 64K | 1.50x / 1.30x | 1.50x / 1.50x |"
    versus = paper_table.summary(cells, ORDER, versus="megatron-stock").splitlines()
    assert versus[2] == "| llama-7b | 64K | 1.50x / 0.50x | not run |"
    assert versus[3] == "| llama-13b | 64K | no feasible layout | not run |"
    text = paper_table.render(cells, ORDER)
    assert "over megatron-stock (stock `pretrain_gpt.py` without `--reset-attention-mask`" in text
    assert "| speedup vs megatron-fixed | speedup vs megatron-stock | bubble |" in text
    assert "| wikipedia | slimpack | tp1 pp1 cp1 dp8 | 100.00 | 100.00-100.00 | 1.50x | 0.50x |" in text
    # a re-run of megatron-stock alone keeps the other rows and recomputes every stock speedup
    rerun = _cell("llama-7b", "wikipedia", {"megatron-stock": _figures(200.0, commit="abc1234+stock")})
    [cell] = [c for c in paper_table.merge_cells(cells, [rerun], ORDER) if c["dataset"] == "wikipedia"
              and c["model"] == "llama-7b"]
    assert cell["strategies"]["slimpack"]["speedup_vs_stock"] == pytest.approx(2.0)
    assert cell["strategies"]["slimpack"]["commit"] == "old"
    assert cell["strategies"]["megatron-stock"]["commit"] == "abc1234+stock"


def test_without_stock_the_table_has_no_stock_summary(paper_table):
    cells = paper_table.merge_cells([], [_cell("llama-7b", "wikipedia", {"megatron-fixed": _figures(150.0),
                                                                         "slimpack": _figures(100.0)})], ORDER)
    text = paper_table.render(cells, ORDER)
    assert "over megatron-stock (stock" not in text
    assert "| wikipedia | slimpack | tp1 pp1 cp1 dp8 | 100.00 | 100.00-100.00 | 1.50x | - |" in text
