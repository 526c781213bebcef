"""`slimpack demo`: train a small Llama-style GPT on CPU with megatron-core, Megatron's fixed-length
packing and SlimPack back to back on the same global batches, and compare them.

What runs (docs/design.md section 7, "On CPU, megatron.training cannot start"): `pp` gloo processes
(torch.multiprocessing), each holding one pipeline stage of a megatron-core GPTModel built with
the SlimPack layer spec (`runtime.model.build_gpt_model`). The data is real text with no download:
Python's standard library source files, byte-level tokens (`workload.TextCorpus`), drawn into
global batches by `workload.GlobalBatchSampler`. Each step's batch is planned ahead in a
background thread and broadcast from rank 0 (`megatron.data.PlannerIterator`) and executed by
the SlimPack pipeline schedule (`runtime.schedule.slimpack_forward_backward`).

The two runs start from the same weights with the same optimizer (torch Adam on each stage's
parameters) and see the same batches, so their losses must agree to float round-off: both
compute exact per-document attention and per-token loss over the global batch. The baseline
is Megatron-LM's packing (documents concatenated and cut into sequences of exactly the context
length, one sequence per micro-batch, classic 1F1B); the only change from `megatron-fixed` is
that a document crossing a cut keeps its prefix through the KV store (as if Megatron trained
without the cut), so the comparison measures packing and scheduling only, never a change of
the objective. `--strategies` runs other strategies alongside in the same way (each through its
own planner); the loss check compares megatron-fixed and slimpack.

Structure: each process builds a `DemoRunner`, which holds one `StrategyRun` per strategy (model
chunk, optimizer, planner, measured figures) and steps them in turn (`_train`). What is measured:
a step's wall time (schedule + optimizer step, the maximum over ranks) and every forward/backward
task's compute interval, recorded by the schedule itself (`timeline=`, runtime/pipeline/timing.py), from
which come the per-stage busy times (PP imbalance) and the Gantt charts. What is predicted: the
simulator's step time for each plan with the demo's cost model: by default this machine's own,
a quick `slimpack profile` of the demo model cached per machine and library versions
(`calibrated_profile`), the same model for every strategy's planner; `--cost-model analytic` plans
with the uncalibrated CPU figures, `--cost-model PATH` with a given profile. The headline is the
median of paired step-time ratios with a bootstrap 95% interval (`paired_speedup`), after the
predicted one; an interval that crosses 1.0 says the machine was too noisy to decide.
"""
from __future__ import annotations

import json
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, cast

from .. import __version__, simulate
from ..config import SlimPackConfig
from ..costmodel import CostModel
from ..megatron.data import PlannerIterator
from ..planner.baselines.fixed import prefix_keeping_fixed_plan
from ..planner.registry import with_input_sources
from ..planner.strategies import check_plan_input, new_planner, trainable_strategy_names
from ..runtime.host_memory import keep_freed_host_memory
from ..runtime.processes import free_port
from ..simulator.report import gantt_title, write_gantt
from ..specs import ParallelConfig, SpecError, get_model
from ..workload import GlobalBatchSampler, TextCorpus, WorkloadError, corpus_long_document_note
from . import profiler
from .library_noise import ignore_library_warnings
from .profiler import QUICK_GRID

DEFAULT_STEPS = 10
DEFAULT_CONTEXT = 2048
DEFAULT_GLOBAL_BATCH = 2  # sequences of the context length per step (8K tokens)
STRATEGIES = ("megatron-fixed", "slimpack")
LOSS_RTOL = 1e-3  # per-step relative loss difference allowed (float32 round-off through Adam)
BOOTSTRAP_RESAMPLES = 4000
# Source files longer than the context are cut into pieces of the context length, each a sample
# of its own: the paper's setting, and what Megatron's fixed-length packing (the baseline) does to
# them too, so both strategies see the same documents. The demo says how many on its first line.
LONG_DOCUMENTS = "split"


@dataclass
class DemoOptions:
    steps: int = DEFAULT_STEPS
    data_dir: str | None = None
    model: str = "tiny"
    out_dir: str = "out/demo"
    json: bool = False
    pp: int = 2
    context_length: int = DEFAULT_CONTEXT
    global_batch_size: int = DEFAULT_GLOBAL_BATCH
    lr: float = 3e-3
    seed: int = 0
    plan_ahead: int = 1
    cost_model: str = "calibrated"
    solver_time_limit: float = 0.2
    strategies: tuple = STRATEGIES
    progress: bool = True
    timeout_s: float = 900.0

    @classmethod
    def from_args(cls, args) -> "DemoOptions":
        options = cls()
        for name in options.__dataclass_fields__:
            value = getattr(args, name, None)
            if value is not None:
                setattr(options, name, value)
        if isinstance(options.strategies, str):
            options.strategies = tuple(s.strip() for s in options.strategies.split(",") if s.strip())
        return options


class DemoOptionError(ValueError):
    """A `slimpack demo` option that cannot work, found before any process starts."""


# (option, its attribute, the least value it takes)
DEMO_NUMBERS = (("--steps", "steps", 1), ("--pp", "pp", 1), ("--context-length", "context_length", 1),
                ("--global-batch-size", "global_batch_size", 1), ("--plan-ahead", "plan_ahead", 0),
                ("--seed", "seed", 0))


def check_demo_options(options: DemoOptions) -> None:
    """Refuse what would fail inside the worker processes (as interleaved tracebacks, or a timeout),
    here in the parent: numbers out of range, unknown strategies or model, a missing data
    directory, an unreadable cost-model profile. Each `DemoOptionError` names the option and the fix."""
    for flag, name, least in DEMO_NUMBERS:
        value = getattr(options, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise DemoOptionError(f"{flag} must be an integer >= {least}, got {value!r}")
    if not options.lr > 0:
        raise DemoOptionError(f"--lr must be a positive number, got {options.lr!r}")
    _check_demo_strategies(options.strategies)
    _check_demo_model(options.model, options.pp)
    _check_demo_data_dir(options.data_dir)
    if options.cost_model != "calibrated":
        demo_cost_model(get_demo_spec(options.model), options.cost_model)  # raises on a bad profile


def _check_demo_strategies(strategies) -> None:
    known = trainable_strategy_names()
    if not strategies:
        raise DemoOptionError(f"--strategies names no strategy; give some of: {', '.join(known)}")
    unknown = [name for name in strategies if name not in known]
    if unknown:
        raise DemoOptionError(f"--strategies: {', '.join(map(repr, unknown))} cannot be trained by the demo; "
                              f"known: {', '.join(known)}")


def _check_demo_model(model: str, pp: int) -> None:
    try:
        ParallelConfig(pp=pp).check_model(get_demo_spec(model))
    except SpecError as error:
        raise DemoOptionError(f"--model {model} --pp {pp}: {error}") from None


def _check_demo_data_dir(data_dir: str | None) -> None:
    if data_dir is None:
        return
    if not Path(data_dir).expanduser().is_dir():
        raise DemoOptionError(f"--data-dir {data_dir} is not a directory; give a directory of *.py text files, "
                              "or leave the option out to train on Python's standard library")
    try:
        TextCorpus(data_dir)
    except WorkloadError as error:
        raise DemoOptionError(f"--data-dir {data_dir}: {error}") from None


def get_demo_spec(model: str):
    """The model preset `model` with the demo corpus's byte-level vocabulary."""
    try:
        return demo_model_spec(model, TextCorpus.VOCAB_SIZE)
    except ValueError as error:  # SpecError: an unknown preset, its message lists the known ones
        raise DemoOptionError(f"--model: {error}") from None


# ---- plans ----------------------------------------------------------------------------------
def make_plan_function(strategy: str, cost, parallel, config):
    """batch -> validated Plan with the simulator's prediction in metadata["predicted"]. The batch
    is planned with its sources, so every sample of the plan (a piece a baseline cut, a document
    WLB-LLM delayed from an earlier batch) says where its tokens are (`Plan.sample_sources`)."""
    planner = new_planner(strategy)
    config = config.with_(strategy=strategy)

    def plan_batch(batch):
        lengths = check_plan_input(batch.lengths, config.context_length)
        if strategy == "megatron-fixed":  # its packing, each document trained whole (see the module's docstring)
            plan = with_input_sources(prefix_keeping_fixed_plan(lengths, parallel, cost, config), batch.sources,
                                      len(lengths))
        else:
            plan = planner.plan(lengths, parallel, cost, config, sources=batch.sources)
        plan.validate()
        report = simulate(plan, cost)
        plan.metadata["predicted"] = {"iteration_s": report.iteration_time_s, "pp_imbalance": report.pp_imbalance,
                                      "dp_imbalance": report.dp_imbalance, "bubble_ratio": report.bubble_ratio}
        return plan

    return plan_batch


def model_config(spec, pp: int):
    import torch

    from ..runtime.model import tiny_config

    extra = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32) if pp > 1 else {}
    return tiny_config(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                       num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
                       ffn_hidden_size=spec.ffn_hidden_size, **extra)


# ---- one process (one pipeline stage) ------------------------------------------------------
def _worker(rank: int, world_size: int, port: int, options: DemoOptions, results) -> None:
    try:
        results.put((rank, "ok", _train(rank, world_size, port, options)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def _train(rank: int, world_size: int, port: int, options: DemoOptions) -> dict | None:
    """This process's whole demo: the strategies alternate step by step on the same batches, so
    machine load (other jobs on the CPU) affects them alike. Rank 0 returns every run's figures."""
    runner = DemoRunner(rank, world_size, port, options)
    for _ in range(options.steps):
        for run in runner.runs:
            runner.train_step(run)
    return runner.finish()


@dataclass
class StrategyRun:
    """One strategy on this rank: its model chunk (every strategy starts from the same weights),
    optimizer and background planner (`megatron.data.PlannerIterator`, which hands out each step's
    plan and token source); on rank 0 also its measured figures, one dict per step, and the compute
    tasks of its latest step (the Gantt chart)."""

    strategy: str
    chunk: Any
    optimizer: Any
    planner: Any
    steps: list[dict] = field(default_factory=list)
    gantt: list[dict] = field(default_factory=list)

    def record_step(self, planned, step_s: float, loss: float, tasks: list[dict], pp: int) -> dict:
        """Rank 0: the step's figures from its measured time, loss and compute tasks (all ranks')."""
        plan = planned.plan
        predicted = plan.metadata.get("predicted", {})
        busy = stage_busy_s(tasks, pp)
        mean_busy = sum(busy) / len(busy)
        tokens = plan.num_tokens  # WLB-LLM may delay some of the batch, or add earlier ones
        entry = {
            "iteration": len(self.steps) + 1, "loss": loss, "step_s": step_s, "tokens": tokens,
            "tokens_per_s": tokens / step_s, "predicted_s": predicted.get("iteration_s"),
            "pp_imbalance": max(busy) / mean_busy if mean_busy else 1.0,
            "predicted_pp_imbalance": predicted.get("pp_imbalance"),
            "dp_imbalance": predicted.get("dp_imbalance", 1.0),
            "planning_s": planned.planning_time_s,
            "exposed_s": min(planned.exposed_s, planned.planning_time_s),
            "micropacks": len(plan.replicas[0].micropacks),
            "documents": len(planned.batch.lengths),
            "stage_busy_s": busy,  # measured forward/backward compute per stage
        }
        self.steps.append(entry)
        self.gantt = tasks
        return entry

    def close(self) -> dict:
        """Stop the planner; its planning summary."""
        summary = self.planner.planning_summary()
        self.planner.close()
        return summary


def gantt_tasks(records, plan) -> list[dict]:
    """The measured forward/backward tasks of a step (`runtime.timing.TimedTask`s or their dicts),
    as Gantt records: rank, stage, kind, unit, start, end (seconds from the step's start) and detail
    (the unit's tokens, after "merge group [...]: " for a DP-Merge group's)."""
    tasks = []
    for record in records:
        r = record.to_dict() if hasattr(record, "to_dict") else dict(record)
        if r["kind"] not in ("F", "B"):
            continue
        replica = plan.replicas[r["replica"]]
        units = replica.forward_units if r["kind"] == "F" else replica.backward_units
        tokens = sum(replica.micropacks[mp].num_tokens for mp in units[r["unit"]])
        detail = f"{r['detail']}: {tokens} tokens" if r.get("detail") else f"{tokens} tokens"
        tasks.append({"rank": r["rank"], "stage": r["stage"], "kind": r["kind"], "unit": r["unit"],
                      "start": r["start"], "end": r["end"], "detail": detail})
    return tasks


def stage_busy_s(tasks: list[dict], pp: int) -> list[float]:
    """Measured forward/backward seconds per pipeline stage of replica 0 (data-parallel rank 0)."""
    return [sum(t["end"] - t["start"] for t in tasks if t["rank"] == 0 and t["stage"] == stage) for stage in range(pp)]


class DemoRunner:
    """One process of the demo, holding one pipeline stage of every strategy's model: sets up
    gloo and megatron's parallel state, builds a `StrategyRun` per strategy, runs their steps
    (`train_step`) and hands rank 0 the figures (`finish`).

    Task times come from the schedule's own timeline (`slimpack_forward_backward(...,
    timeline=...)`, runtime/pipeline/timing.py): every F/B task's compute interval on every rank, against a
    clock the ranks start together. They are gathered to rank 0 after the step, outside the timed
    interval; the step time is the wall time of schedule + optimizer step, the maximum over ranks.
    """

    def __init__(self, rank: int, world_size: int, port: int, options: DemoOptions):
        ignore_library_warnings()  # megatron-core's "not installed" notices, in every process; ours still show
        import torch

        keep_freed_host_memory()
        torch.set_num_threads(1)
        import torch.distributed as dist
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        from ..runtime import compat

        compat.apply()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=options.pp)
        model_parallel_cuda_manual_seed(options.seed + 1234)
        self.options, self.world_size, self.pp = options, world_size, options.pp
        self.stage = parallel_state.get_pipeline_model_parallel_rank()
        self.show = rank == 0
        self.corpus = TextCorpus(options.data_dir)
        spec = demo_model_spec(options.model, self.corpus.VOCAB_SIZE)
        parallel = ParallelConfig(dp=world_size // self.pp, pp=self.pp)
        config = SlimPackConfig(context_length=options.context_length, seed=options.seed,
                                solver_time_limit_s=options.solver_time_limit)
        self.runs = self._build_runs(spec, demo_cost_model(spec, options.cost_model), parallel, config)
        self.predicted_tag = "uncalibrated" if options.cost_model == "analytic" else "profiled"
        # Rank 0 logs each step (under a progress bar on a terminal); its warnings go through the log too.
        self.log = StepLog(options.steps * len(self.runs), progress=options.progress) if self.show else None
        if self.log is not None:
            self.log.capture_warnings()

    def _build_runs(self, spec, cost, parallel, config) -> list[StrategyRun]:
        """One model chunk, optimizer and planner per strategy, all chunks from the same weights."""
        import torch

        from ..runtime.model import build_gpt_model

        options = self.options
        runs, initial = [], None
        for strategy in options.strategies:
            torch.manual_seed(options.seed)
            chunk = build_gpt_model(model_config(spec, self.pp), vocab_size=self.corpus.VOCAB_SIZE,
                                    max_sequence_length=options.context_length, backend="torch",
                                    pre_process=self.stage == 0, post_process=self.stage == self.pp - 1)
            if initial is None:
                initial = {k: (v.detach().clone() if v is not None else None) for k, v in chunk.state_dict().items()}
            chunk.load_state_dict(initial)
            sampler = GlobalBatchSampler(self.corpus.lengths, options.context_length, options.global_batch_size,
                                         seed=options.seed, long_documents=LONG_DOCUMENTS)
            planner = PlannerIterator(sampler, make_plan_function(strategy, cost, parallel, config),
                                      plan_ahead=options.plan_ahead, steps=options.steps)
            runs.append(StrategyRun(strategy, chunk, torch.optim.Adam(chunk.parameters(), lr=options.lr), planner))
        return runs

    def train_step(self, run: StrategyRun) -> None:
        """One training step of `run` on its next planned batch, timed; rank 0 records and logs it."""
        import torch.distributed as dist

        from ..runtime.pipeline.schedule import slimpack_forward_backward
        from ..runtime.pipeline.timing import Timeline

        planned = next(run.planner)
        plan = planned.plan
        run.optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        timeline = Timeline(gather=False)  # gathered below, after the timed interval
        began = time.perf_counter()
        result = slimpack_forward_backward(model=[run.chunk], plan=plan, token_source=planned.token_source(self.corpus),
                                           timeline=timeline)
        run.optimizer.step()
        elapsed = time.perf_counter() - began
        mine = (elapsed, result.loss, [r.to_dict() for r in timeline.compute_records()])
        everyone: list[Any] | None = [None] * self.world_size if self.show else None
        dist.gather_object(mine, everyone, dst=0)
        if everyone is None:  # not self.show
            return
        step_s = max(elapsed for elapsed, _, _ in everyone)
        loss = everyone[self.pp - 1][1]  # the last pipeline stage of replica 0 (dp=1 here)
        tasks = gantt_tasks([r for _, _, records in everyone for r in records], plan)
        entry = run.record_step(planned, step_s, loss, tasks, self.pp)
        log = cast(StepLog, self.log)  # there is one where the steps are shown
        log.line(step_line(run.strategy, entry, self.options.steps, self.predicted_tag))
        log.advance()

    def finish(self) -> dict | None:
        """Stop the planners and the process group; rank 0's result (None elsewhere)."""
        import torch.distributed as dist

        if self.log is not None:
            self.log.close()
        out: dict = {"runs": {}, "stage_params": sum(p.numel() for p in self.runs[0].chunk.parameters())}
        for run in self.runs:
            planning = run.close()
            if self.show:
                out["runs"][run.strategy] = {"steps": run.steps, "planning": planning, "gantt": run.gantt}
        dist.barrier()
        dist.destroy_process_group()
        return out if self.show else None


def demo_model_spec(model: str, vocab_size: int):
    """The model preset, with the corpus's (byte-level) vocabulary."""
    spec = get_model(model)
    if spec.vocab_size != vocab_size:
        spec = spec.__class__(**{**spec.to_dict(), "vocab_size": vocab_size})
    return spec


def demo_cost_model(spec, cost_model: str):
    """The planners' and the prediction's cost model: "analytic" (uncalibrated CPU figures) or a
    `slimpack profile` JSON measured on this machine."""
    return CostModel.load(cost_model, spec, "cpu", dtype_bytes=4, attention_backend="torch")


def predicted_by(cost_model: str) -> str:
    """What the "predicted" figures come from, for the table's header and legend."""
    if cost_model == "analytic":
        return "uncalibrated analytic CPU model"
    return f"cost model profiled in {cost_model}"


def profile_cache_key(options: DemoOptions) -> str:
    """What a calibration depends on: the machine, the library versions, the demo model and its stages."""
    import hashlib
    import os
    import platform

    import torch

    try:
        from importlib.metadata import version

        megatron = version("megatron-core")
    except Exception:  # noqa: BLE001 - not installed as a distribution: the key says so
        megatron = "unknown"
    parts = [platform.machine(), platform.processor(), str(os.cpu_count()), platform.python_version(),
             torch.__version__, megatron, __version__, options.model, str(options.pp)]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def profile_cache_dir() -> Path:
    import os

    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "megatron-slimpack"


def calibrated_profile(options: DemoOptions, log: Callable[[str], None]) -> str:
    """Path of this machine's profile of the demo model: the cached one for this machine and these
    library versions, or a quick `slimpack profile` (its small grid, about half a minute on 2
    cores) written there first."""
    path = profile_cache_dir() / f"profile-{options.model}-pp{options.pp}-{profile_cache_key(options)}.json"
    if path.exists():
        log(f"cost model: this machine's profile, cached at {path}")
        return str(path)
    log(f"cost model: profiling this machine (once; cached at {path}) ...")
    began = time.perf_counter()
    result = profiler.profile(get_demo_spec(options.model), pp=options.pp, grid=QUICK_GRID, repeats=3,
                              progress=None, seed=options.seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    result.write(path)
    log(f"cost model: profiled in {time.perf_counter() - began:.0f} s")
    return str(path)


def step_line(strategy: str, e: dict, total: int, predicted_tag: str = "uncalibrated") -> str:
    """One training step's log line (Megatron's style)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    predicted = f"{e['predicted_s'] * 1000:9.1f}" if e["predicted_s"] is not None else "        -"
    return (f" [{stamp}] [{strategy:>14}] iteration {e['iteration']:5d}/{total:5d} | "
            f"elapsed time per iteration (ms): {e['step_s'] * 1000:8.1f} | "
            f"predicted (ms, {predicted_tag}): {predicted} | "
            f"tokens/s: {e['tokens_per_s']:8.0f} | lm loss: {e['loss']:.6E} | micropacks: {e['micropacks']:3d} | "
            f"PP imbalance: {e['pp_imbalance']:.3f} | DP imbalance: {e['dp_imbalance']:.3f} | "
            f"planning (ms): {e['planning_s'] * 1000:6.1f} (exposed {e['exposed_s'] * 1000:5.1f}) |")


def _is_terminal(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False


class StepLog:
    """The demo's log on `stream` (default: stderr) and its progress bar, which never overwrite
    each other: on a terminal every line goes through the bar (`tqdm.write` lifts the bar, prints
    the line, redraws the bar under it), and so do the warnings of this process once
    `capture_warnings()` is called. Elsewhere (a log file, a pipe, a test's capture) there is no
    bar: plain lines without carriage returns, readable as a file."""

    def __init__(self, total: int, *, progress: bool = True, stream=None, desc: str = "demo steps"):
        self.stream = stream if stream is not None else sys.stderr
        self.bar = None
        self._showwarning: Callable[..., None] | None = None
        if progress and _is_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, file=self.stream, leave=False)

    def line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream)
        self.stream.flush()

    def advance(self, steps: int = 1) -> None:
        if self.bar is not None:
            self.bar.update(steps)

    def capture_warnings(self) -> None:
        """Python warnings of this process become log lines (until `close`)."""
        if self._showwarning is None:
            self._showwarning = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                self.line(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"))

            warnings.showwarning = show

    def close(self) -> None:
        if self._showwarning is not None:
            warnings.showwarning, self._showwarning = self._showwarning, None
        if self.bar is not None:
            self.bar.close()
            self.bar = None


# ---- driver ---------------------------------------------------------------------------------
def launch(options: DemoOptions) -> dict:
    """Run the `pp` processes; return rank 0's result."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    port = free_port()
    world = options.pp
    procs = [context.Process(target=_worker, args=(r, world, port, options, results), daemon=True)
             for r in range(world)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + options.timeout_s
    outcome: dict[int, tuple] = {}
    while len(outcome) < world and time.monotonic() < deadline:
        if not results.empty():
            rank, status, payload = results.get()
            outcome[rank] = (status, payload)
            if status == "error":
                break
        elif not any(p.is_alive() for p in procs) and results.empty():
            break
        else:
            time.sleep(0.05)
    for proc in procs:
        proc.join(max(0.0, min(10.0, deadline - time.monotonic())))
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join()
    errors = [(r, p) for r, (s, p) in outcome.items() if s == "error"]
    if errors:
        raise RuntimeError(f"demo rank {errors[0][0]} failed:\n{errors[0][1]}")
    if 0 not in outcome:
        codes = [p.exitcode for p in procs]
        raise RuntimeError(f"demo processes did not finish (exit codes {codes}; timeout {options.timeout_s:.0f}s)")
    return outcome[0][1]


def summarize(result: dict, options: DemoOptions) -> dict:
    """Per-strategy means (first step excluded from timing as warm-up when there are more),
    measured speedup and the loss comparison."""
    rows = {}
    for strategy, run in result["runs"].items():
        steps = run["steps"]
        timed = steps[1:] if len(steps) > 1 else steps
        mean = lambda key, timed=timed: sum(s[key] for s in timed) / len(timed)  # noqa: E731
        predicted = [s["predicted_s"] for s in timed if s["predicted_s"] is not None]
        rows[strategy] = {
            "strategy": strategy, "steps": len(steps), "ms_per_iter": mean("step_s") * 1000,
            "median_ms_per_iter": _median([s["step_s"] for s in timed]) * 1000,
            "tokens_per_s": sum(s["tokens"] for s in timed) / sum(s["step_s"] for s in timed),
            "predicted_ms": sum(predicted) / len(predicted) * 1000 if predicted else None,
            "measured_over_predicted": (_median([s["step_s"] for s in timed]) / _median(predicted)
                                        if predicted else None),
            "pp_imbalance": mean("pp_imbalance"), "dp_imbalance": mean("dp_imbalance"),
            "micropacks": mean("micropacks"),
            "stage_busy_ms": [sum(s["stage_busy_s"][i] for s in timed) / len(timed) * 1000
                              for i in range(len(timed[0].get("stage_busy_s", [])))],
            # idle share of the step on the busiest stage (pipeline bubbles, waits, optimizer)
            "idle_fraction": (1 - sum(max(s["stage_busy_s"]) for s in timed) / sum(s["step_s"] for s in timed)
                              if timed[0].get("stage_busy_s") else None),
            "planning_ms": run["planning"]["planning_s"] / max(1, len(steps)) * 1000,
            "hidden_fraction": run["planning"]["hidden_fraction"],
            "first_loss": steps[0]["loss"], "final_loss": steps[-1]["loss"],
            "losses": [s["loss"] for s in steps],
        }
    summary = {"options": {k: v for k, v in options.__dict__.items() if k != "strategies"},
               "strategies": list(rows), "rows": rows, "predicted_by": predicted_by(options.cost_model)}
    if "megatron-fixed" in rows and "slimpack" in rows:
        base, ours = rows["megatron-fixed"], rows["slimpack"]
        # The median is robust to other jobs on a shared CPU; the mean is reported alongside.
        summary["speedup"] = base["median_ms_per_iter"] / ours["median_ms_per_iter"]
        summary["speedup_mean"] = base["ms_per_iter"] / ours["ms_per_iter"]
        runs = result["runs"]
        paired = [(a["step_s"], b["step_s"]) for a, b in zip(runs["megatron-fixed"]["steps"][1:],
                                                              runs["slimpack"]["steps"][1:])]
        summary["paired"] = paired_speedup(paired, seed=options.seed)
        if base["predicted_ms"] and ours["predicted_ms"]:
            summary["predicted_speedup"] = base["predicted_ms"] / ours["predicted_ms"]
        diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(base["losses"], ours["losses"])]
        summary["max_loss_rel_diff"] = max(diffs)
        summary["first_step_loss_rel_diff"] = diffs[0]
        summary["losses_match"] = max(diffs) <= LOSS_RTOL
    ours = rows.get("slimpack") or next(iter(rows.values()))
    summary["loss_decreased"] = ours["final_loss"] < ours["first_loss"]
    return summary


def paired_speedup(paired: list[tuple[float, float]], *, seed: int = 0,
                   resamples: int = BOOTSTRAP_RESAMPLES) -> dict:
    """The median of per-step ratios baseline/slimpack over steps run back to back on the same
    batch (load from other jobs hits both alike), with a percentile bootstrap 95% interval, and
    the verdict: "faster" / "slower" where the interval is on one side of 1.0, "undecided" where
    it crosses it (the machine too noisy for these steps)."""
    import numpy as np

    if not paired:
        return {"steps": 0, "median": None, "low": None, "high": None, "verdict": "undecided"}
    ratios = np.array([base / ours for base, ours in paired])
    rng = np.random.default_rng(seed)
    medians = np.median(ratios[rng.integers(0, len(ratios), size=(resamples, len(ratios)))], axis=1)
    low, high = (float(v) for v in np.percentile(medians, [2.5, 97.5]))
    verdict = "faster" if low > 1.0 else "slower" if high < 1.0 else "undecided"
    return {"steps": len(ratios), "median": float(np.median(ratios)), "low": low, "high": high, "verdict": verdict}


def headline(summary: dict) -> list[str]:
    """The predicted gain, then the measured one with its interval and what it lets one say."""
    rows, lines = summary["rows"], []
    if summary.get("predicted_speedup"):
        lines.append(f"predicted speedup of slimpack over megatron-fixed ({summary['predicted_by']}): "
                     f"{summary['predicted_speedup']:.3f}x")
    paired = summary["paired"]
    ratios = ", ".join(f"{r['strategy']} {r['measured_over_predicted']:.2f}" for r in rows.values()
                       if r.get("measured_over_predicted") is not None)
    if paired["median"] is None:
        return lines + ["measured speedup: no paired steps after the warm-up step; run more --steps"]
    interval = (f"median of {paired['steps']} paired step ratios {paired['median']:.3f}x, "
                f"95% interval [{paired['low']:.3f}, {paired['high']:.3f}]")
    if paired["verdict"] == "faster":
        lines.append(f"measured: slimpack faster than megatron-fixed, {interval}")
    elif paired["verdict"] == "slower":
        lines.append(f"measured: slimpack SLOWER than megatron-fixed, {interval}")
    else:
        lines.append(f"measured: too noisy to decide on this machine now ({interval}: it crosses 1.0); "
                     "rerun on a quieter machine or with more --steps")
    if ratios:
        lines.append(f"measured/predicted median step time: {ratios}")
    return lines


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def format_summary(summary: dict) -> str:
    rows = summary["rows"]
    source = summary.get("predicted_by", predicted_by("analytic"))
    header = (f"| strategy | steps | ms/iter (mean) | ms/iter (median) | tokens/s | predicted ms/iter ({source}) "
              "| PP imbalance | DP imbalance | MicroPacks | planning ms/step | planning hidden | first loss "
              "| final loss |")
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows.values():
        predicted = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] is not None else "-"
        lines.append(f"| {r['strategy']} | {r['steps']} | {r['ms_per_iter']:.1f} | {r['median_ms_per_iter']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | "
                     f"{predicted} | {r['pp_imbalance']:.3f} | {r['dp_imbalance']:.3f} | {r['micropacks']:.1f} | "
                     f"{r['planning_ms']:.1f} | {r['hidden_fraction']:.0%} | {r['first_loss']:.6f} | "
                     f"{r['final_loss']:.6f} |")
    lines.append("")
    lines.append(_predicted_legend(source, rows))
    if "speedup" in summary:
        lines.append("")
        lines += headline(summary)
        lines.append(f"(ratio of median step times {summary['speedup']:.3f}x, of means {summary['speedup_mean']:.3f}x; "
                     "first step excluded as warm-up; the strategies alternate step by step)")
        base, ours = rows["megatron-fixed"]["losses"], rows["slimpack"]["losses"]
        lines.append("losses per step (megatron-fixed vs slimpack):")
        for i, (a, b) in enumerate(zip(base, ours)):
            lines.append(f"  step {i + 1:3d}: {a:.7f}  {b:.7f}  rel diff {abs(a - b) / max(abs(a), 1e-12):.1e}")
        verdict = "OK" if summary["losses_match"] else "MISMATCH"
        lines.append(f"loss check: {verdict} (max relative difference {summary['max_loss_rel_diff']:.1e}, "
                     f"step 1 {summary['first_step_loss_rel_diff']:.1e}; tolerance {LOSS_RTOL:.0e})")
    lines.append(f"loss decreased: {'yes' if summary['loss_decreased'] else 'NO'}")
    for path in summary.get("gantt_files", []):
        lines.append(f"Gantt chart of a measured step: {path}")
    return "\n".join(lines)


def _predicted_legend(source: str, rows: dict) -> str:
    """The table's note on its "predicted" column: what model it comes from and how far off it is."""
    ratios = ", ".join(f"{r['strategy']} {r['measured_over_predicted']:.2f}" for r in rows.values()
                       if r.get("measured_over_predicted") is not None)
    measured = f"; measured/predicted median step time: {ratios}" if ratios else ""
    if source == predicted_by("analytic"):
        return ("predicted ms/iter: the simulator's step time for each plan from the analytic CPU cost model, "
                "UNCALIBRATED (generic CPU figures, not fitted to this machine)"
                f"{measured}. Without --cost-model analytic the demo profiles this machine first "
                "(or give `--cost-model profile.json` from `slimpack profile`)")
    return f"predicted ms/iter: the simulator's step time for each plan from the {source}{measured}"


def run_demo(args) -> int:
    options = DemoOptions.from_args(args)
    check_demo_options(options)
    out_dir = Path(options.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if options.json:
        options.progress = False
    began = time.perf_counter()
    if options.cost_model == "calibrated":
        options.cost_model = calibrated_profile(options, lambda line: print(line, file=sys.stderr, flush=True))
    print(f"slimpack demo: model {options.model}, pp={options.pp} gloo processes on CPU, context "
          f"{options.context_length}, {options.global_batch_size} sequences/step, {options.steps} steps per strategy, "
          f"text from {options.data_dir or 'the Python standard library'}", file=sys.stderr, flush=True)
    note = corpus_long_document_note(TextCorpus(options.data_dir).lengths, options.context_length, LONG_DOCUMENTS,
                                     options=(None, "--context-length"))
    if note:
        print(f"slimpack demo: {note}", file=sys.stderr, flush=True)
    result = launch(options)
    summary = summarize(result, options)
    summary["gantt_files"] = []
    for strategy, run in result["runs"].items():
        summary["rows"][strategy]["last_step_tasks"] = run["gantt"]
        if run["gantt"]:
            path = out_dir / f"gantt_{strategy}.png"
            last = run["steps"][-1]
            write_gantt(run["gantt"], path,
                        title=gantt_title(strategy, f"pp{options.pp}", model=options.model,
                                          context_length=options.context_length, iteration_s=last["step_s"],
                                          hardware="CPU (gloo processes)", step=len(run["steps"]), measured=True))
            summary["gantt_files"].append(str(path))
    summary["wall_s"] = time.perf_counter() - began
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    if options.json:
        print(json.dumps(summary, indent=1, default=float))
    else:
        print(format_summary(summary))
        print(f"(demo wall time {summary['wall_s']:.0f} s; summary in {out_dir / 'summary.json'})")
    ok = summary.get("losses_match", True)
    return 0 if ok else 1
