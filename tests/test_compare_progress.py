"""`slimpack compare` at interactive speed: the layout search's progress callback, the progress
display, rows written as each strategy is final, a clean stop (Ctrl-C, --time-budget) that marks
what is unfinished, and the cache of search results."""
from __future__ import annotations

import io
import json

import pytest

from megatron_slimpack import cli
from megatron_slimpack.apps import comparison
from megatron_slimpack.apps.comparison import CompareProgress, SearchCache, cache_dir
from megatron_slimpack.config import SlimPackConfig
from megatron_slimpack.costmodel import CostModel
from megatron_slimpack.planner.layouts import SearchProgress, best_layout
from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

TINY = CostModel.analytic("tiny", "cpu")
CONTEXT = 4096
# One worker: these tests watch the searches in this process (the parallel ones are at the end).
SMALL = ["compare", "--workload", "longtail", "--model", "tiny", "--hardware", "cpu", "--gpus", "2",
         "--context-length", str(CONTEXT), "--global-batch-size", "4", "--workers", "1"]
THREE = ["--strategies", "megatron-fixed,bfd,slimpack"]


def tiny_batches(steps: int = 2, seed: int = 0) -> list[list[int]]:
    sampler = GlobalBatchSampler(load_lengths("longtail", seed=seed), CONTEXT, 4, seed=seed, long_documents="split")
    return [sampler.next_batch().lengths for _ in range(steps)]


@pytest.fixture
def searches(monkeypatch):
    """The strategies `run_comparison` searches (not read from the cache), in order."""
    calls: list[str] = []
    real = comparison.best_layout

    def counted(strategy, *args, **kwargs):
        calls.append(strategy)
        return real(strategy, *args, **kwargs)

    monkeypatch.setattr(comparison, "best_layout", counted)
    return calls


# ---- the progress callback and the display ---------------------------------------------------

def test_the_search_tells_its_callback_layouts_screened_of_total():
    events: list[SearchProgress] = []
    result = best_layout("megatron-fixed", tiny_batches(), TINY, 2, CONTEXT, SlimPackConfig(context_length=CONTEXT),
                         progress=events.append)
    screening = [e for e in events if e.phase == "screening"]
    finishing = [e for e in events if e.phase == "finishing"]
    assert screening and finishing and events.index(finishing[0]) > events.index(screening[-1])
    total = screening[0].total
    assert 0 < total <= result.candidates and all(e.total == total for e in screening)
    assert [e.done for e in screening] == list(range(total + 1))  # the start, then one per layout
    assert all(e.candidates == result.candidates and e.strategy == "megatron-fixed" for e in events)
    assert finishing[-1].done == finishing[-1].total == min(3, len(result.screened))
    assert finishing[-1].best_s == pytest.approx(result.mean_iteration_time_s)
    assert screening[-1].best_s == pytest.approx(min(seconds for _, seconds in result.screened))
    assert all(a.elapsed_s <= b.elapsed_s for a, b in zip(events, events[1:]))


def test_what_the_callback_raises_stops_the_search():
    class Enough(Exception):
        pass

    def stop_after_two(progress: SearchProgress) -> None:
        if progress.done == 2:
            raise Enough

    with pytest.raises(Enough):
        best_layout("megatron-fixed", tiny_batches(), TINY, 2, CONTEXT, progress=stop_after_two)


def progress(done: int, total: int = 10, phase: str = "screening", best: float | None = 1.5) -> SearchProgress:
    return SearchProgress("slimpack", phase, done, total, best if done else None, elapsed_s=2.0 * done,
                          candidates=40)


def test_the_bar_without_tqdm_is_one_redrawn_line_with_best_elapsed_and_eta(monkeypatch):
    monkeypatch.setattr(comparison, "_tqdm", lambda: None)
    stream = io.StringIO()
    with CompareProgress("bar", stream) as display:
        display.strategy_started("slimpack", 1, 3, 128)
        for done in range(4):
            display.update(progress(done))
        drawn = stream.getvalue().split("\r")[-1]
        assert drawn.startswith("[2/3] slimpack screening 3/10 layouts, best 1.500 s, elapsed 0:06, ETA 0:14")
        for done, elapsed in ((0, 20.0), (1, 30.0)):  # the ETA is of the phase: 10 s per layout finished
            display.update(SearchProgress("slimpack", "finishing", done, 3, 1.7 if done else None, elapsed, 40))
        drawn = stream.getvalue().split("\r")[-1]
        assert drawn.startswith("[2/3] slimpack finishing 1/3 layouts, best 1.700 s, elapsed 0:30, ETA 0:20")
        assert "\n" not in stream.getvalue()
    assert stream.getvalue().endswith("\r")  # cleared on exit: the next output starts on a clean line


def test_the_tqdm_bar_shows_strategy_counts_and_best(monkeypatch):
    import tqdm  # noqa: F401 - a dependency of the package: the bar test always runs
    stream = io.StringIO()
    with CompareProgress("bar", stream) as display:
        display.strategy_started("slimpack", 0, 2, 8)
        for done in range(4):
            display.update(progress(done))
        display.bar.refresh()
        drawn = stream.getvalue().split("\r")[-1]
    assert "[1/2] slimpack screening" in drawn and "3/10" in drawn and "best 1.500 s" in drawn


def test_without_a_terminal_one_log_line_per_strategy_and_phase():
    stream = io.StringIO()  # not a terminal: "auto" logs
    with CompareProgress("auto", stream) as display:
        display.strategy_started("slimpack", 0, 1, 8)
        for done in range(11):
            display.update(progress(done))
        for done in range(4):
            display.update(progress(done, total=3, phase="finishing", best=1.7))
        display.strategy_done("slimpack", 0, 1, "tp1 pp1 cp1 dp8, 1.700 s/iteration")
    lines = stream.getvalue().splitlines()
    assert lines == [
        "[compare] slimpack: searching layouts for 8 GPUs ...",
        "[compare] slimpack: screening: the first batch on 10 of 40 layouts, 0:00 in",
        "[compare] slimpack: finishing: every batch on the 3 fastest layouts, 0:00 in, best so far 1.500 s",
        "[compare] [1/1] slimpack: tp1 pp1 cp1 dp8, 1.700 s/iteration",
    ]
    quiet = io.StringIO()
    with CompareProgress("off", quiet) as display:
        display.strategy_started("slimpack", 0, 1, 8)
        display.update(progress(3))
        display.strategy_done("slimpack", 0, 1, "done")
    assert quiet.getvalue() == ""


# ---- partial results and a clean stop --------------------------------------------------------

def test_ctrl_c_keeps_the_finished_rows_marks_the_rest_unfinished_and_exits_3(monkeypatch, tmp_path, capsys):
    out = tmp_path / "compare.md"
    real = comparison.best_layout
    seen_before_bfd = {}

    def interrupted_at_bfd(strategy, *args, **kwargs):
        if strategy == "bfd":  # megatron-fixed is final and already written
            seen_before_bfd.update(json.loads(out.with_suffix(".json").read_text()))
            raise KeyboardInterrupt
        return real(strategy, *args, **kwargs)

    monkeypatch.setattr(comparison, "best_layout", interrupted_at_bfd)
    assert cli.main([*SMALL, *THREE, "--out", str(out)]) == cli.STOPPED_EXIT == 3
    assert [row["strategy"] for row in seen_before_bfd["rows"]] == ["megatron-fixed"]
    assert seen_before_bfd["pending"] == ["bfd", "slimpack"] and not seen_before_bfd["unfinished"]

    captured = capsys.readouterr()
    data = json.loads(out.with_suffix(".json").read_text())
    assert [row["strategy"] for row in data["rows"]] == ["megatron-fixed"]
    assert list(data["unfinished"]) == ["bfd", "slimpack"] and data["failures"] == {} and data["pending"] == []
    assert "interrupted (Ctrl-C)" in data["unfinished"]["bfd"]
    markdown = out.read_text()
    assert markdown.startswith("| strategy | layout |") and "| megatron-fixed |" in markdown
    assert "- bfd: unfinished (search stopped: interrupted (Ctrl-C)); no row" in markdown
    assert "- slimpack: unfinished (not searched: interrupted (Ctrl-C)); no row" in markdown
    assert "| megatron-fixed |" in captured.out and "| bfd |" not in captured.out
    assert "2 strategies unfinished: bfd (search stopped" in captured.err and "slimpack (not searched" in captured.err
    assert "no feasible layout" not in captured.out + captured.err


class Clock:
    """The comparison's clock, moved on by hand: a budget spent exactly where a test says."""

    def __init__(self):
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


def test_a_time_budget_stops_the_search_inside_a_strategy(monkeypatch, tmp_path, capsys):
    real = comparison.best_layout
    clock = Clock()

    def slow_bfd(strategy, *args, **kwargs):
        if strategy == "bfd":
            clock.now += 60.0  # past the budget: its first progress report stops it
        return real(strategy, *args, **kwargs)

    monkeypatch.setattr(comparison, "best_layout", slow_bfd)
    monkeypatch.setattr(comparison, "time", clock)
    out = tmp_path / "compare.json"
    code = cli.main([*SMALL, *THREE, "--out", str(out), "--time-budget", "0.8", "--json"])
    captured = capsys.readouterr()
    assert code == 3
    data = json.loads(out.read_text())
    assert json.loads(captured.out) == data
    assert [row["strategy"] for row in data["rows"]] == ["megatron-fixed"]
    assert data["unfinished"] == {
        "bfd": "search stopped: the time budget of 0.8 s was spent",
        "slimpack": "not searched: the time budget of 0.8 s was spent"}
    assert "bfd (search stopped: the time budget of 0.8 s was spent)" in captured.err


def test_a_stop_before_any_row_still_exits_3_and_writes_the_file(tmp_path, capsys):
    out = tmp_path / "compare.json"
    assert cli.main([*SMALL, *THREE, "--out", str(out), "--time-budget", "1e-9"]) == 3
    data = json.loads(out.read_text())
    assert data["rows"] == [] and list(data["unfinished"]) == ["megatron-fixed", "bfd", "slimpack"]
    assert "megatron-fixed: unfinished" in capsys.readouterr().out


# ---- the search cache ------------------------------------------------------------------------

def compare_json(argv: list[str], capsys) -> dict:
    assert cli.main([*argv, "--json", "--quiet"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_repeated_compare_reads_every_strategy_from_the_cache(searches, capsys):
    first = compare_json([*SMALL, *THREE, "--steps", "2"], capsys)
    assert searches == ["megatron-fixed", "bfd", "slimpack"] and first["cached"] == []
    assert len(list(cache_dir().glob("*.json.gz"))) == 3
    again = compare_json([*SMALL, *THREE, "--steps", "2"], capsys)
    assert searches == ["megatron-fixed", "bfd", "slimpack"]  # nothing searched again
    assert again["cached"] == ["megatron-fixed", "bfd", "slimpack"]
    first.pop("cached"), again.pop("cached")
    assert again == first  # the cached results rebuild the same rows, layouts and notes


@pytest.mark.parametrize("change", [["--seed", "1"], ["--steps", "1"], ["--gpus", "4"], ["--hardware", "h100-sxm"],
                                    ["--solver-deterministic-limit", "0.3"]])
def test_the_cache_is_missed_when_an_input_changes(searches, capsys, change):
    compare_json([*SMALL, "--strategies", "megatron-fixed,slimpack", "--steps", "2"], capsys)
    compare_json([*SMALL, "--strategies", "megatron-fixed,slimpack", "--steps", "2", *change], capsys)
    assert searches == ["megatron-fixed", "slimpack"] * 2


def test_only_what_changed_is_searched_again(searches, capsys):
    compare_json([*SMALL, "--strategies", "megatron-fixed,bfd"], capsys)
    data = compare_json([*SMALL, "--strategies", "megatron-fixed,bfd,slimpack"], capsys)
    assert searches == ["megatron-fixed", "bfd", "slimpack"] and data["cached"] == ["megatron-fixed", "bfd"]


def test_no_cache_neither_reads_nor_writes_it(searches, capsys):
    compare_json([*SMALL, "--strategies", "megatron-fixed", "--no-cache"], capsys)
    assert not cache_dir().exists()
    compare_json([*SMALL, "--strategies", "megatron-fixed"], capsys)
    compare_json([*SMALL, "--strategies", "megatron-fixed", "--no-cache"], capsys)
    assert searches == ["megatron-fixed"] * 3


def test_no_feasible_layout_is_cached_too_and_an_unreadable_entry_is_searched_again(searches, capsys):
    argv = [*SMALL[:-4], "--context-length", "131072", "--global-batch-size", "1", "--model", "llama-70b",
            "--gpus", "1", "--strategies", "megatron-fixed"]
    for _ in range(2):
        assert cli.main([*argv, "--quiet"]) == 2
        assert "no strategy has a feasible layout" in capsys.readouterr().err
    assert searches == ["megatron-fixed"]
    (entry,) = cache_dir().glob("*.json.gz")
    entry.write_bytes(b"not gzip")
    assert cli.main([*argv, "--quiet"]) == 2
    assert searches == ["megatron-fixed"] * 2


def test_cache_keys_cover_the_cost_model_configuration_and_batches():
    cache = SearchCache()
    config = SlimPackConfig(context_length=CONTEXT)
    key = cache.key("slimpack", tiny_batches(), TINY, 2, CONTEXT, config)
    assert key == cache.key("slimpack", tiny_batches(), CostModel.analytic("tiny", "cpu"), 2, CONTEXT, config)
    assert key.startswith("slimpack-")
    others = [
        cache.key("bfd", tiny_batches(), TINY, 2, CONTEXT, config),
        cache.key("slimpack", tiny_batches(seed=1), TINY, 2, CONTEXT, config),
        cache.key("slimpack", tiny_batches(), CostModel.analytic("tiny", "h100-sxm"), 2, CONTEXT, config),
        cache.key("slimpack", tiny_batches(), TINY, 4, CONTEXT, config),
        cache.key("slimpack", tiny_batches(), TINY, 2, CONTEXT, config.with_(seed=5)),
    ]
    assert len({key, *others}) == 6


# ---- strategies searched in parallel ----------------------------------------------------------

def without_timings(data: dict) -> dict:
    """A comparison's JSON without the wall-clock figures (search and planning times)."""
    for layout in data["layouts"].values():
        layout.pop("search_time_s")
    for row in data["rows"]:
        row.pop("planning_s")
    return data


def test_two_workers_find_what_one_finds(capsys):
    argv = [*SMALL[:-2], "--steps", "2", "--strategies", "megatron-fixed,bfd,wlb-llm,slimpack",
            "--solver-deterministic-limit", "0.2", "--no-cache"]
    one = without_timings(compare_json([*argv, "--workers", "1"], capsys))
    two = without_timings(compare_json([*argv, "--workers", "2"], capsys))
    assert [row["strategy"] for row in two["rows"]] == ["megatron-fixed", "bfd", "wlb-llm", "slimpack"]
    assert two == one


def test_parallel_searches_are_cached_and_read_back(capsys):
    argv = [*SMALL[:-1], "2", *THREE]
    first = compare_json(argv, capsys)
    again = compare_json(argv, capsys)
    assert first["cached"] == [] and again["cached"] == ["megatron-fixed", "bfd", "slimpack"]
    assert without_timings(again)["rows"] == without_timings(first)["rows"]


def test_a_time_budget_stops_the_workers_and_exits_3(tmp_path, capsys):
    out = tmp_path / "compare.json"
    assert cli.main([*SMALL[:-1], "2", *THREE, "--out", str(out), "--time-budget", "1e-9", "--quiet"]) == 3
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["unfinished"] == {
        name: "search stopped: the time budget of 1e-09 s was spent" for name in ("megatron-fixed", "bfd", "slimpack")}
