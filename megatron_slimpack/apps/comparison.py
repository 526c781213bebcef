"""Side-by-side comparison: every strategy on the same batches, cost model and simulator, each in
its own best memory-feasible layout for the same GPU count (`slimpack compare`).

Speedups are over megatron-fixed (Megatron-LM's fixed-length packing with per-document
attention). A strategy that trains a different semantic (`StrategySpec.different_semantics`:
megatron-stock, stock `pretrain_gpt.py`, whose sequences attend across document boundaries) is a
reference: its row is labelled in the notes, every row also gets its speedup over megatron-stock
(what a user switching from stock Megatron-LM would see), and it is never "the fastest other
strategy" (`competitors`)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..config import SlimPackConfig
from ..costmodel import CostModel
from ..plan import PlanError
from ..planner.layouts import LayoutResult, NoFeasibleLayout, best_layout
from ..planner.strategies import REGISTRY, strategy_names, strategy_spec
from ..simulator import per_batch_report, simulate
from ..simulator.report import ComparisonRow, comparison_table, write_gantt

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
    tp = "TP hidden behind GEMMs" if overlaps.tp_comm else "TP serial"
    cp = "CP ring overlapped" if overlaps.cp_exchange else "CP gathered before attention"
    return f"{name}: {tp}, {cp} ({' '.join(overlaps.flags()) or 'no overlap flags'})"


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
    results: dict[str, LayoutResult]
    failures: dict[str, str] = field(default_factory=dict)
    gantt_files: list[str] = field(default_factory=list)

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

    def notes(self) -> list[str]:
        return self._remarks() + [f"Gantt chart: {path}" for path in self.gantt_files]

    def _remarks(self) -> list[str]:
        """Strategies without a feasible layout, the references and what they train, how to run a
        base-merge layout in Megatron, and SlimPack's speedups."""
        lines = [f"{name}: no feasible layout ({reason})" for name, reason in self.failures.items()]
        lines += [f"{name} is a reference, left out of the fastest other strategy: "
                  f"{strategy_spec(name).different_semantics}"
                  + (f"; the '{STOCK_HEADER}' column is each strategy's speedup over it" if name == STOCK else "")
                  for name in self.results if is_reference(name)]
        lines += [f"{name}: cp{r.parallel.cp} is its base merge; run it with --context-parallel-size 1, "
                  f"{r.parallel.dp * r.parallel.cp} data-parallel replicas and --slimpack-base-merge {r.parallel.cp}"
                  for name, r in self.results.items() if strategy_spec(name).cp_is_base_merge and r.parallel.cp > 1]
        lines += ["overlaps priced: " + "; ".join(overlap_note(name) for name in self.results)] if self.results else []
        headline = self.headline() if len(self.results) > 1 else None
        return lines + ([headline] if headline else [])

    def markdown_document(self, wide: bool = True) -> str:
        """The comparison as Markdown to paste into a page: the table, the notes as a list (plain
        lines would run together into one paragraph) and each Gantt chart as an image."""
        parts = [self.table("markdown", wide=wide)]
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
        }


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


def run_comparison(
    *, workload: str, model: str, hardware: str, cost: CostModel, gpus: int, context_length: int | None = None,
    global_batch_size: int, steps: int = 1, strategies: str = "all", seed: int | None = None,
    solver_time_limit_s: float | None = None, solver_deterministic_limit: float | None = None,
    config: SlimPackConfig | None = None, gantt_dir: str | None = None, show_progress: bool = True,
    batches: list[list[int]] | None = None,
) -> ComparisonResult:
    """Every strategy of `strategies` in its best layout of `gpus` GPUs on the same batches.
    `config`: the planners' configuration (its strategy is each one's in turn; default
    `SlimPackConfig()`); `context_length`, `seed` and the solver limits, where given, replace its."""
    given = dict(context_length=context_length, seed=seed, solver_time_limit_s=solver_time_limit_s,
                 solver_deterministic_limit=solver_deterministic_limit)
    config = (config or SlimPackConfig()).with_(**{name: value for name, value in given.items() if value is not None})
    context_length, seed = config.context_length, config.seed
    if batches is None:
        from ..workload import GlobalBatchSampler, load_lengths

        sampler = GlobalBatchSampler(load_lengths(workload, seed=seed), context_length, global_batch_size, seed=seed)
        batches = [sampler.next_batch().lengths for _ in range(steps)]
    result = ComparisonResult({})
    for name in resolve_strategies(strategies):
        if show_progress:
            print(f"[compare] {name}: searching layouts for {gpus} GPUs ...", file=sys.stderr, flush=True)
        try:
            result.results[name] = best_layout(name, batches, cost, gpus, context_length, config)
        except NoFeasibleLayout as error:
            result.failures[name] = str(error).splitlines()[0]
        except PlanError as error:
            result.failures[name] = str(error)
    if gantt_dir:
        _write_gantts(result, cost, Path(gantt_dir))
    return result


def _write_gantts(result: "ComparisonResult", cost, directory: Path) -> None:
    """One chart per strategy (its first step), on one shared time axis so they compare side by side."""
    directory.mkdir(parents=True, exist_ok=True)
    detailed = {name: simulate(layout.plans[0], cost) for name, layout in result.results.items()}
    horizon = max((report.iteration_time_s for report in detailed.values()), default=None)
    for name, report in detailed.items():
        path = directory / f"{name}.png"
        write_gantt(report, path, title=f"{name} {result.results[name].parallel.describe()} step 0", horizon_s=horizon)
        result.gantt_files.append(str(path))
