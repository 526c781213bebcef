"""A strategy's own settings, tuned on the layout its search chose: what a comparison runs each
strategy with, so that each is in its best configuration (WLB-LLM's outlier-delay thresholds,
which its paper tunes to the corpus)."""
from __future__ import annotations

from dataclasses import replace

from ..config import SlimPackConfig, delay_fractions
from ..costmodel import CostModel
from ..plan import PlanError
from ..simulator.dag import simulate
from .baselines.wlb_llm import DELAY_CANDIDATES, WlbLlmPlanner
from .layouts import LayoutEvaluation, LayoutResult
from .strategies import cyclic_gc_paused


# The cyclic collector is paused as for the layout search (`strategies.cyclic_gc_paused`): each
# candidate plans every batch, ~10^5 tuples each, and its passes over them are wasted (the tuning at
# llama-7b 64K Wikipedia on 128 GPUs, 10 batches: 54.1 s with it running, 29.6 s paused).
@cyclic_gc_paused()
def tune_delay_fractions(result: LayoutResult, batches: list[list[int]], cost: CostModel,
                         config: SlimPackConfig) -> LayoutResult:
    """WLB-LLM's delay thresholds tuned on the layout its search chose (`result`, its best run with
    the configured thresholds): each other one of `DELAY_CANDIDATES` is run over `batches` and the
    final flush and simulated; the fastest mean wins, the configured ones on a tie. A candidate
    whose plans do not fit memory is left out. Returns `result` with the winner's run as its best;
    every plan of it records the tuning (`delay_tuning`: candidate -> mean seconds, or why not)."""
    parallel = result.parallel
    # the search ran the configured thresholds already
    runs: dict[str, LayoutEvaluation] = {config.wlb_delay_fractions: result.best}
    tuning: dict[str, float | str] = {config.wlb_delay_fractions: float(result.best.mean_iteration_time_s)}
    for text in [text for text in DELAY_CANDIDATES if delay_fractions(text) != config.delay_fractions]:
        planner, tried = WlbLlmPlanner(), config.with_(wlb_delay_fractions=text)
        try:
            plans = [planner.plan(lengths, parallel, cost, tried).validate() for lengths in batches]
            flushed = planner.flush(parallel, cost, tried)
            plans += [flushed.validate()] if flushed is not None else []
        except PlanError as error:
            tuning[text] = f"not planned: {error}"
            continue
        reports = [simulate(plan, cost, detail=False) for plan in plans]
        if not all(report.fits_memory for report in reports):
            tuning[text] = "does not fit memory"
            continue
        runs[text] = LayoutEvaluation(parallel, plans, reports, len(batches))
        tuning[text] = float(runs[text].mean_iteration_time_s)
    best = min(runs.values(), key=lambda run: run.mean_iteration_time_s)  # the first on a tie
    for plan in best.plans:
        plan.metadata["delay_tuning"] = dict(tuning)
    finalists = [best if evaluation is result.best else evaluation for evaluation in result.finalists]
    return replace(result, best=best, finalists=finalists)


def delay_tuning_note(result: LayoutResult) -> str | None:
    """What `tune_delay_fractions` kept for `result` and tried, and the flag that trains with it."""
    metadata = result.plans[0].metadata if result.plans else {}
    tuning = metadata.get("delay_tuning")
    if not tuning:
        return None
    chosen = ",".join(f"{fraction:g}" for fraction in metadata["delay_fractions"])
    tried = "; ".join(f"'{text}' {seconds:.3f} s" if isinstance(seconds, float) else f"'{text}' {seconds}"
                      for text, seconds in tuning.items())
    return (f"delay thresholds '{chosen}' (fractions of the context), the fastest on these batches at its layout "
            f"(mean per batch: {tried}); train it with --slimpack-wlb-delay-fractions '{chosen}'")


# strategy -> its tuner: `tuner(result, batches, cost, config)` returns the search's result with the
# tuned run as its best, the tuning recorded in that run's plans' metadata
TUNERS = {"wlb-llm": tune_delay_fractions}
# strategy -> what its tuning chose, in words (None: its result was not tuned)
TUNING_NOTES = {"wlb-llm": delay_tuning_note}


def tuned(strategy: str, result: LayoutResult, batches: list[list[int]], cost: CostModel,
          config: SlimPackConfig) -> LayoutResult:
    """`result` with `strategy`'s own settings tuned at its layout (`TUNERS`); as it is where the
    strategy has none."""
    tuner = TUNERS.get(strategy)
    return result if tuner is None else tuner(result, batches, cost, config.with_(strategy=strategy))


def tuning_note(strategy: str, result: LayoutResult) -> str | None:
    """"strategy: what its tuning chose and how to train with it", where its result was tuned."""
    describe = TUNING_NOTES.get(strategy)
    note = describe(result) if describe else None
    return f"{strategy}: {note}" if note else None


__all__ = ["tune_delay_fractions", "delay_tuning_note", "TUNERS", "TUNING_NOTES", "tuned", "tuning_note"]
