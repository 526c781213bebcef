"""`slimpack validate`: how well does the simulator predict real steps on this machine?

`measure_plans` runs plans for real (CPU, gloo, one process per (dp, pp) device, megatron-core
chunks with the SlimPack layer spec, the pipeline schedule with per-task timing and per-stage
saved-tensor memory), `simulate` predicts the same plans with a (profiled) cost model, and
`compare` reports the mean absolute percentage error (MAPE) of
  * iteration time (measured: last task end on any rank, clocks started after a barrier),
  * per-task time (every F/B unit on every stage; measured compute only, receives excluded),
  * per-stage peak activation memory (measured: max over the step of the live MicroPacks'
    saved-tensor bytes + KV-store bytes; simulated: the stage's peak minus its static memory),
plus a Gantt chart per step with the measured and simulated timelines on one time axis.

Tokens come from `workload.TextCorpus` (real text, byte tokens) through the batch's sources;
document lengths from `load_lengths("text")` capped at the context length by the sampler.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence, cast

import numpy as np

from ..config import SlimPackConfig
from ..costmodel import CostModel
from ..plan import Plan
from ..planner.strategies import plan_global_batch
from ..runtime.processes import spawn
from ..simulator.dag import simulate
from ..simulator.report import write_chrome_trace
from ..specs import ModelSpec, ParallelConfig, model_from_dict
from ..workload import GlobalBatch, TextCorpus, global_batches, load_lengths, long_document_note
from .cli_options import add_model_option, positive_int
from .profiler import reference_seconds, transformer_config


# ---- processes -------------------------------------------------------------------------------
# ---- tokens ----------------------------------------------------------------------------------
class BatchTokens:
    """Runtime token source for one `workload.GlobalBatch` served by a `TextCorpus`."""

    def __init__(self, corpus, batch, plan: Optional[Plan] = None):
        self.corpus = corpus
        self.where = {sid: (doc, offset, n)
                      for sid, (doc, offset), n in zip(batch.sample_ids, batch.sources, batch.lengths)}
        pieces = (plan.metadata or {}).get("pieces") if plan is not None else None
        if plan is not None and pieces:
            # Baselines that re-cut documents (megatron-fixed's concatenate-and-cut) renumber samples:
            # metadata "pieces"[i] = (batch document, offset) of sample i.
            lengths = plan.sample_lengths()
            where = {}
            for sample_id, (document, offset) in enumerate(pieces):
                doc, base, _ = self.where[batch.sample_ids[document]]
                where[sample_id] = (doc, base + offset, lengths[sample_id])
            self.where = where

    def tokens(self, sample_id, start, end):
        import torch

        document, offset, length = self.where[sample_id]
        stop = min(end + 1, length)
        return torch.as_tensor(self.corpus.tokens(document, offset + start, offset + stop))


class SyntheticTokens:
    """Random token ids (seeded per sample) when no corpus is wanted (tests)."""

    def __init__(self, lengths: dict[int, int], vocab: int, seed: int = 0):
        self.lengths, self.vocab, self.seed = lengths, vocab, seed

    def tokens(self, sample_id, start, end):
        import torch

        n = self.lengths[sample_id]
        ids = torch.randint(0, self.vocab, (n,), generator=torch.Generator().manual_seed(self.seed * 7919 + sample_id))
        return ids[start:min(end + 1, n)]


# ---- measured runs ---------------------------------------------------------------------------
@dataclass
class MeasuredStep:
    plan_index: int
    repeat: int
    iteration_time_s: float
    records: list[dict]
    memory: list[dict]
    loss: Optional[float] = None
    reference_s: Optional[float] = None  # the profile's speed reference, timed just before this step


def _run_worker(rank, world_size, port, spec_dict, pp, plans_json, batches_json, text_dir, repeats, warmup, path, seed,
                reference=None):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from ..runtime import compat
    from ..runtime.model import build_gpt_model
    from ..runtime.pipeline.schedule import ScheduleGroups, slimpack_forward_backward
    from ..runtime.pipeline.timing import Timeline

    torch.set_num_threads(1)
    compat.apply()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(seed)
    spec = model_from_dict(spec_dict)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    extra = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32) if pp > 1 else {}
    torch.manual_seed(seed)
    chunk = build_gpt_model(transformer_config(spec, num_layers=spec.num_layers, **extra), vocab_size=spec.vocab_size,
                            max_sequence_length=1 << 20, backend="torch", pre_process=stage == 0,
                            post_process=stage == pp - 1)
    reference_chunk = None
    if reference:  # the profile's speed reference, timed before every step on every rank
        reference_chunk = build_gpt_model(transformer_config(spec, num_layers=reference["layers"]),
                                          vocab_size=spec.vocab_size, max_sequence_length=1 << 20, backend="torch",
                                          pre_process=False, post_process=False)
    corpus = None
    if text_dir is not None:
        corpus = TextCorpus(text_dir or None)
    merge = None
    if world_size // pp > 1:  # DP-Merge process groups, created once (collective, every rank)
        from ..runtime.pipeline.merge import merge_groups

        merge = merge_groups(world_size // pp, dist.get_process_group_ranks(parallel_state.get_data_parallel_group()))
    groups = ScheduleGroups.from_parallel_state(merge_groups=merge)
    steps = []
    for index, (plan_text, batch_data) in enumerate(zip(plans_json, batches_json)):
        plan = Plan.from_json(plan_text)
        if corpus is not None and batch_data is not None:
            batch = GlobalBatch(step=0, lengths=batch_data["lengths"], sample_ids=batch_data["sample_ids"],
                                sources=[tuple(s) for s in batch_data["sources"]], stats=None)
            source = BatchTokens(corpus, batch, plan)
        else:
            source = SyntheticTokens(plan.sample_lengths(), spec.vocab_size, seed)
        for repeat in range(warmup + repeats):
            speed = None
            if reference_chunk is not None:
                dist.barrier()
                speed = torch.tensor([reference_seconds(reference_chunk, spec, repeats=1)], dtype=torch.float64)
                dist.all_reduce(speed)
                speed = float(speed) / world_size
            chunk.zero_grad(set_to_none=True)
            timeline = Timeline(track_memory=True)
            slimpack_forward_backward(model=[chunk], plan=plan, token_source=source, groups=groups,
                                      timeline=timeline)
            if repeat >= warmup and rank == 0:
                steps.append(MeasuredStep(index, repeat - warmup, timeline.iteration_time_s,
                                          [r.to_dict() for r in timeline.records],
                                          [m.to_dict() for m in timeline.memory], reference_s=speed).__dict__)
    if rank == 0:
        Path(path).write_text(json.dumps(steps))
    dist.barrier()
    dist.destroy_process_group()


def measure_plans(plans: Sequence[Plan], spec: ModelSpec, *, batches: Optional[Sequence] = None,
                  text_dir: Optional[str] = "", repeats: int = 3, warmup: int = 1, seed: int = 0,
                  timeout_s: float = 900.0, reference: Optional[dict] = None) -> list[MeasuredStep]:
    """Run every plan `warmup + repeats` times on pp*dp local processes (all plans must share one
    layout); returns the timed steps (rank 0's gathered view). `batches`: the `GlobalBatch`es the
    plans were made from (tokens from `TextCorpus(text_dir)`; text_dir "" = the default corpus,
    None = synthetic tokens). `reference`: a profile's speed reference (`CostModel.reference`), timed
    on every rank before every step (`MeasuredStep.reference_s`, mean over ranks)."""
    layouts = {(p.parallel.pp, p.parallel.dp, p.parallel.tp) for p in plans}
    if len(layouts) != 1:
        raise ValueError(f"plans must share one layout, got {sorted(layouts)}")
    pp, dp, tp = layouts.pop()
    if tp != 1:
        raise ValueError("measure_plans runs tp=1 layouts")
    batch_data: list[Optional[dict[str, object]]] = [None] * len(plans)
    if batches is not None:
        batch_data = [{"lengths": list(map(int, b.lengths)), "sample_ids": list(map(int, b.sample_ids)),
                       "sources": [list(map(int, s)) for s in b.sources]} for b in batches]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "steps.json")
        spawn(_run_worker, pp * dp, (spec.to_dict(), pp, [p.to_json() for p in plans], batch_data,
                                     text_dir if batches is not None else None, repeats, warmup, path, seed,
                                     reference),
              timeout_s=timeout_s)
        return [MeasuredStep(**s) for s in json.loads(Path(path).read_text())]


# ---- comparison ------------------------------------------------------------------------------
def _mape(measured: Sequence[float], predicted: Sequence[float]) -> float:
    pairs = [(m, p) for m, p in zip(measured, predicted) if m > 0]
    return float(np.mean([abs(p - m) / m for m, p in pairs])) if pairs else float("nan")


@dataclass
class StepComparison:
    plan_index: int
    strategy: str
    measured_iteration_s: list[float]  # one per repeat
    simulated_iteration_s: float
    task_mape: float  # over every F/B task of every repeat
    measured_peak_bytes: dict  # "rank/stage" -> bytes (max over repeats; deterministic anyway)
    simulated_peak_bytes: dict
    memory_mape: float
    drift: list[float] = field(default_factory=list)  # per repeat: reference now / at profiling (1 = same speed)
    corrected_task_mape: Optional[float] = None
    gantt: Optional[str] = None
    trace: Optional[str] = None

    @property
    def iteration_mape(self) -> float:
        return _mape(self.measured_iteration_s, [self.simulated_iteration_s] * len(self.measured_iteration_s))

    @property
    def corrected_iteration_errors(self) -> list[float]:
        """|simulated x drift - measured| / measured per repeat: the error left once the machine's
        speed change since profiling (measured by the reference) is taken out."""
        return [abs(self.simulated_iteration_s * d - m) / m for d, m in zip(self.drift, self.measured_iteration_s)]

    @property
    def median_iteration_s(self) -> float:
        return statistics.median(self.measured_iteration_s)


def compare(plans: Sequence[Plan], steps: Sequence[MeasuredStep], cost, *,
            out_dir: Optional[str | Path] = None) -> list[StepComparison]:
    """Simulate each plan with `cost` and compare it with its measured steps."""
    from ..runtime.pipeline.timing import overlay_records, write_overlay_gantt

    out = []
    for index, plan in enumerate(plans):
        mine = [s for s in steps if s.plan_index == index]
        report = simulate(plan, cost)
        static = cost.static_memory_bytes(plan.parallel)
        simulated_tasks = {(t.rank, t.stage, t.replica, t.kind, t.unit): t.end - t.start
                           for t in report.tasks if t.kind in ("F", "B")}
        reference = getattr(cost, "reference", None)
        drift = ([s.reference_s / reference["seconds"] for s in mine]
                 if reference and all(s.reference_s for s in mine) else [])
        measured_t, predicted_t, step_drift = [], [], []
        for position, step in enumerate(mine):
            for r in step.records:
                key = (r["rank"], r["stage"], r["replica"], r["kind"], r["unit"])
                if r["kind"] in ("F", "B") and key in simulated_tasks:
                    measured_t.append(r["end"] - r["start"])
                    predicted_t.append(simulated_tasks[key])
                    step_drift.append(drift[position] if drift else 1.0)
        measured_peak: dict[str, float] = {}
        for step in mine:
            for m in step.memory:
                stage_key = f"{m['rank']}/{m['stage']}"
                measured_peak[stage_key] = max(measured_peak.get(stage_key, 0), m["peak_activation_bytes"])
        simulated_peak = {}
        for timeline in report.memory_timeline:
            simulated_peak[f"{timeline.rank}/{timeline.stage}"] = timeline.peak_bytes - static
        keys = sorted(measured_peak)
        comparison = StepComparison(
            index, plan.strategy, [s.iteration_time_s for s in mine], report.iteration_time_s,
            _mape(measured_t, predicted_t), measured_peak, simulated_peak,
            _mape([measured_peak[k] for k in keys], [simulated_peak.get(k, 0.0) for k in keys]),
            drift=drift,
            corrected_task_mape=_mape(measured_t, [p * d for p, d in zip(predicted_t, step_drift)]) if drift else None,
        )
        if out_dir is not None and mine:
            out_dir = Path(out_dir)
            out_dir.mkdir(parents=True, exist_ok=True)
            first = mine[0]
            comparison.gantt = str(write_overlay_gantt(
                first.records, report.tasks, out_dir / f"step{index}_{plan.strategy}_gantt.png",
                title=f"plan {index} ({plan.strategy}): measured {first.iteration_time_s:.3f} s vs simulated "
                      f"{report.iteration_time_s:.3f} s"))
            comparison.trace = str(write_chrome_trace(overlay_records(first.records, report.tasks),
                                                      out_dir / f"step{index}_{plan.strategy}_trace.json",
                                                      {"plan": plan.fingerprint()}))
        out.append(comparison)
    return out


def summary_table(comparisons: Sequence[StepComparison]) -> str:
    lines = ["| plan | strategy | measured iter (s, median) | min-max | simulated (s) | iter err | task MAPE "
             "| speed drift | iter err, drift-corrected | task MAPE, drift-corrected "
             "| peak act. meas (MiB) | sim (MiB) | mem MAPE |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in comparisons:
        meas = max(c.measured_peak_bytes.values(), default=0) / 2**20
        sim = max(c.simulated_peak_bytes.values(), default=0) / 2**20
        if c.drift:
            corrected = (f"{statistics.mean(c.drift):.2f}x | "
                         f"{100 * statistics.mean(c.corrected_iteration_errors):.1f}% | "
                         f"{100 * cast(float, c.corrected_task_mape):.1f}%")  # set with drift
        else:
            corrected = "- | - | -"
        lines.append(f"| {c.plan_index} | {c.strategy} | {c.median_iteration_s:.3f} | "
                     f"{min(c.measured_iteration_s):.3f}-{max(c.measured_iteration_s):.3f} | "
                     f"{c.simulated_iteration_s:.3f} | {100 * c.iteration_mape:.1f}% | {100 * c.task_mape:.1f}% | "
                     f"{corrected} | {meas:.1f} | {sim:.1f} | {100 * c.memory_mape:.1f}% |")
    return "\n".join(lines) + "\n"


def overall(comparisons: Sequence[StepComparison]) -> dict:
    iteration = [abs(c.simulated_iteration_s - m) / m for c in comparisons for m in c.measured_iteration_s]
    result = {
        "iteration_mape": float(np.mean(iteration)) if iteration else float("nan"),
        "iteration_mape_of_medians": _mape([c.median_iteration_s for c in comparisons],
                                           [c.simulated_iteration_s for c in comparisons]),
        "task_mape": float(np.mean([c.task_mape for c in comparisons])),
        "memory_mape": float(np.mean([c.memory_mape for c in comparisons])),
        "iteration_errors": iteration,
    }
    corrected = [e for c in comparisons for e in c.corrected_iteration_errors]
    if corrected and len(corrected) == len(iteration):
        result["corrected_iteration_mape"] = float(np.mean(corrected))
        result["corrected_iteration_errors"] = corrected
        result["corrected_task_mape"] = float(np.mean([c.corrected_task_mape for c in comparisons]))
        result["drift"] = [d for c in comparisons for d in c.drift]
    return result


# ---- plans from real text --------------------------------------------------------------------
def text_plans(cost, *, strategies: Sequence[str], pp: int = 2, dp: int = 1, context_length: int = 2048,
               global_batch_size: int = 4, steps: int = 2, seed: int = 0, max_micropack_tokens: Optional[int] = None):
    """Global batches of real text lengths (`load_lengths("text")`, documents longer than the
    context split by the sampler) planned by each strategy. Returns [(strategy, batch, plan)]."""
    parallel = ParallelConfig(pp=pp, dp=dp, tp=1, sequence_parallel=False, zero1=False)
    # The standard library holds files longer than any context measured here: they are cut into
    # pieces of the context length, each a sample of its own (the paper's setting; `validate` says how many).
    batches = global_batches("text", context_length, global_batch_size, steps, seed=seed, long_documents="split")
    out = []
    for batch in batches:
        for name in strategies:
            config = SlimPackConfig(strategy=name, context_length=context_length, seed=seed,
                                    max_micropack_tokens=max_micropack_tokens)
            plan = plan_global_batch(batch.lengths, parallel=parallel, cost=cost, config=config)
            out.append((name, batch, plan))
    return out


def validate(cost, *, plans: int = 2, pp: int = 2, dp: int = 1, strategies: Sequence[str] = ("slimpack",),
             context_length: int = 2048, global_batch_size: int = 4, repeats: int = 3, warmup: int = 1,
             seed: int = 100, out_dir: Optional[str | Path] = None,
             progress: Callable[[str], None] | None = lambda line: print(line, file=sys.stderr, flush=True)):
    """K = `plans` global batches (not those the profile was fitted on: a separate seed), planned by
    each strategy, measured and simulated. Returns (comparisons, overall figures)."""
    planned = text_plans(cost, strategies=strategies, pp=pp, dp=dp, context_length=context_length,
                         global_batch_size=global_batch_size, steps=plans, seed=seed)
    if progress:
        batches = list({id(batch): batch for _, batch, _ in planned if batch is not None}.values())
        note = long_document_note(batches, load_lengths("text", seed=seed), context_length, option=None)
        if note:
            progress(f"text: {note}")
        progress(f"running {len(planned)} plans x {warmup + repeats} steps on {pp * dp} processes")
    steps = measure_plans([p for _, _, p in planned], cost.model, batches=[b for _, b, _ in planned],
                          repeats=repeats, warmup=warmup, reference=getattr(cost, "reference", None))
    comparisons = compare([p for _, _, p in planned], steps, cost, out_dir=out_dir)
    return comparisons, overall(comparisons)


def validate_main(args) -> int:
    """CLI hook: `slimpack validate --profile profile.json [--plans K] [--pp 2] [--dp 1] [--repeats R]
    [--context-length N] [--global-batch-size G] [--strategy S ...] [--out-dir DIR] [--json]`."""
    profile_path = getattr(args, "profile", None)
    if profile_path:
        cost = CostModel.from_profile(profile_path)
    else:
        cost = CostModel.analytic(getattr(args, "model", "tiny"), "cpu", dtype_bytes=4, attention_backend="torch")
    comparisons, figures = validate(
        cost, plans=getattr(args, "plans", 2), pp=getattr(args, "pp", 2), dp=getattr(args, "dp", 1),
        strategies=getattr(args, "strategy", None) or ("slimpack",),
        context_length=getattr(args, "context_length", 2048), global_batch_size=getattr(args, "global_batch_size", 4),
        repeats=getattr(args, "repeats", 3), out_dir=getattr(args, "out_dir", None),
    )
    if getattr(args, "json", False):
        print(json.dumps({"overall": figures, "plans": [c.__dict__ for c in comparisons]}, default=str))
    else:
        print(summary_table(comparisons))
        print(f"iteration-time MAPE {100 * figures['iteration_mape']:.1f}%, "
              f"per-task MAPE {100 * figures['task_mape']:.1f}%, "
              f"peak activation memory MAPE {100 * figures['memory_mape']:.1f}%")
    return 0


def add_validate_arguments(parser) -> None:
    parser.add_argument("--profile", help="profile JSON from `slimpack profile` (default: analytic cpu model)")
    add_model_option(parser, "tiny", "model preset run on this machine's CPU (default tiny)")
    parser.add_argument("--plans", type=positive_int, default=2, help="global batches planned, run and compared")
    parser.add_argument("--pp", type=positive_int, default=2, help="pipeline stages (one process each)")
    parser.add_argument("--dp", type=positive_int, default=1, help="data-parallel replicas (processes per stage)")
    parser.add_argument("--repeats", type=positive_int, default=3,
                        help="timed runs of each plan (the median is compared)")
    parser.add_argument("--context-length", type=positive_int, default=2048, help="tokens per sequence")
    parser.add_argument("--global-batch-size", type=positive_int, default=4, help="sequences per global batch")
    parser.add_argument("--strategy", action="append", help="a strategy to validate (repeat it; default: slimpack)")
    parser.add_argument("--out-dir", help="write the measured and simulated timelines (Chrome traces, Gantt PNGs) here")
    parser.add_argument("--json", action="store_true", help="one JSON document instead of the table")
