"""Side-by-side comparison: every strategy on the same batches, cost model and simulator, each in
its own best memory-feasible layout for the same GPU count (`slimpack compare`).

Speedups are over megatron-fixed (Megatron-LM's fixed-length packing with per-document
attention). A strategy that trains a different semantic (`StrategySpec.different_semantics`:
megatron-stock, stock `pretrain_gpt.py`, whose sequences attend across document boundaries) is a
reference: its row is labelled in the notes, every row also gets its speedup over megatron-stock
(what a user switching from stock Megatron-LM would see), and it is never "the fastest other
strategy" (`competitors`).

A comparison is long (minutes per strategy at 128 GPUs), so `run_comparison` shows its progress
(`CompareProgress`), hands each strategy's row over as soon as it is final (`on_update`), stops
cleanly on Ctrl-C or at a time budget with the rows it has (the rest marked unfinished, never as
results), and keeps each strategy's search result in a cache keyed by every input it depends on
(`SearchCache`), so a repeated comparison searches only what changed."""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import multiprocessing
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import IO, Any

from .. import __version__
from ..config import SlimPackConfig
from ..costmodel import CostModel
from ..plan import Plan, PlanError
from ..planner.layouts import (
    LayoutEvaluation,
    LayoutResult,
    NoFeasibleLayout,
    Rejection,
    SearchProgress,
    best_layout,
)
from ..planner.strategies import REGISTRY, strategy_names, strategy_spec
from ..planner.tuning import tuned, tuning_note
from ..simulator import per_batch_report, simulate
from ..simulator.dag import SimulationReport
from ..simulator.report import (
    ComparisonRow,
    comparison_legend,
    comparison_table,
    figures_source,
    gantt_title,
    write_gantt,
)
from ..specs import ParallelConfig
from ..workload import draw_global_batches, load_lengths, long_document_note
from .library_noise import ignore_library_warnings

REFERENCE = "megatron-fixed"  # every speedup is over it
STOCK = "megatron-stock"  # the stock-Megatron reference: its speedup column where it was run
STOCK_COLUMN = "speedup_vs_stock"  # CSV and JSON key (Markdown: STOCK_HEADER)
STOCK_HEADER = f"speedup vs {STOCK}"


def is_reference(name: str) -> bool:
    """`name` trains a different semantic from the others (its spec's `different_semantics`): a
    reference, never a competitor. An unregistered name (an old table's row) is not one."""
    spec = REGISTRY.get(name)
    return spec is not None and spec.is_reference


def objective(name: str) -> str:
    """What a strategy trains, in words: attention within whole documents, within the pieces of
    documents cut at sequence boundaries, or its own different semantic."""
    spec = strategy_spec(name)
    if spec.different_semantics:
        return spec.different_semantics
    return "documents cut at sequence boundaries" if spec.splits_documents else "documents whole"


def overlap_note(name: str) -> str:
    """The communication overlaps a strategy is priced with, and the Megatron flags that give them."""
    overlaps = strategy_spec(name).overlaps
    return f"{name}: {_overlap_words(name)} ({' '.join(overlaps.flags()) or 'no overlap flags'})"


def _overlap_words(name: str) -> str:
    overlaps = strategy_spec(name).overlaps
    tp = "TP hidden behind GEMMs" if overlaps.tp_comm else "TP serial"
    cp = "CP ring overlapped" if overlaps.cp_exchange else "CP gathered before attention"
    return f"{tp}, {cp}"


def competitors(names, strategy: str) -> list[str]:
    """Of `names`, those `strategy` is compared with for "the fastest other strategy": not itself
    nor its own variants (names that start with it: slimpack-sym and slimpack-nomerge for
    slimpack), nor a reference that trains a different semantic (megatron-stock)."""
    return [name for name in names if not name.startswith(strategy) and not is_reference(name)]


@dataclass
class StrategyRow(ComparisonRow):
    """A `ComparisonRow` plus, where the comparison ran megatron-stock (`with_stock`), the speedup
    over it (`stock`: its mean iteration time; None where it found no feasible layout)."""

    stock: float | None = None
    with_stock: bool = False
    markdown: bool = False  # the stock speedup as Markdown shows the other speedup ("1.23x")

    def values(self) -> dict:
        values = super().values()
        if self.with_stock:
            seconds = self.report.iteration_time_s
            speedup = self.stock / seconds if self.stock and seconds > 0 else None
            if self.markdown:
                values[STOCK_HEADER] = "-" if speedup is None else f"{speedup:.2f}x"
            else:
                values[STOCK_COLUMN] = speedup
        return values


@dataclass
class ComparisonResult:
    """`results`: each strategy's best layout; `failures`: why a strategy has none; `unfinished`:
    strategies whose search was stopped (Ctrl-C, the time budget) before it was final, with why:
    neither a result nor a failure; `pending`: strategies not searched yet (while it runs);
    `cached`: strategies whose result came from the search cache."""

    results: dict[str, LayoutResult]
    failures: dict[str, str] = field(default_factory=dict)
    gantt_files: list[str] = field(default_factory=list)
    unfinished: dict[str, str] = field(default_factory=dict)
    pending: list[str] = field(default_factory=list)
    cached: list[str] = field(default_factory=list)
    explanations: list[str] = field(default_factory=list)  # why SlimPack is slower where it is (`why_slower`)
    cost_model: dict | None = None  # `CostModel.describe()` of the model every row is priced with
    # what the batches made of documents longer than the context (split or left out), where any
    workload_notes: list[str] = field(default_factory=list)

    def rows(self, *, markdown: bool = False) -> list[StrategyRow]:
        """One row per strategy with a layout; the stock speedup column where megatron-stock was
        compared (`markdown`: formatted for the Markdown table)."""
        reference = self.results.get(REFERENCE)
        stock = self.results.get(STOCK)
        with_stock = STOCK in self.results or STOCK in self.failures
        rows = []
        for name, result in self.results.items():
            report = per_batch_report(result.reports, result.best.num_batches)
            planning: list[float] = [p.metadata["planning_time_s"] for p in result.plans
                                     if p.metadata.get("planning_time_s")]
            rows.append(StrategyRow(
                strategy=name, layout=result.parallel.describe(), report=report,
                planning_time_s=sum(planning) / len(planning) if planning else None,
                reference=reference.mean_iteration_time_s if reference else None,
                stock=stock.mean_iteration_time_s if stock else None, with_stock=with_stock, markdown=markdown,
            ))
        return rows

    def table(self, fmt: str = "markdown", wide: bool = True) -> str:
        """The rows as Markdown (`wide=False`: the compact columns) or CSV (every figure)."""
        return comparison_table(self.rows(markdown=fmt == "markdown"), fmt, wide=wide)

    def fastest_other(self, strategy: str = "slimpack") -> str | None:
        """The fastest of `strategy`'s competitors (`competitors`: megatron-stock and `strategy`'s
        own variants left out) that has a layout; None if there is none."""
        others = competitors(self.results, strategy)
        return min(others, key=lambda name: self.results[name].mean_iteration_time_s) if others else None

    def headline(self, strategy: str = "slimpack") -> str | None:
        """`strategy`'s speedups: over megatron-fixed, over the fastest other strategy and over
        megatron-stock, those the comparison has; None without `strategy` or any of them."""
        mine = self.results.get(strategy)
        if mine is None:
            return None
        seconds = mine.mean_iteration_time_s
        parts = []
        if strategy != REFERENCE and REFERENCE in self.results:
            parts.append(f"{self.results[REFERENCE].mean_iteration_time_s / seconds:.2f}x over {REFERENCE} "
                         "(per-document attention)")
        other = self.fastest_other(strategy)
        if other is not None:
            parts.append(f"{self.results[other].mean_iteration_time_s / seconds:.2f}x over the fastest other "
                         f"strategy ({other})")
        if strategy != STOCK and STOCK in self.results:
            parts.append(f"{self.results[STOCK].mean_iteration_time_s / seconds:.2f}x over {STOCK} "
                         "(cross-document attention, a different training semantic)")
        return f"{strategy}: " + ", ".join(parts) if parts else None

    def footer(self, wide: bool = True) -> list[str]:
        """The lines under the table: where its seconds come from and what its abbreviated headers mean."""
        legend = comparison_legend(wide)
        return ([figures_source(self.cost_model)] if self.cost_model else []) + ([legend] if legend else [])

    def notes(self) -> list[str]:
        return self._remarks() + [f"Gantt chart: {path}" for path in self.gantt_files]

    def _remarks(self) -> list[str]:
        """Strategies without a feasible layout, the references and what they train, how to run a
        base-merge layout in Megatron, and SlimPack's speedups."""
        lines = list(self.workload_notes)
        lines += [f"{name}: no feasible layout ({reason})" for name, reason in self.failures.items()]
        lines += [f"{name}: unfinished ({why}); no row" for name, why in self.unfinished.items()]
        lines += [f"{name}: not searched yet" for name in self.pending]
        lines += [f"{name} is a reference, left out of the fastest other strategy: "
                  f"{strategy_spec(name).different_semantics}"
                  + (f"; the '{STOCK_HEADER}' column is each strategy's speedup over it" if name == STOCK else "")
                  for name in self.results if is_reference(name)]
        lines += [f"{name}: cp{r.parallel.cp} is its base merge; run it with --context-parallel-size 1, "
                  f"{r.parallel.dp * r.parallel.cp} data-parallel replicas and --slimpack-base-merge {r.parallel.cp}"
                  for name, r in self.results.items() if strategy_spec(name).cp_is_base_merge and r.parallel.cp > 1]
        lines += ["overlaps priced: " + "; ".join(overlap_note(name) for name in self.results)] if self.results else []
        lines += self._tuning_notes()
        lines += self._steady_state_notes()
        headline = self.headline() if len(self.results) > 1 else None
        return lines + ([headline] if headline else []) + self.explanations

    def steady_states(self) -> dict[str, dict]:
        """`steady_state` of each strategy that delays documents to a final flush."""
        figures = {name: steady_state(result) for name, result in self.results.items()}
        return {name: figure for name, figure in figures.items() if figure is not None}

    def _tuning_notes(self) -> list[str]:
        """What each strategy with settings of its own tuned them to, and how to train with that."""
        notes = (tuning_note(name, result) for name, result in self.results.items())
        return [note for note in notes if note]

    def _steady_state_notes(self) -> list[str]:
        reference = self.results.get(REFERENCE)
        lines = []
        for name, figure in self.steady_states().items():
            speedup = (f" ({reference.mean_iteration_time_s / figure['iteration_s']:.2f}x over {REFERENCE})"
                       if reference and name != REFERENCE else "")
            lines.append(
                f"{name} delays documents across steps: {figure['flush_tokens']:,} tokens still queued after its "
                f"{figure['steps']} step(s) train in a final flush ({figure['flush_s']:.3f} s), counted in its mean; "
                f"at its steady-state rate (tokens per second over the planned steps, the flush left out) a global "
                f"batch takes {figure['iteration_s']:.3f} s{speedup}, optimistic until its queues release as many "
                "documents as arrive (more --steps)")
        return lines

    def markdown_document(self, wide: bool = True) -> str:
        """The comparison as Markdown to paste into a page: the table, its footer lines (a paragraph
        each), the notes as a list (plain lines would run together into one paragraph) and each
        Gantt chart as an image."""
        parts = [self.table("markdown", wide=wide), *(line + "\n" for line in self.footer(wide))]
        remarks = self._remarks()
        if remarks:
            parts.append("\n".join(f"- {line}" for line in remarks) + "\n")
        parts += [f"![{Path(path).stem} Gantt chart]({path})\n" for path in self.gantt_files]
        return "\n".join(parts)

    def to_dict(self) -> dict:
        return {
            "rows": [row.values() for row in self.rows()],
            "layouts": {name: result.to_dict() for name, result in self.results.items()},
            "failures": self.failures,
            # strategies that train a different semantic (megatron-stock), with what they train
            "references": {name: strategy_spec(name).different_semantics
                           for name in self.results if is_reference(name)},
            "fastest_other": self.fastest_other(),  # SlimPack's fastest competitor (references left out)
            # the communication each strategy's real run overlaps, as priced, with its Megatron flags
            "overlaps": {name: strategy_spec(name).overlaps.to_dict() for name in self.results},
            "objectives": {name: objective(name) for name in self.results},
            # strategies stopped before their search was final (no row), and why
            "unfinished": self.unfinished,
            "pending": self.pending,  # not searched yet: only in a file written while the comparison runs
            "cached": self.cached,  # results read from the search cache
            "explanations": self.explanations,  # why SlimPack is slower than a competitor, where it is
            "cost_model": self.cost_model,  # what every row is priced with: model, hardware, source
            "workload_notes": self.workload_notes,  # documents longer than the context split or left out
            # a strategy that delays documents to a final flush: its figures with the flush left out
            "steady_state": self.steady_states(),
        }


def steady_state(result: LayoutResult) -> dict | None:
    """A strategy that delays documents across steps (WLB-LLM's outlier queues) trains what is
    still delayed after the last batch in a final flush, which its mean counts. Its steady-state
    figures leave the flush out: tokens trained per second over the planned steps, and the seconds
    a global batch takes at that rate. Over few steps the queues may not yet release as many
    documents as arrive, so the steps hold fewer long documents than steady state would and the
    rate is optimistic. None for a strategy without a flush."""
    evaluation = result.best
    steps = evaluation.num_batches
    planned, flush = evaluation.reports[:steps], evaluation.reports[steps:]
    if not flush:
        return None
    rate = per_batch_report(planned, steps).tokens_per_s
    tokens_per_batch = sum(report.num_tokens for report in evaluation.reports) / steps
    return {"steps": steps, "tokens_per_s": rate, "iteration_s": tokens_per_batch / rate,
            "flush_s": sum(report.iteration_time_s for report in flush),
            "flush_tokens": sum(report.num_tokens for report in flush)}


def resolve_strategies(text: str) -> list[str]:
    known = strategy_names()
    if text == "all":
        ordered = [REFERENCE] + [n for n in known if n != REFERENCE]
        return [n for n in ordered if n in known]
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise PlanError(f"--strategies {text!r} names no strategy; give 'all' or some of: {', '.join(known)}")
    unknown = [n for n in names if n not in known]
    if unknown:
        raise PlanError(f"unknown strategies {unknown}; known: {', '.join(known)}")
    return names


class CompareStopped(Exception):
    """Raised through a layout search to stop it: the comparison's time budget is spent."""


def run_comparison(
    *, workload: str, model: str, hardware: str, cost: CostModel, gpus: int, context_length: int | None = None,
    global_batch_size: int, steps: int = 1, strategies: str = "all", seed: int | None = None,
    solver_time_limit_s: float | None = None, solver_deterministic_limit: float | None = None,
    config: SlimPackConfig | None = None, long_documents: str | None = None, gantt_dir: str | None = None,
    show_progress: bool | str | CompareProgress = True,
    batches: list[list[int]] | None = None, time_budget_s: float | None = None,
    cache: "SearchCache | None" = None, on_update: Callable[[ComparisonResult], None] | None = None,
    workers: int = 1,
) -> ComparisonResult:
    """Every strategy of `strategies` in its best layout of `gpus` GPUs on the same batches.
    `workers` > 1: the strategies not in the cache are searched in that many processes at once
    (`_search_in_parallel`); each search is the same as alone, so the result is too.
    `config`: the planners' configuration (its strategy is each one's in turn; default
    `SlimPackConfig()`); `context_length`, `seed`, `long_documents` (what the sampler makes of a
    document longer than the context: `GlobalBatchSampler`) and the solver limits, where given,
    replace its. Batches drawn here (`batches` None) that split or left out documents say so in the
    notes (`workload_notes`).

    `show_progress`: True for `CompareProgress`'s choice (a bar on a terminal, log lines
    otherwise), False for nothing, one of its modes, or a `CompareProgress`. `cache`: where search results are kept and
    looked up (None: every strategy is searched). `on_update` gets the result after each strategy
    is final (and once at the start, every strategy pending). Ctrl-C or `time_budget_s` seconds
    stop the search: the strategy being searched and those not started are `unfinished` (cached
    results are still read after the budget is spent, not after Ctrl-C)."""
    given = dict(context_length=context_length, seed=seed, solver_time_limit_s=solver_time_limit_s,
                 solver_deterministic_limit=solver_deterministic_limit, long_documents=long_documents)
    config = (config or SlimPackConfig()).with_(**{name: value for name, value in given.items() if value is not None})
    context_length, seed = config.context_length, config.seed
    workload_notes = []
    if batches is None:
        lengths = load_lengths(workload, seed=seed)
        drawn = draw_global_batches(lengths, context_length, global_batch_size, steps, seed, config.long_documents)
        batches = [batch.lengths for batch in drawn]
        note = long_document_note(drawn, lengths, context_length)
        workload_notes = [f"{workload}: {note}"] if note else []
    names = resolve_strategies(strategies)
    result = ComparisonResult({}, pending=list(names), cost_model=cost.describe(), workload_notes=workload_notes)
    display = show_progress if isinstance(show_progress, CompareProgress) else CompareProgress(
        show_progress if isinstance(show_progress, str) else "auto" if show_progress else "off")
    started = time.monotonic()
    deadline = None if time_budget_s is None else started + time_budget_s
    stopped: str | None = None  # why the comparison stopped early

    def tell(progress: SearchProgress) -> None:
        display.update(progress)
        if deadline is not None and time.monotonic() > deadline:
            raise CompareStopped(f"the time budget of {time_budget_s:g} s was spent")

    if on_update:
        on_update(result)
    if workers > 1 and len(names) > 1:
        _search_in_parallel(names, result, display, workers, batches, cost, gpus, context_length, config, cache,
                            deadline, time_budget_s, on_update)
        stopped = "interrupted (Ctrl-C)" if any("Ctrl-C" in why for why in result.unfinished.values()) else None
        names = []  # searched
    with display:
        index, name = 0, ""
        try:
            for index, name in enumerate(names):
                cached, key = _read_cached(result, display, cache, name, index, len(names),
                                           (batches, cost, gpus, context_length, config))
                if cached:
                    pass  # recorded from the cache
                elif stopped is not None or (deadline is not None and time.monotonic() > deadline):
                    stopped = stopped or f"the time budget of {time_budget_s:g} s was spent"
                    result.unfinished[name] = f"not searched: {stopped}"
                else:
                    display.strategy_started(name, index, len(names), gpus)
                    try:
                        outcome = _search(name, batches, cost, gpus, context_length, config, tell)
                    except CompareStopped as why:
                        stopped = str(why)
                        result.unfinished[name] = f"search stopped: {stopped}"
                        display.strategy_done(name, index, len(names), "unfinished")
                    else:
                        _record(result, name, outcome)
                        if cache and key and not isinstance(outcome, str):
                            cache.store(key, name, outcome)
                        display.strategy_done(name, index, len(names), _outcome(result, name))
                if on_update:
                    on_update(result)
        except KeyboardInterrupt:
            # Ctrl-C, wherever it came: the strategy at hand and those after it are unfinished (a
            # result it already has stays), nothing more is read or searched.
            stopped = "interrupted (Ctrl-C)"
            if name and not any(name in done for done in (result.results, result.failures, result.unfinished)):
                result.unfinished[name] = f"search stopped: {stopped}"
                display.strategy_done(name, index, len(names), "unfinished")
            result.unfinished.update({rest: f"not searched: {stopped}" for rest in result.pending})
            result.pending.clear()
            if on_update:
                on_update(result)
    result.explanations = why_slower(result, cost)
    if gantt_dir and stopped != "interrupted (Ctrl-C)":
        _write_gantts(result, cost, Path(gantt_dir))
    return result


def why_slower(result: ComparisonResult, cost: CostModel, strategy: str = "slimpack") -> list[str]:
    """One line per competitor faster than `strategy`, saying where its time goes: the same plans
    priced with `strategy`'s overlaps (what its runtime hides that `strategy`'s cannot) and the
    attention pairs each trains per step (documents cut at sequence boundaries lose their prefix);
    then where `strategy`'s own step goes idle (what its plans lose to bubbles and stragglers).
    Empty where `strategy` is fastest or has no row."""
    mine = result.results.get(strategy)
    if mine is None:
        return []
    own_overlaps = strategy_spec(strategy).overlaps
    idle = statistics.mean(report.bubble_ratio for report in mine.reports)
    straggler = statistics.mean(report.dp_imbalance for report in mine.reports) - 1
    own = (f"{strategy}'s devices idle {idle:.1%} of its step (pipeline bubbles and waits; its busiest rank "
           f"computes {straggler:.1%} more than the mean)")
    lines = []
    for name in competitors(result.results, strategy):
        theirs = result.results[name]
        if theirs.mean_iteration_time_s >= mine.mean_iteration_time_s or not theirs.plans:
            continue
        repriced = sum(simulate(plan, cost, detail=False, overlaps=own_overlaps).iteration_time_s
                     for plan in theirs.plans) / theirs.best.num_batches
        pairs = sum(_attention_pairs(plan) for plan in theirs.plans) / sum(_attention_pairs(p) for p in mine.plans)
        because = []
        if strategy_spec(name).overlaps != own_overlaps:
            outcome = ("slower: it wins by the communication its runtime hides"
                       if repriced >= mine.mean_iteration_time_s else "still faster")
            because.append(f"priced with {strategy}'s overlaps ({_overlap_words(strategy)}) its plans take "
                           f"{repriced:.3f} s, {outcome}")
        if pairs < 0.995:
            because.append(f"it computes {pairs:.1%} of {strategy}'s attention pairs ({objective(name)})")
        because = because or ["on the same overlaps and objective: a plan its search did not find"]
        lines.append(f"{strategy} is slower than {name} ({mine.mean_iteration_time_s:.3f} s vs "
                     f"{theirs.mean_iteration_time_s:.3f} s): " + "; ".join(because + [own]))
    return lines


def _attention_pairs(plan: Plan) -> float:
    return float(sum(micropack.attention_pairs for replica in plan.replicas for micropack in replica.micropacks))


def _search_in_parallel(names: list[str], result: ComparisonResult, display: "CompareProgress", workers: int,
                        batches, cost: CostModel, gpus: int, context_length: int, config: SlimPackConfig,
                        cache: "SearchCache | None", deadline: float | None, time_budget_s: float | None,
                        on_update: Callable[[ComparisonResult], None] | None) -> None:
    """The strategies of `names` searched in `workers` processes (spawned: CP-SAT's threads do not
    survive a fork), cached ones read first; each worker searches one strategy at a time. Rows are
    recorded in `names` order whatever order the searches end in, so the result is the serial
    one's. The time budget or Ctrl-C terminates the workers: the strategies not ended are
    unfinished."""
    count = len(names)
    todo: list[tuple[int, str, str | None]] = []  # (index, name, cache key) of those to search
    for index, name in enumerate(names):
        cached, key = _read_cached(result, display, cache, name, index, count,
                                   (batches, cost, gpus, context_length, config))
        if not cached:
            todo.append((index, name, key))
    if on_update:
        on_update(result)
    if not todo:
        return
    pool = ProcessPoolExecutor(min(workers, len(todo)), mp_context=multiprocessing.get_context("spawn"),
                               initializer=ignore_library_warnings)
    stopped: str | None = None
    # The longest searches first (SlimPack's, which plan every replica; stateful ones, which run
    # every screened layout on every batch), so the last to start are short.
    todo.sort(key=lambda entry: (not strategy_spec(entry[1]).sizes_to_memory, not strategy_spec(entry[1]).stateful))
    try:
        running = {name: (index, key, pool.submit(_search, name, batches, cost, gpus, context_length, config))
                   for index, name, key in todo}
        for index, name, _ in todo:
            display.strategy_started(name, index, count, gpus)
        while running:
            timeout = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            done, _ = wait([job for _, _, job in running.values()], timeout=timeout, return_when=FIRST_COMPLETED)
            if not done:
                stopped = f"the time budget of {time_budget_s:g} s was spent"
                break
            for name in [name for name, (_, _, job) in running.items() if job in done]:
                index, key, job = running.pop(name)
                outcome = job.result()  # a worker that died raises BrokenProcessPool here
                _record(result, name, outcome)
                if cache and key and not isinstance(outcome, str):
                    cache.store(key, name, outcome)
                display.strategy_done(name, index, count, _outcome(result, name))
                if on_update:
                    on_update(result)
    except KeyboardInterrupt:
        stopped = "interrupted (Ctrl-C)"
    finally:
        # A search cannot be cancelled once running: its worker is terminated (the executor has no
        # public way to do it before Python 3.14's terminate_workers).
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
    for name in [name for _, name, _ in todo if name not in result.results and name not in result.failures]:
        result.unfinished[name] = f"search stopped: {stopped}"
    order = {name: index for index, name in enumerate(names)}
    result.results = dict(sorted(result.results.items(), key=lambda item: order[item[0]]))
    result.failures = dict(sorted(result.failures.items(), key=lambda item: order[item[0]]))
    if on_update and stopped:
        on_update(result)


def _read_cached(result: ComparisonResult, display: "CompareProgress", cache: "SearchCache | None", name: str,
                 index: int, count: int, inputs: tuple) -> tuple[bool, str | None]:
    """Take `name` off the pending list and record its search from the cache where it is there.
    Returns whether it was, and its cache key (None without a cache). `inputs`: the search's
    (batches, cost, gpus, context_length, config)."""
    result.pending.remove(name)
    key = cache.key(name, *inputs) if cache else None
    hit = cache.load(key) if cache and key else None
    if hit is None:
        return False, key
    _record(result, name, hit)
    result.cached.append(name)
    display.strategy_done(name, index, count, _outcome(result, name) + " (cached)")
    return True, key


def _search(name: str, batches, cost: CostModel, gpus: int, context_length: int, config: SlimPackConfig,
            tell: Callable[[SearchProgress], None] | None = None) -> LayoutResult | NoFeasibleLayout | str:
    """One strategy's layout search, its own settings then tuned on the layout found where it has
    any (`planner.tuning`: each strategy in its best configuration): its result,
    NoFeasibleLayout, or the message of another PlanError (the strategy cannot plan these inputs
    at all)."""
    try:
        found = best_layout(name, batches, cost, gpus, context_length, config, finalists=search_finalists(name),
                            progress=tell)
        return _best_plans_only(tuned(name, found, batches, cost, config.with_(context_length=context_length)))
    except NoFeasibleLayout as error:
        return error
    except PlanError as error:
        return str(error)


def _best_plans_only(found: LayoutResult) -> LayoutResult:
    """`found` with the plans of its best layout only; the other finalists keep their reports
    (their means). A comparison reads the best's plans (rows, explanations, charts) and nothing
    else, while a worker's result is pickled back and a cached one written whole: at 7B 256K on
    128 GPUs the three finalists' plans of one strategy pickle to 66-78 MB, seconds to load."""
    finalists = [evaluation if evaluation is found.best else dataclasses.replace(evaluation, plans=[])
                 for evaluation in found.finalists]
    return dataclasses.replace(found, finalists=finalists)


def _record(result: ComparisonResult, name: str, outcome: LayoutResult | NoFeasibleLayout | str) -> None:
    if isinstance(outcome, LayoutResult):
        result.results[name] = outcome
    elif isinstance(outcome, NoFeasibleLayout):
        result.failures[name] = str(outcome).splitlines()[0]
    else:
        result.failures[name] = outcome


def _outcome(result: ComparisonResult, name: str) -> str:
    """A strategy's final outcome in a few words, for the progress display."""
    if name in result.results:
        found = result.results[name]
        return f"{found.parallel.describe()}, {found.mean_iteration_time_s:.3f} s/iteration"
    return f"no feasible layout ({result.failures.get(name, '?')})"


# ==== progress ==================================================================================


def _clock(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class CompareProgress:
    """What a comparison shows on `stream` (stderr) while it searches. Modes: "bar" (a tqdm bar
    where tqdm is installed, else one line redrawn with a carriage return: strategy, phase,
    layouts done/total, best so far, elapsed and ETA), "log" (one line as each strategy and each
    search phase starts and as each strategy ends: what a log file or a pipe can hold), "off"
    (nothing) and "auto" (a bar on a terminal, log lines otherwise). A context manager: the bar
    is cleared on exit."""

    def __init__(self, mode: str = "auto", stream: IO[str] | None = None):
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "log"
        if mode not in ("bar", "log", "off"):
            raise ValueError(f"progress mode {mode!r}: use bar, log, off or auto")
        self.mode = mode
        self.label = ""
        self.phase: tuple[str, str] | None = None  # (strategy, phase) of the current bar
        self.bar: Any = None  # the tqdm bar of the current phase
        self.line_width = 0  # of the carriage-return line drawn last
        self.best_s: float | None = None  # the best so far: of the current phase once it has one
        self.phase_began_s = 0.0  # the search's elapsed time when the current phase began

    def __enter__(self) -> "CompareProgress":
        return self

    def __exit__(self, *exc) -> None:
        self._clear()

    def strategy_started(self, name: str, index: int, count: int, gpus: int) -> None:
        self.label, self.best_s = f"[{index + 1}/{count}] {name}", None
        if self.mode == "log":
            self._log(f"[compare] {name}: searching layouts for {gpus} GPUs ...")

    def update(self, progress: SearchProgress) -> None:
        if self.mode == "off":
            return
        if progress.best_s is not None:  # the phase's best: first-batch times, then means
            self.best_s = progress.best_s
        phase = (progress.strategy, progress.phase)
        new_phase = progress.done == 0 or phase != self.phase
        if new_phase and self.mode == "bar":
            self._clear()  # the last phase's bar
        if new_phase:
            self.phase_began_s = progress.elapsed_s
        self.phase = phase
        if self.mode == "log":
            if new_phase:
                what = (f"the first batch on {progress.total} of {progress.candidates} layouts"
                        if progress.phase == "screening" else f"every batch on the {progress.total} fastest layouts")
                self._log(f"[compare] {progress.strategy}: {progress.phase}: {what}, {_clock(progress.elapsed_s)} in"
                          + (f", best so far {self.best_s:.3f} s" if self.best_s is not None else ""))
            return
        best = f"best {self.best_s:.3f} s" if self.best_s is not None else "best -"
        if _tqdm() is not None:
            if self.bar is None:
                self.bar = _tqdm()(total=progress.total, desc=f"{self.label} {progress.phase}", unit="layout",
                                   file=self.stream, leave=False, dynamic_ncols=True)
            self.bar.total = max(progress.total, progress.done)
            self.bar.set_postfix_str(f"{best}, strategy {_clock(progress.elapsed_s)}", refresh=False)
            self.bar.update(progress.done - self.bar.n)
            return
        rate = (progress.elapsed_s - self.phase_began_s) / progress.done if progress.done else None
        eta = _clock(rate * (progress.total - progress.done)) if rate is not None else "?"
        self._draw(f"{self.label} {progress.phase} {progress.done}/{progress.total} layouts, {best}, "
                   f"elapsed {_clock(progress.elapsed_s)}, ETA {eta}")

    def strategy_done(self, name: str, index: int, count: int, outcome: str) -> None:
        if self.mode == "off":
            return
        self._clear()
        self._log(f"[compare] [{index + 1}/{count}] {name}: {outcome}")

    def _draw(self, line: str) -> None:
        self.stream.write("\r" + line.ljust(self.line_width))
        self.stream.flush()
        self.line_width = len(line)

    def _clear(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.line_width:
            self.stream.write("\r" + " " * self.line_width + "\r")
            self.stream.flush()
            self.line_width = 0
        self.phase = None

    def _log(self, line: str) -> None:
        print(line, file=self.stream, flush=True)


@lru_cache(maxsize=1)
def _tqdm():
    """tqdm's bar class, None where tqdm is not installed (the bar is then one plain line)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm


# ==== partial results on disk ===================================================================


def write_outputs(result: ComparisonResult, path: str | Path, wide: bool = True) -> list[Path]:
    """`result` as JSON at `path`, or with a .md suffix as a Markdown document there and JSON next
    to it (the .json suffix). Each file is replaced whole (written aside, then renamed), so a
    reader, or a Ctrl-C, never sees half of one. Returns the files written."""
    path = Path(path)
    written = []
    if path.suffix.lower() == ".md":
        _replace(path, result.markdown_document(wide=wide) if result.results else "\n".join(
            f"- {line}" for line in result.notes()) + "\n")
        written.append(path)
        path = path.with_suffix(".json")
    _replace(path, json.dumps(result.to_dict(), indent=1, default=float) + "\n")
    return [*written, path]


def _replace(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    aside.write_text(text)
    os.replace(aside, path)


# ==== the search cache ==========================================================================

CACHE_FORMAT = 1
# What the search's result depends on in this package's code: the cost model, the planners and the
# layout search, the simulator, plans, the specs and the configuration. A change to any of them
# gives new cache keys.
PLANNING_SOURCES = ("costmodel", "planner", "simulator", "plan", "specs.py", "config.py", "errors.py")
# `best_layout`'s search options as `run_comparison` calls it, part of every key. A stateful
# strategy runs every layout that could still be among its `finalists` fastest means on every
# batch, so its finalists beyond the first only widen what it runs, and a comparison reads the best
# alone: asked for one, it prunes against the best mean and finds the same best (WLB-LLM at llama-7b
# 64K Wikipedia on 128 GPUs, 10 batches: 156 s -> 88 s). The others' finalists are the layouts
# fastest on the first batch that run every batch, which decides their best.
FINALISTS, STATEFUL_FINALISTS = 3, 1
SEARCH_OPTIONS = {"finalists": FINALISTS, "stateful_finalists": STATEFUL_FINALISTS, "recompute_cascade": True,
                  "layouts": "enumerated"}


def search_finalists(strategy: str) -> int:
    """The `finalists` a comparison's search of `strategy` runs with (`SEARCH_OPTIONS`)."""
    return STATEFUL_FINALISTS if strategy_spec(strategy).stateful else FINALISTS


def cache_dir() -> Path:
    """Where comparison search results are cached: $XDG_CACHE_HOME (default ~/.cache)/megatron-slimpack/compare."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megatron-slimpack" / "compare"


@lru_cache(maxsize=1)
def code_version() -> str:
    """This package's version and a hash of the planning code (`PLANNING_SOURCES`)."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for entry in PLANNING_SOURCES:
        files = sorted((root / entry).rglob("*.py")) if (root / entry).is_dir() else [root / entry]
        for path in files:
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{__version__}+{digest.hexdigest()[:16]}"


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=repr).encode()).hexdigest()


class SearchCache:
    """Each strategy's layout search result (or its "no feasible layout"), one gzipped JSON file
    per key under `directory` (default `cache_dir()`). The key covers every input of the search:
    the batches' lengths (so the workload, its seed, the steps, context length and global batch
    size), the cost model's full content (model, hardware, coefficients; a profile by content),
    the planner configuration (seed and solver limits included), the GPU count, the strategy,
    the search options and the planning code's version. A result is kept whole: its plans and
    reports rebuild exactly what the table, the notes, the JSON and the Gantt charts use.
    `hits` and `misses` count look-ups."""

    def __init__(self, directory: str | Path | None = None):
        self.directory = Path(directory) if directory is not None else cache_dir()
        self.hits = self.misses = 0

    def key(self, strategy: str, batches: list[list[int]], cost: CostModel, gpus: int, context_length: int,
            config: SlimPackConfig) -> str:
        inputs = {
            "format": CACHE_FORMAT, "code": code_version(), "strategy": strategy, "gpus": gpus,
            "context_length": context_length, "batches": _digest(batches),
            "cost": _digest(cost.to_profile_dict()), "overlaps": repr(cost.overlaps),
            "config": dataclasses.asdict(config),
            "search": SEARCH_OPTIONS,
        }
        return f"{strategy}-{_digest(inputs)[:32]}"

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json.gz"

    def load(self, key: str) -> LayoutResult | NoFeasibleLayout | None:
        """The stored outcome, None when there is none (or it cannot be read: searched again)."""
        path = self.path(key)
        try:
            with gzip.open(path, "rt") as file:
                data = json.load(file)
            outcome = _outcome_from_json(data)
        except FileNotFoundError:
            self.misses += 1
            return None
        except (OSError, ValueError, KeyError, TypeError, PlanError):
            self.misses += 1  # a partial or older file: searched again, then overwritten
            return None
        self.hits += 1
        return outcome

    def store(self, key: str, strategy: str, outcome: LayoutResult | NoFeasibleLayout) -> None:
        """Keep `outcome`; a cache that cannot be written is left alone (the comparison goes on)."""
        path = self.path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            aside = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            with gzip.open(aside, "wt", compresslevel=3) as file:
                json.dump(_outcome_to_json(strategy, outcome), file, default=float)
            os.replace(aside, path)
        except OSError as error:
            print(f"[compare] warning: search cache not written ({error})", file=sys.stderr)


def _evaluation_to_json(evaluation: LayoutEvaluation) -> dict:
    return {"parallel": evaluation.parallel.to_dict(), "plans": [plan.to_dict() for plan in evaluation.plans],
            "reports": [report.to_dict() for report in evaluation.reports], "num_batches": evaluation.num_batches}


def _evaluation_from_json(data: dict) -> LayoutEvaluation:
    return LayoutEvaluation(ParallelConfig.from_dict(data["parallel"]), [Plan.from_dict(p) for p in data["plans"]],
                            [SimulationReport.from_dict(r) for r in data["reports"]], int(data["num_batches"]))


def _rejection_to_json(rejection: Rejection) -> list:
    return [rejection.parallel.to_dict(), rejection.kind, rejection.reason]


def _rejection_from_json(data: list) -> Rejection:
    return Rejection(ParallelConfig.from_dict(data[0]), str(data[1]), str(data[2]))


def _outcome_to_json(strategy: str, outcome: LayoutResult | NoFeasibleLayout) -> dict:
    if isinstance(outcome, NoFeasibleLayout):
        return {"format": CACHE_FORMAT, "strategy": strategy, "no_feasible_layout": str(outcome),
                "rejected": [_rejection_to_json(r) for r in outcome.rejected]}
    best = next((i for i, e in enumerate(outcome.finalists) if e is outcome.best), None)
    return {
        "format": CACHE_FORMAT, "strategy": outcome.strategy, "gpus": outcome.gpus,
        # the best evaluation: its index among the finalists (where the search puts it), else whole
        "best": best if best is not None else _evaluation_to_json(outcome.best),
        "finalists": [_evaluation_to_json(e) for e in outcome.finalists],
        "screened": [[parallel.to_dict(), seconds] for parallel, seconds in outcome.screened],
        "rejected": [_rejection_to_json(r) for r in outcome.rejected],
        "search_time_s": outcome.search_time_s, "candidates": outcome.candidates,
    }


def _outcome_from_json(data: dict) -> LayoutResult | NoFeasibleLayout:
    if data.get("format") != CACHE_FORMAT:
        raise ValueError(f"cache format {data.get('format')!r}")
    if "no_feasible_layout" in data:
        return NoFeasibleLayout(data["no_feasible_layout"], [_rejection_from_json(r) for r in data["rejected"]])
    finalists = [_evaluation_from_json(e) for e in data["finalists"]]
    best = _evaluation_from_json(data["best"]) if isinstance(data["best"], dict) else finalists[int(data["best"])]
    return LayoutResult(
        strategy=data["strategy"], gpus=int(data["gpus"]), best=best, finalists=finalists,
        screened=[(ParallelConfig.from_dict(p), float(t)) for p, t in data["screened"]],
        rejected=[_rejection_from_json(r) for r in data["rejected"]],
        search_time_s=float(data["search_time_s"]), candidates=int(data["candidates"]),
    )


def _write_gantts(result: "ComparisonResult", cost, directory: Path) -> None:
    """One chart per strategy (its first step), on one shared time axis so they compare side by side."""
    directory.mkdir(parents=True, exist_ok=True)
    detailed = {name: simulate(layout.plans[0], cost) for name, layout in result.results.items()}
    horizon = max((report.iteration_time_s for report in detailed.values()), default=None)
    for name, report in detailed.items():
        path = directory / f"{name}.png"
        layout = result.results[name]
        title = gantt_title(name, layout.parallel.describe(), model=cost.model.name,
                            context_length=layout.plans[0].context_length, iteration_s=report.iteration_time_s,
                            hardware=cost.hardware.name, step=0)
        write_gantt(report, path, title=title, horizon_s=horizon)
        result.gantt_files.append(str(path))
