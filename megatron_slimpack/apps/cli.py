"""The `slimpack` command: plan, simulate, compare (and demo)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from .. import __version__
from ..config import CLI, ConfigError, MegatronIntegrationConfig, SlimPackConfig, add_options, from_options, option_name
from ..costmodel import CostModel
from ..plan import Plan, PlanError
from ..planner import strategies
from ..planner.strategies import check_plan_input, strategy_help, strategy_names
from ..simulator import report as simulator_report
from ..simulator import simulate
from ..simulator.report import (
    figures_source,
    gantt_title,
    legend,
    markdown_table,
    summary,
    write_chrome_trace,
)
from ..specs import HARDWARE, ParallelConfig, SpecError
from ..workload import (
    LONG_DOCUMENT_MODES,
    LongDocumentsError,
    draw_global_batches,
    load_lengths,
    long_document_note,
)
from . import comparison, library_noise
from .cli_options import (
    RECOMPUTE_HELP,
    add_megatron_spellings,
    add_model_option,
    contradictions,
    non_negative_int,
    positive_float,
    positive_int,
    recompute_mode,
    restrict_choices,
)
from .comparison import SearchCache, write_outputs
from .cost import add_cost_arguments, cost_main
from .demo import DemoOptions, run_demo
from .fidelity import add_validate_arguments, validate_main
from .profiler import add_profile_arguments, profile_main
from .selftest import add_selftest_arguments, selftest_main

DEFAULT_WORKLOAD = "text"  # the running Python's standard library: real text, no download


class CliError(Exception):
    pass


# ---- shared options ---------------------------------------------------------------------------

def add_cost_options(parser: argparse.ArgumentParser, *, model: str = "llama-7b"):
    """--model, and --cost-model / --hardware (generated from `MegatronIntegrationConfig`'s fields)."""
    add_model_option(parser, model, f"model preset (default {model})")
    add_options(parser, MegatronIntegrationConfig, CLI, only=("cost_model", "hardware"),
                help_extra={"hardware": f"One of: {', '.join(HARDWARE)}."})
    restrict_choices(parser, "--hardware", HARDWARE)


def cost_record(args) -> dict:
    """What a plan written by `plan` records of its cost model, so `simulate` prices it the same."""
    options = _from_options(MegatronIntegrationConfig, args)
    record = {"model": args.model, "hardware": options.hardware}
    return record if options.cost_model == "analytic" else {**record, "cost_model": options.cost_model}


def cost_of_plan(plan: Plan, args) -> CostModel:
    """The cost model the plan was made with (`plan` records it). `--hardware` re-prices the plan
    on another device (said on stderr); `--model` and `--cost-model` must agree with the plan's (its
    stages hold that model's layers; a profile is the plan's own). A plan without the record
    (older files): the options, or their defaults."""
    recorded = plan.metadata.get("cost", {})
    given = {name: getattr(args, name) for name in ("model", "hardware", "cost_model") if getattr(args, name)}
    clashes = [f"--{name.replace('_', '-')} {given[name]} (the plan was made with {recorded[name]})"
               for name in ("model", "cost_model")
               if name in given and name in recorded and given[name] != recorded[name]]
    if clashes:
        raise CliError(f"{args.plan}: {'; '.join(clashes)}: leave the option out to use the plan's, or re-plan")
    chosen = {"model": "llama-7b", "hardware": "h100-sxm", "cost_model": "analytic", **recorded, **given}
    if "hardware" in given and recorded.get("hardware", given["hardware"]) != given["hardware"]:
        print(f"[simulate] re-priced on {given['hardware']} (the plan was made for {recorded['hardware']}; its "
              "MicroPacks were sized for that device's memory)", file=sys.stderr)
    return CostModel.load(chosen["cost_model"], chosen["model"], chosen["hardware"])


def add_planner_options(parser: argparse.ArgumentParser, *, exclude: tuple[str, ...] = ()):
    """One option per `SlimPackConfig` field that is a CLI option (type, default and help from the
    field; `config.add_options`), but those in `exclude`."""
    add_options(parser, SlimPackConfig, CLI, exclude=exclude,
                help_extra={"strategy": f"One of: {strategy_help()}."})
    restrict_choices(parser, "--strategy", strategy_names())


def add_workload_options(parser: argparse.ArgumentParser, *, batch: int, model: str,
                         planner_exclude: tuple[str, ...] = ()):
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD,
                        help="length source, e.g. file:../shared/data/wikipedia_lengths.txt, longtail, text[:DIR] "
                             f"(default: {DEFAULT_WORKLOAD}, the Python standard library's files)")
    add_cost_options(parser, model=model)
    parser.add_argument("--global-batch-size", type=positive_int, default=batch,
                        help="sequences of context length per step")
    parser.add_argument("--steps", type=positive_int, default=1, help="consecutive global batches")
    add_planner_options(parser, exclude=(*planner_exclude, "long_documents"))
    # Split by default here, unlike the Python API and Megatron (error): these commands plan and
    # simulate the paper's setting, whose workloads (text, longtail, the data files) all hold
    # documents longer than the usual contexts; every split or dropped document is reported.
    parser.add_argument("--long-documents", choices=LONG_DOCUMENT_MODES, default="split",
                        help="a document longer than the context length: 'split' cuts it into pieces of the context "
                             "length, each a sample of its own (the paper's setting; how many is said on stderr), "
                             "'drop' leaves it out (counted on stderr), 'error' refuses the workload, naming how many "
                             "and the longest (default: split)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")


def _from_options(cls, args, **overrides):
    """`from_options` on the CLI, its problems named by option (`--base-merge must be ...`)."""
    try:
        return from_options(cls, args, CLI, **overrides)
    except ConfigError as error:
        raise CliError("; ".join(error.messages(lambda name: option_name(cls, name, CLI)))) from None


def planner_config(args, **overrides) -> SlimPackConfig:
    """The `SlimPackConfig` of the planner options given."""
    return _from_options(SlimPackConfig, args, **overrides)


def load_cost(args) -> CostModel:
    options = _from_options(MegatronIntegrationConfig, args)
    return CostModel.load(options.cost_model, args.model, options.hardware)


def global_batches(args) -> list[list[int]]:
    """The lengths of `--steps` global batches of `--workload`; what became of documents longer
    than the context (--long-documents) is said in one line on stderr (stdout stays JSON with --json)."""
    lengths = load_lengths(args.workload, seed=args.seed)
    try:
        batches = draw_global_batches(lengths, args.context_length, args.global_batch_size, args.steps, args.seed,
                                      args.long_documents)
    except LongDocumentsError as error:
        raise CliError(f"--workload {args.workload}: {error.message('--long-documents', '--context-length')}") from None
    note = long_document_note(batches, lengths, args.context_length)
    if note:
        print(f"slimpack {args.command}: note: {note}", file=sys.stderr)
    return [batch.lengths for batch in batches]


def progress(iterable, total: int, label: str, enabled: bool):
    if not enabled or total <= 1:
        return iterable
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=label, file=sys.stderr, leave=False)


# ---- plan -----------------------------------------------------------------------------------------

def predicted_makespans(plan: Plan) -> dict[tuple[int, ...], float]:
    """DP ranks of a replica or DP-Merge group -> the makespan the planner predicted for it (plan
    metadata "replicas"; stage orders replayed, no gradient reduction). A plan with a base merge
    k > 1 was planned for dp / k replicas and records them in those terms: view rank r is the
    group of ranks r*k .. r*k + k - 1 (`planner.slimpack.search.shared_by_groups`)."""
    merge = int(plan.metadata.get("base_merge", 1) or 1)
    found = {}
    for entry in plan.metadata.get("replicas", []):
        if not isinstance(entry, dict) or entry.get("makespan_s") is None or not entry.get("dp_ranks"):
            continue
        ranks = tuple(int(rank) * merge + k for rank in entry["dp_ranks"] for k in range(merge))
        found[ranks] = float(entry["makespan_s"])
    return found


def replica_summary(plan: Plan, cost: CostModel) -> list[dict]:
    """One row per replica plan (`kind` "replica": a DP rank's own; "DP-Merge group": shared by
    several ranks, run first with context parallelism across them). A rank's row adds up its time:
    its own pipeline and the groups it belongs to (`rank_s`), and that over the mean of the ranks
    (`rank_s_over_mean`); a group has no such figures (its ranks' rows count it)."""
    predicted = predicted_makespans(plan)
    rows: list[dict[str, Any]] = []
    for index, replica in enumerate(plan.replicas):
        slices = [s for m in replica.micropacks for s in m.slices]
        group = len(replica.dp_ranks)  # k-fold context parallelism over dp/k replicas
        merged = plan.parallel.with_(cp=plan.parallel.cp * group, dp=max(1, plan.parallel.dp // group))
        stage_forward = sum(cost.forward_time(m.num_tokens, m.attention_pairs, merged) for m in replica.micropacks)
        stage_backward = sum(cost.backward_time(m.num_tokens, m.attention_pairs, merged) for m in replica.micropacks)
        pipeline_s = predicted.get(tuple(replica.dp_ranks), None if replica.micropacks else 0.0)
        rows.append({
            "replica": index, "kind": "DP-Merge group" if replica.is_merge_group else "replica",
            "dp_ranks": list(replica.dp_ranks), "documents": len({s.sample_id for s in slices}),
            "tokens": sum(s.length for s in slices), "attention_pairs": sum(s.attention_pairs for s in slices),
            "slices": len(slices), "micropacks": len(replica.micropacks),
            "forward_units": len(replica.forward_units), "backward_units": len(replica.backward_units),
            "forward_s_per_stage": stage_forward, "backward_s_per_stage": stage_backward, "pipeline_s": pipeline_s,
            "merge_groups_s": None, "rank_s": None, "rank_s_over_mean": None,
        })
    groups = [row for row in rows if row["kind"] != "replica"]
    ranks = [row for row in rows if row["kind"] == "replica"]
    for row in ranks:
        mine = [group["pipeline_s"] for group in groups if row["dp_ranks"][0] in group["dp_ranks"]]
        if row["pipeline_s"] is not None and None not in mine:
            row["merge_groups_s"] = sum(mine)
            row["rank_s"] = row["pipeline_s"] + row["merge_groups_s"]
    totals = [row["rank_s"] for row in ranks]
    mean = sum(totals) / len(totals) if totals and None not in totals else 0.0
    if mean > 0:
        for row in ranks:
            row["rank_s_over_mean"] = row["rank_s"] / mean
    return rows


def dp_imbalance(rows: list[dict]) -> float | None:
    """max/mean over the DP ranks of their predicted time (own pipeline and DP-Merge groups)."""
    ratios = [row["rank_s_over_mean"] for row in rows if row["kind"] == "replica"]
    return max(ratios) if ratios and None not in ratios else None


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    header = "| " + " | ".join(title for _, title, _ in columns) + " |"
    rule = "|" + "|".join("---:" for _ in columns) + "|"
    body = []
    for row in rows:
        cells = []
        for key, _, fmt in columns:
            value = row.get(key)
            cells.append("-" if value is None else format(value, fmt) if fmt else str(value))
        body.append("| " + " | ".join(cells) + " |")
    return "\n".join([header, rule, *body])


_WORK_COLUMNS = [
    ("documents", "docs", ","), ("tokens", "tokens", ","), ("slices", "slices", ","),
    ("micropacks", "MicroPacks", ","), ("forward_units", "F units", ""), ("backward_units", "B units", ""),
    ("forward_s_per_stage", "F s/stage", ".3f"), ("backward_s_per_stage", "B s/stage", ".3f"),
]
RANK_COLUMNS = [("rank", "DP rank", ""), *_WORK_COLUMNS, ("pipeline_s", "own pipeline s", ".3f"),
                ("merge_groups_s", "DP-Merge s", ".3f"), ("rank_s", "rank s", ".3f"),
                ("rank_s_over_mean", "rank s / mean", ".3f")]
GROUP_COLUMNS = [("group", "group", ""), ("ranks", "DP ranks", ""), *_WORK_COLUMNS, ("pipeline_s", "pipeline s", ".3f")]
# The plan table's abbreviated headers, in the words of docs/usage.md ("Reading the tables").
PLAN_LEGEND = ("legend: F/B units = forward/backward scheduling units; F/B s/stage = forward/backward compute "
               "seconds of the replica on one pipeline stage; DP-Merge s = time of the rank's DP-Merge groups")


def format_plan_tables(rows: list[dict]) -> str:
    """`slimpack plan`'s text: one row per DP rank (its own replica, and its time with the DP-Merge
    groups it belongs to), the DP imbalance (max/mean), then the DP-Merge groups, if any, apart."""
    ranks = [{**row, "rank": row["dp_ranks"][0]} for row in rows if row["kind"] == "replica"]
    groups = [{**row, "group": number, "ranks": ", ".join(map(str, row["dp_ranks"]))}
              for number, row in enumerate(row for row in rows if row["kind"] != "replica")]
    imbalance = dp_imbalance(rows)
    parts = ["DP ranks (own replica; rank s = own pipeline + the DP-Merge groups the rank runs):",
             format_table(ranks, RANK_COLUMNS),
             "DP imbalance (max/mean of rank s): " + (f"{imbalance:.3f}" if imbalance is not None else
                                                      "- (this planner predicts no times; `slimpack simulate` has it)")]
    if groups:
        parts += [f"DP-Merge groups ({len(groups)}; each run by its ranks together, context parallelism "
                  "across them, before their own replicas):", format_table(groups, GROUP_COLUMNS)]
    return "\n".join(parts)


def cmd_plan(args) -> int:
    cost = load_cost(args)
    parallel = ParallelConfig(dp=args.dp, pp=args.pp, vpp=args.vpp, tp=args.tp, cp=args.cp, recompute=args.recompute)
    config = planner_config(args)
    if parallel.cp > 1 and config.base_merge > 1:
        raise CliError(f"--cp {parallel.cp} and --base-merge {config.base_merge} both share every MicroPack over "
                       "several ranks (a layout's cp is what `slimpack compare` reports; Megatron runs it as "
                       "--slimpack-base-merge): give one")
    warn_about_inputs(args, config, dp=parallel.dp)
    planner = strategies.new_planner(config.strategy)  # via the module: looked up per call, as below
    batches = global_batches(args)
    outputs = []
    for step, lengths in enumerate(progress(batches, len(batches), "planning", not args.json)):
        started = time.perf_counter()
        parallel.check_model(cost.model)
        plan = planner.plan(check_plan_input(lengths, config.context_length), parallel, cost, config).validate()
        elapsed = time.perf_counter() - started
        plan.metadata.setdefault("planning_time_s", elapsed)
        plan.metadata["cost"] = cost_record(args)
        path = None
        if args.out:
            path = Path(args.out)
            if len(batches) > 1:
                path = path.with_name(f"{path.stem}.step{step}{path.suffix}")
            plan.to_json(path)
        outputs.append((step, lengths, plan, elapsed, path))
    if args.json:
        steps = []
        for step, lengths, plan, elapsed, path in outputs:
            rows = replica_summary(plan, cost)
            steps.append({"step": step, "documents": len(lengths), "planning_time_s": elapsed,
                          "metadata": plan.metadata, "replicas": rows, "dp_imbalance_max_over_mean": dp_imbalance(rows),
                          "file": str(path) if path else None})
        print(json.dumps(steps, indent=1, default=float))
    else:
        for step, lengths, plan, elapsed, _ in outputs:
            phase1 = plan.metadata.get("phase1", {})
            print(f"step {step}: {len(lengths)} documents, {sum(lengths):,} tokens, strategy {plan.strategy}, "
                  f"{parallel.describe()}, planned in {elapsed * 1000:.0f} ms "
                  f"(CP-SAT {phase1.get('status', '-')}, gap {phase1.get('gap', 0):.2%})")
            print(format_plan_tables(replica_summary(plan, cost)))
        print(figures_source(cost.describe()))  # once, under the last step's tables: the same for every step
        print(PLAN_LEGEND)
    announce_written(args, [path for *_, path in outputs if path is not None])
    return 0


# ---- simulate ------------------------------------------------------------------------------------

def cmd_simulate(args) -> int:
    plan = Plan.from_json(args.plan).validate()
    cost = cost_of_plan(plan, args)
    report = simulate(plan, cost)
    written = []
    if args.gantt:
        title = gantt_title(plan.strategy, plan.parallel.describe(), model=cost.model.name,
                            context_length=plan.context_length, iteration_s=report.iteration_time_s,
                            hardware=cost.hardware.name)
        written.append(simulator_report.write_gantt(report, args.gantt, title=title))
    if args.trace:
        written.append(write_chrome_trace(report, args.trace))
    if args.json:
        figures = report.to_dict() if args.full else {**summary(report), "cost_model": cost.describe()}
        print(json.dumps(figures, indent=1, default=float))
    else:
        print(markdown_table([(plan.strategy, report)]))
        print(figures_source(cost.describe()))
        print(legend(["name", *summary(report)]))
    announce_written(args, written)
    return 0


# ---- compare -------------------------------------------------------------------------------------

STOPPED_EXIT = 3  # `compare` stopped (Ctrl-C, --time-budget) before every strategy was final


def cmd_compare(args) -> int:
    check_compare_output(args)
    config = planner_config(args)
    warn_about_inputs(args, config)
    written: list[Path] = []

    def write(partial) -> None:  # each strategy's row as soon as it is final
        written[:] = write_outputs(partial, args.out, wide=args.wide)

    result = comparison.run_comparison(
        workload=args.workload, model=args.model, hardware=args.hardware, cost=load_cost(args),
        gpus=args.gpus, global_batch_size=args.global_batch_size, steps=args.steps, strategies=args.strategies,
        config=config, gantt_dir=args.gantt_dir, show_progress=not args.quiet, time_budget_s=args.time_budget,
        cache=None if args.no_cache else SearchCache(), on_update=write if args.out else None,
        workers=args.workers,
    )
    if args.out:  # once more: the Gantt charts are named in the notes
        write(result)
    if not result.results and not result.unfinished:
        reasons = "; ".join(f"{name}: {reason}" for name, reason in result.failures.items())
        raise CliError(f"no strategy has a feasible layout on {args.gpus} GPUs ({reasons})")
    if args.json:
        print(json.dumps(result.to_dict(), indent=1, default=float))
    elif args.csv:
        if result.results:
            print(result.table("csv"), end="")
    elif args.markdown:
        if result.results:
            print(result.markdown_document(wide=args.wide), end="")
    else:
        if result.results:
            print(result.table("markdown", wide=args.wide))
            for line in result.footer(wide=args.wide):
                print(line)
        for line in result.notes():
            print(line)
    if not args.quiet:
        announce_written(args, [*written, *map(Path, result.gantt_files)])
    if result.unfinished:
        finished = ", ".join(result.results) or "none"
        print(f"slimpack compare: stopped, {len(result.unfinished)} strategies unfinished: "
              + "; ".join(f"{name} ({why})" for name, why in result.unfinished.items())
              + f". Finished: {finished}" + (f"; written to {args.out}" if args.out else ""), file=sys.stderr)
        return STOPPED_EXIT
    return 0


def announce_written(args, paths) -> None:
    """One line on stderr per file the command wrote, so that none goes unnoticed."""
    for path in paths:
        print(f"slimpack {args.command}: wrote {path}", file=sys.stderr)


def check_compare_output(args) -> None:
    """--json, --csv and --markdown each choose the whole output: at most one of them."""
    chosen = [flag for flag, given in (("--json", args.json), ("--csv", args.csv), ("--markdown", args.markdown))
              if given]
    if len(chosen) > 1:
        raise CliError(f"{' and '.join(chosen)} each choose the output format; give one of them")


def warn_about_inputs(args, config: SlimPackConfig, dp: int | None = None) -> None:
    """Inputs that run but are unlikely to be what was meant: said on stderr."""
    if config.context_length < 1024:
        print(f"slimpack {args.command}: warning: --context-length {config.context_length} is below 1K tokens",
              file=sys.stderr)
    if dp is not None and args.global_batch_size < dp:
        print(f"slimpack {args.command}: warning: --global-batch-size {args.global_batch_size} gives fewer "
              f"sequences than the {dp} data-parallel replicas (--dp): some replicas get little or no work",
              file=sys.stderr)


# ---- demo ------------------------------------------------------------------------------------------

def cmd_demo(args) -> int:
    return run_demo(args)


# ---- entry ---------------------------------------------------------------------------------------

def add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    """`slimpack demo`'s options; what argparse cannot check is checked by `demo.check_demo_options`
    before any process starts."""
    defaults = DemoOptions()
    demo.add_argument("--steps", type=positive_int, default=None,
                      help=f"training steps per strategy (default {defaults.steps})")
    demo.add_argument("--data-dir", default=None, help="text files to train on (default: Python's standard library)")
    add_model_option(demo, defaults.model, f"model preset (default {defaults.model}; larger ones are slow on a CPU)")
    demo.add_argument("--out-dir", default=defaults.out_dir, help="where summary.json and the Gantt charts go")
    demo.add_argument("--pp", type=positive_int, default=defaults.pp, help="pipeline stages (gloo processes)")
    demo.add_argument("--context-length", type=positive_int, default=None,
                      help=f"tokens per sequence (default {defaults.context_length})")
    demo.add_argument("--global-batch-size", type=positive_int, default=None,
                      help=f"sequences of context length per step (default {defaults.global_batch_size})")
    demo.add_argument("--lr", type=positive_float, default=None, help=f"Adam learning rate (default {defaults.lr:g})")
    demo.add_argument("--seed", type=non_negative_int, default=defaults.seed,
                      help="seed of the weights and the batch sampler")
    demo.add_argument("--plan-ahead", type=non_negative_int, default=None,
                      help=f"steps planned ahead in the background (default {defaults.plan_ahead}; 0: inline)")
    demo.add_argument("--cost-model", default=defaults.cost_model,
                      help="'calibrated' (default: this machine's profile, made once and cached), 'analytic' "
                           "(uncalibrated CPU figures) or a `slimpack profile` JSON")
    demo.add_argument("--strategies", default=None, help="comma-separated strategies the runtime trains "
                                                         f"(default {','.join(defaults.strategies)})")
    demo.add_argument("--no-progress", dest="progress", action="store_false",
                      help="no progress bar (there is one only when stderr is a terminal; the log goes through it)")
    demo.add_argument("--json", action="store_true", help="the summary as one JSON document on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slimpack",
                                     description="SlimPack planning, simulation and training for Megatron-LM")
    parser.add_argument("--version", action="version", version=f"megatron-slimpack {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="plan global batches and print a per-replica summary")
    add_workload_options(plan, batch=512, model="llama-7b")
    plan.add_argument("--tp", type=positive_int, default=8, help="tensor parallel size")
    plan.add_argument("--pp", type=positive_int, default=4, help="pipeline stages")
    plan.add_argument("--vpp", type=positive_int, default=1,
                      help="virtual pipeline stages (model chunks) per pipeline rank: interleaved 1F1B (default: 1)")
    plan.add_argument("--dp", type=positive_int, default=4, help="data-parallel replicas")
    plan.add_argument("--cp", type=positive_int, default=1,
                      help="context parallel size; SlimPack plans cp K as DP-Merge groups of K replicas, like a "
                           "`compare` row 'slimpack ... cpK dpD' (the same plan as --cp 1 --dp K*D --base-merge K, "
                           "the form Megatron runs)")
    plan.add_argument("--recompute", default="none", type=recompute_mode, metavar="MODE",
                      help=RECOMPUTE_HELP + " (default: none)")
    plan.add_argument("--out", help="write the plan JSON here (one file per step with --steps)")
    add_megatron_spellings(plan)  # --tensor-model-parallel-size, --seq-length, ... as in Megatron-LM
    plan.set_defaults(run=cmd_plan)

    simulate = commands.add_parser("simulate", help="simulate a plan JSON: time, MFU, bubbles, memory")
    simulate.add_argument("plan", help="a plan JSON written by `slimpack plan --out`")
    add_model_option(simulate, None, "model preset (default: the one the plan was made with)")
    simulate.add_argument("--hardware", default=None, choices=list(HARDWARE), metavar="HARDWARE",
                          help="hardware preset to price the plan on (default: the plan's; another one re-prices "
                               f"it there); one of: {', '.join(HARDWARE)}")
    simulate.add_argument("--cost-model", default=None, metavar="{analytic,PATH}",
                          help="'analytic', a `slimpack profile` JSON or a `slimpack profile --kernels` JSON (default: "
                               "the plan's)")
    simulate.add_argument("--gantt", help="write a Gantt chart PNG")
    simulate.add_argument("--trace", help="write a Chrome-trace JSON (open in Perfetto)")
    simulate.add_argument("--json", action="store_true", help="the figures as one JSON document on stdout")
    simulate.add_argument("--full", action="store_true", help="with --json: every task and the memory timeline")
    add_megatron_spellings(simulate)
    simulate.set_defaults(run=cmd_simulate)

    compare = commands.add_parser("compare", help="every strategy, its best layout, side by side")
    # Each strategy is compared in its own best layout: no --strategy, and no --base-merge (SlimPack's
    # layouts with cp K are its base merge K).
    add_workload_options(compare, batch=512, model="llama-7b", planner_exclude=("strategy", "base_merge"))
    compare.add_argument("--gpus", type=positive_int, default=128, help="GPUs every strategy's layout uses")
    compare.add_argument("--strategies", default="all", help="comma-separated names or 'all'")
    compare.add_argument("--wide", action="store_true",
                         help="every column (DP/PP imbalance, memory fit, exposed DP time, lower bound, planning "
                              "time), not only the compact ones; CSV and JSON always have them all")
    compare.add_argument("--csv", action="store_true", help="the table as CSV, nothing else")
    compare.add_argument("--markdown", action="store_true",
                         help="a Markdown document: the table, notes as a list, Gantt charts as images")
    compare.add_argument("--gantt-dir", help="write one Gantt PNG per strategy here")
    compare.add_argument("--out", metavar="PATH",
                         help="write the comparison as JSON here (a .md PATH: a Markdown document, and the JSON "
                              "beside it), rewritten as each strategy's row is final, so a stopped run keeps them")
    compare.add_argument("--time-budget", type=positive_float, metavar="SECONDS",
                         help="stop searching after this many seconds: the rows found so far are printed, the "
                              f"rest marked unfinished, and the exit status is {STOPPED_EXIT} (as on Ctrl-C)")
    compare.add_argument("--no-cache", action="store_true",
                         help="search every strategy again, neither reading nor writing the search cache "
                              "($XDG_CACHE_HOME or ~/.cache, /megatron-slimpack/compare)")
    compare.add_argument("--quiet", action="store_true",
                         help="nothing on stderr but errors and warnings: no progress (a bar on a terminal, one "
                              "line per strategy and phase otherwise), no line per file written")
    compare.add_argument("--workers", type=positive_int, default=os.cpu_count() or 1,
                         help="processes searching strategies at once; the result is the same for any count "
                              "(default: every core, %(default)s here; 1: one strategy after another, with a "
                              "progress bar per layout)")
    add_megatron_spellings(compare)  # --seq-length
    compare.set_defaults(run=cmd_compare)

    profile = commands.add_parser("profile", help="time the real model on this device and fit the cost model")
    add_profile_arguments(profile)
    profile.set_defaults(run=profile_main)

    validate = commands.add_parser("validate", help="measured multi-process steps vs the simulator (fidelity)")
    add_validate_arguments(validate)
    validate.set_defaults(run=validate_main)

    selftest = commands.add_parser("selftest", help="check this node: kernels, DP-Merge, training steps, overhead")
    add_selftest_arguments(selftest)
    selftest.set_defaults(run=selftest_main)

    cost = commands.add_parser("cost", help="what the cost model predicts for one layer and pack")
    add_cost_arguments(cost)
    cost.set_defaults(run=cost_main)

    demo = commands.add_parser("demo", help="the main job on the embedded default workload")
    add_demo_arguments(demo)
    demo.set_defaults(run=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    command = _subparser(parser, args.command)
    if command is not None and (contradiction := contradictions(command, argv[argv.index(args.command) + 1:])):
        command.error(contradiction)
    if (unwritable := unwritable_outputs(args)) and command is not None:
        command.error(unwritable)
    with library_noise.silenced():
        try:
            return args.run(args)
        except (PlanError, SpecError, ValueError, FileNotFoundError, CliError) as error:
            print(f"slimpack {args.command}: error: {error}", file=sys.stderr)
            return 2


# Where each command writes: argparse dest -> whether it names a directory (else a file).
OUTPUTS = {"out": False, "gantt": False, "trace": False, "gantt_dir": True, "out_dir": True}


def unwritable_outputs(args) -> str | None:
    """Why an output path the user gave cannot be written (a missing or read-only folder, a file
    where a folder is wanted or the reverse), checked before the work starts: a search of minutes
    must not end in a traceback. None when every one can be."""
    problems = []
    for dest, is_directory in OUTPUTS.items():
        given = getattr(args, dest, None)
        if not given:
            continue
        path = Path(given)
        flag = "--" + dest.replace("_", "-")
        if path.exists() and path.is_dir() != is_directory:
            problems.append(f"{flag} {given} is a {'file' if is_directory else 'directory'}; name a "
                            f"{'directory' if is_directory else 'file'}")
            continue
        folder = path if is_directory and path.exists() else path.parent
        while is_directory and not folder.exists() and folder != folder.parent:  # created with its parents
            folder = folder.parent
        if not folder.exists():
            problems.append(f"{flag} {given}: the folder {folder} does not exist")
        elif not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            problems.append(f"{flag} {given}: not writable")
    return "; ".join(problems) or None


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    """The subcommand's own parser (its options), None without one."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None


if __name__ == "__main__":
    sys.exit(main())
