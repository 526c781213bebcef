"""Side-by-side comparison: every strategy on the same batches, cost model and simulator, each in
its own best memory-feasible layout for the same GPU count (`slimpack compare`)."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from .config import SlimPackConfig
from .costmodel import CostModel
from .plan import PlanError
from .simulator import per_batch_report, simulate
from .simulator.report import ComparisonRow, comparison_table, write_gantt
from .solver.layouts import LayoutResult, NoFeasibleLayout, best_layout
from .solver.strategies import strategy_names, strategy_spec

REFERENCE = "megatron-fixed"


@dataclass
class ComparisonResult:
    results: dict[str, LayoutResult]
    failures: dict[str, str] = field(default_factory=dict)
    gantt_files: list[str] = field(default_factory=list)

    def rows(self) -> list[ComparisonRow]:
        reference = self.results.get(REFERENCE)
        rows = []
        for name, result in self.results.items():
            report = per_batch_report(result.reports, result.best.num_batches)
            planning = [p.metadata.get("planning_time_s") for p in result.plans if p.metadata.get("planning_time_s")]
            rows.append(ComparisonRow(
                strategy=name, layout=result.parallel.describe(), report=report,
                planning_time_s=sum(planning) / len(planning) if planning else None,
                reference=reference.mean_iteration_time_s if reference else None,
            ))
        return rows

    def table(self, fmt: str = "markdown") -> str:
        return comparison_table(self.rows(), fmt)

    def notes(self) -> list[str]:
        return self._remarks() + [f"Gantt chart: {path}" for path in self.gantt_files]

    def _remarks(self) -> list[str]:
        """Strategies without a feasible layout, and how to run a base-merge layout in Megatron."""
        lines = [f"{name}: no feasible layout ({reason})" for name, reason in self.failures.items()]
        lines += [f"{name}: cp{r.parallel.cp} is its base merge; run it with --context-parallel-size 1, "
                  f"{r.parallel.dp * r.parallel.cp} data-parallel replicas and --slimpack-base-merge {r.parallel.cp}"
                  for name, r in self.results.items() if strategy_spec(name).cp_is_base_merge and r.parallel.cp > 1]
        return lines

    def markdown_document(self) -> str:
        """The comparison as Markdown to paste into a page: the table, the notes as a list (plain
        lines would run together into one paragraph) and each Gantt chart as an image."""
        parts = [self.table("markdown")]
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
        from .workload import GlobalBatchSampler, load_lengths

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
        Path(gantt_dir).mkdir(parents=True, exist_ok=True)
        for name, layout in result.results.items():
            detailed = simulate(layout.plans[0], cost)
            path = Path(gantt_dir) / f"{name}.png"
            write_gantt(detailed, path, title=f"{name} {layout.parallel.describe()} step 0")
            result.gantt_files.append(str(path))
    return result
