"""`slimpack demo`: train a small Llama-style GPT on CPU with megatron-core, Megatron's fixed-length
packing and SlimPack back to back on the same global batches, and compare them.

What runs (design.md section 7, "On CPU, megatron.training cannot start"): `pp` gloo processes
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
the objective.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

DEFAULT_STEPS = 10
DEFAULT_CONTEXT = 2048
DEFAULT_GLOBAL_BATCH = 2  # sequences of the context length per step (8K tokens)
STRATEGIES = ("megatron-fixed", "slimpack")
LOSS_RTOL = 1e-3  # per-step relative loss difference allowed (float32 round-off through Adam)


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
    cost_model: str = "analytic"
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


# ---- plans ----------------------------------------------------------------------------------
def exact_fixed_plan(plan, lengths: list[int], parallel, sources=None):
    """Megatron's fixed-length packing with exact attention: the `megatron-fixed` plan's
    sequences, with each piece mapped back to the entry of the batch it was cut from (a piece of
    a document that crosses a cut becomes a continuation slice with its KV prefix), 1F1B per
    sequence. Entry i of the batch is `lengths[i]` tokens from `sources[i]` (document, offset)
    (default (i, 0), as the planner's); the fixed plan's pieces follow the entries in stream order
    (sample ids), and each piece's recorded source must be where that puts it."""
    from .plan import MicroPack, Plan, PlanError, Slice, check_sources, overlapping_documents, samples_of
    from .solver.baselines import schedule_1f1b

    sources = check_sources(sources, len(lengths))
    where = {}  # sample id of the fixed plan -> (batch entry, first token of the piece in it)
    entry, used = 0, 0
    for (sample_id, length), (document, offset) in sorted(zip(plan.samples, plan.sample_sources)):
        if entry == len(lengths) or (document, offset) != (sources[entry][0], sources[entry][1] + used) \
                or used + length > lengths[entry]:
            raise PlanError(f"sample {sample_id} of the megatron-fixed plan (document {document}, tokens [{offset}, "
                            f"{offset + length})) is not the next piece of the batch's entries")
        where[sample_id] = (entry, used)
        used += length
        if used == lengths[entry]:
            entry, used = entry + 1, 0
    if entry != len(lengths):
        raise PlanError(f"the megatron-fixed plan covers {entry} of the batch's {len(lengths)} entries")
    replicas = []
    for replica in plan.replicas:
        micropacks = []
        for micropack in replica.micropacks:
            slices = []
            for piece in micropack.slices:
                index, start = where[piece.sample_id]
                slices.append(Slice(index, start + piece.start, start + piece.end))
            micropacks.append(MicroPack(slices))
        replicas.append(schedule_1f1b(micropacks, parallel, replica.dp_ranks))
    metadata = {k: v for k, v in plan.metadata.items() if k != "pieces"}
    return Plan(replicas, samples_of(lengths), parallel, plan.context_length, "megatron-fixed",
                plan.max_micropack_tokens, metadata, sources, overlapping_documents(sources, lengths)).validate()


def make_plan_function(strategy: str, cost, parallel, config):
    """batch -> validated Plan with the simulator's prediction in metadata["predicted"]. The batch
    is planned with its sources, so every sample of the plan (a piece a baseline cut, a document
    WLB-LLM delayed from an earlier batch) says where its tokens are (`Plan.sample_sources`)."""
    from . import simulate
    from .solver.strategies import check_plan_input, new_planner

    planner = new_planner(strategy)
    config = config.with_(strategy=strategy)

    def plan_batch(batch):
        lengths = check_plan_input(batch.lengths, config.context_length)
        plan = planner.plan(lengths, parallel, cost, config, sources=batch.sources)
        if strategy == "megatron-fixed":
            plan = exact_fixed_plan(plan, lengths, parallel, batch.sources)
        plan.validate()
        report = simulate(plan, cost)
        plan.metadata["predicted"] = {"iteration_s": report.iteration_time_s, "pp_imbalance": report.pp_imbalance,
                                      "dp_imbalance": report.dp_imbalance, "bubble_ratio": report.bubble_ratio}
        return plan

    return plan_batch


def model_config(spec, pp: int):
    import torch

    from .runtime.model import tiny_config

    extra = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32) if pp > 1 else {}
    return tiny_config(num_layers=spec.num_layers, hidden_size=spec.hidden_size,
                       num_attention_heads=spec.num_attention_heads, num_query_groups=spec.num_query_groups,
                       ffn_hidden_size=spec.ffn_hidden_size, **extra)


# ---- measured task times ---------------------------------------------------------------------
class TaskTimer:
    """Records perf_counter intervals of the executor's per-MicroPack forward/backward calls
    (wrapping `runtime.executor.forward_step` / `backward_step` in this process), so a step's
    units can be drawn as compute bars without their receive waits."""

    def __init__(self):
        self.calls: list[tuple[str, float, float]] = []
        self._saved = None

    def __enter__(self):
        from .runtime import executor

        self._saved = (executor.forward_step, executor.backward_step)
        forward, backward = self._saved

        def timed(kind, function):
            def call(*args, **kwargs):
                began = time.perf_counter()
                try:
                    return function(*args, **kwargs)
                finally:
                    self.calls.append((kind, began, time.perf_counter()))
            return call

        executor.forward_step, executor.backward_step = timed("F", forward), timed("B", backward)
        return self

    def __exit__(self, *exc):
        from .runtime import executor

        executor.forward_step, executor.backward_step = self._saved

    def unit_records(self, reports, rank: int, stage: int) -> list[dict]:
        """One record per `UnitReport`: start of its first MicroPack call, end of its last."""
        records, cursor = [], {"F": 0, "B": 0}
        by_kind = {kind: [c for c in self.calls if c[0] == kind] for kind in ("F", "B")}
        for report in reports:
            count = len(report.micropacks)
            calls = by_kind[report.kind][cursor[report.kind]:cursor[report.kind] + count]
            if not calls:
                continue
            cursor[report.kind] += count
            records.append({"rank": rank, "stage": stage, "kind": report.kind, "unit": report.index,
                            "start": calls[0][1], "end": calls[-1][2], "detail": f"{report.tokens} tokens"})
        return records


# ---- one process (one pipeline stage) ------------------------------------------------------
def _worker(rank: int, world_size: int, port: int, options: DemoOptions, results) -> None:
    try:
        results.put((rank, "ok", _train(rank, world_size, port, options)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
        raise


def _train(rank: int, world_size: int, port: int, options: DemoOptions) -> dict | None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch

    from .runtime.host_memory import keep_freed_host_memory

    keep_freed_host_memory()
    torch.set_num_threads(1)
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from .config import SlimPackConfig
    from .costmodel import CostModel
    from .megatron.data import PlannerIterator
    from .runtime import compat
    from .runtime.model import build_gpt_model
    from .runtime.schedule import slimpack_forward_backward
    from .specs import ParallelConfig, get_model
    from .workload import GlobalBatchSampler, TextCorpus

    compat.apply()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    pp = options.pp
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    model_parallel_cuda_manual_seed(options.seed + 1234)
    stage = parallel_state.get_pipeline_model_parallel_rank()
    dp = world_size // pp
    dp_rank = parallel_state.get_data_parallel_rank()
    spec = get_model(options.model)
    corpus = TextCorpus(options.data_dir)
    if spec.vocab_size != corpus.VOCAB_SIZE:
        spec = spec.__class__(**{**spec.to_dict(), "vocab_size": corpus.VOCAB_SIZE})
    cost = (CostModel.analytic(spec, "cpu", dtype_bytes=4, attention_backend="torch")
            if options.cost_model == "analytic" else CostModel.from_profile(options.cost_model))
    parallel = ParallelConfig(dp=dp, pp=pp)
    config = SlimPackConfig(context_length=options.context_length, seed=options.seed,
                            solver_time_limit_s=options.solver_time_limit)

    def build_chunk():
        torch.manual_seed(options.seed)
        return build_gpt_model(model_config(spec, pp), vocab_size=corpus.VOCAB_SIZE,
                               max_sequence_length=options.context_length, backend="torch",
                               pre_process=stage == 0, post_process=stage == pp - 1)

    # One model copy, optimizer and planner iterator per strategy, all from the same weights; the
    # strategies then alternate step by step on the same batches, so machine load (other jobs on
    # the CPU) affects both alike.
    runs = {}
    initial = None
    for strategy in options.strategies:
        chunk = build_chunk()
        if initial is None:
            initial = {k: (v.detach().clone() if v is not None else None) for k, v in chunk.state_dict().items()}
        chunk.load_state_dict(initial)
        sampler = GlobalBatchSampler(corpus.lengths, options.context_length, options.global_batch_size,
                                     seed=options.seed)
        runs[strategy] = {
            "chunk": chunk, "optimizer": torch.optim.Adam(chunk.parameters(), lr=options.lr),
            "planner": PlannerIterator(sampler, make_plan_function(strategy, cost, parallel, config),
                                       plan_ahead=options.plan_ahead, steps=options.steps),
            "steps": [], "gantt": [],
        }
    show = rank == 0
    out: dict = {"runs": {}, "stage_params": sum(p.numel() for p in runs[options.strategies[0]]["chunk"].parameters())}
    bar = None
    if show and options.progress:
        from tqdm import tqdm

        bar = tqdm(total=options.steps * len(runs), desc="demo steps", file=sys.stderr, leave=False)
    for _ in range(options.steps):
        for strategy, run in runs.items():
            planned = next(run["planner"])
            chunk, optimizer = run["chunk"], run["optimizer"]
            optimizer.zero_grad(set_to_none=True)
            dist.barrier()
            with TaskTimer() as timer:
                began = time.perf_counter()
                result = slimpack_forward_backward(model=[chunk], plan=planned.plan,
                                                   token_source=planned.token_source(corpus),
                                                   num_microbatches=len(planned.plan.replicas[0].micropacks),
                                                   seq_length=options.context_length, micro_batch_size=1)
                optimizer.step()
                ended = time.perf_counter()
            records = timer.unit_records(result, dp_rank, stage)
            compute = sum(r["end"] - r["start"] for r in records)
            figures = torch.tensor([ended - began, result.loss or 0.0, compute], dtype=torch.float64)
            gathered = [torch.zeros_like(figures) for _ in range(world_size)]
            dist.all_gather(gathered, figures)
            step_s = max(float(g[0]) for g in gathered)
            loss = float(gathered[pp - 1][1])  # the last pipeline stage of replica 0 (dp=1 here)
            stage_compute = [float(g[2]) for g in gathered[:pp]]
            record_lists = [None] * world_size
            dist.all_gather_object(record_lists, [dict(r, start=r["start"] - began, end=r["end"] - began)
                                                  for r in records])
            if show:
                run["gantt"] = [r for rank_records in record_lists for r in rank_records]
                predicted = planned.plan.metadata.get("predicted", {})
                tokens = planned.plan.num_tokens  # WLB-LLM may delay some of the batch, or add earlier ones
                mean_compute = sum(stage_compute) / len(stage_compute)
                entry = {
                    "iteration": len(run["steps"]) + 1, "loss": loss, "step_s": step_s, "tokens": tokens,
                    "tokens_per_s": tokens / step_s, "predicted_s": predicted.get("iteration_s"),
                    "pp_imbalance": max(stage_compute) / mean_compute if mean_compute else 1.0,
                    "predicted_pp_imbalance": predicted.get("pp_imbalance"),
                    "dp_imbalance": predicted.get("dp_imbalance", 1.0),
                    "planning_s": planned.planning_time_s,
                    "exposed_s": min(planned.exposed_s, planned.planning_time_s),
                    "micropacks": len(planned.plan.replicas[0].micropacks),
                    "documents": len(planned.batch.lengths),
                    "stage_busy_s": stage_compute,  # measured forward/backward compute per stage
                }
                run["steps"].append(entry)
                _log(strategy, entry, options.steps, bar)
    if bar is not None:
        bar.close()
    for strategy, run in runs.items():
        summary = run["planner"].planning_summary()
        run["planner"].close()
        if show:
            out["runs"][strategy] = {"steps": run["steps"], "planning": summary, "gantt": run["gantt"]}
    dist.barrier()
    dist.destroy_process_group()
    return out if show else None


def _log(strategy: str, e: dict, total: int, bar) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    predicted = f"{e['predicted_s'] * 1000:9.1f}" if e["predicted_s"] is not None else "        -"
    line = (f" [{stamp}] [{strategy:>14}] iteration {e['iteration']:5d}/{total:5d} | "
            f"elapsed time per iteration (ms): {e['step_s'] * 1000:8.1f} | predicted (ms): {predicted} | "
            f"tokens/s: {e['tokens_per_s']:8.0f} | lm loss: {e['loss']:.6E} | micropacks: {e['micropacks']:3d} | "
            f"PP imbalance: {e['pp_imbalance']:.3f} | DP imbalance: {e['dp_imbalance']:.3f} | "
            f"planning (ms): {e['planning_s'] * 1000:6.1f} (exposed {e['exposed_s'] * 1000:5.1f}) |")
    if bar is not None:
        bar.write(line, file=sys.stderr)
        bar.update(1)
        sys.stderr.flush()
    else:
        print(line, file=sys.stderr, flush=True)


# ---- driver ---------------------------------------------------------------------------------
def launch(options: DemoOptions) -> dict:
    """Run the `pp` processes; return rank 0's result."""
    import torch.multiprocessing as mp

    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    from .runtime.processes import free_port

    port = free_port()
    world = options.pp
    procs = [context.Process(target=_worker, args=(r, world, port, options, results), daemon=True) for r in range(world)]
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
        mean = lambda key: sum(s[key] for s in timed) / len(timed)  # noqa: E731
        predicted = [s["predicted_s"] for s in timed if s["predicted_s"] is not None]
        rows[strategy] = {
            "strategy": strategy, "steps": len(steps), "ms_per_iter": mean("step_s") * 1000,
            "median_ms_per_iter": _median([s["step_s"] for s in timed]) * 1000,
            "tokens_per_s": sum(s["tokens"] for s in timed) / sum(s["step_s"] for s in timed),
            "predicted_ms": sum(predicted) / len(predicted) * 1000 if predicted else None,
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
               "strategies": list(rows), "rows": rows}
    if "megatron-fixed" in rows and "slimpack" in rows:
        base, ours = rows["megatron-fixed"], rows["slimpack"]
        # The median is robust to other jobs on a shared CPU; the mean is reported alongside.
        summary["speedup"] = base["median_ms_per_iter"] / ours["median_ms_per_iter"]
        summary["speedup_mean"] = base["ms_per_iter"] / ours["ms_per_iter"]
        diffs = [abs(a - b) / max(abs(a), 1e-12) for a, b in zip(base["losses"], ours["losses"])]
        summary["max_loss_rel_diff"] = max(diffs)
        summary["first_step_loss_rel_diff"] = diffs[0]
        summary["losses_match"] = max(diffs) <= LOSS_RTOL
    ours = rows.get("slimpack") or next(iter(rows.values()))
    summary["loss_decreased"] = ours["final_loss"] < ours["first_loss"]
    return summary


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def format_summary(summary: dict) -> str:
    rows = summary["rows"]
    header = ("| strategy | steps | ms/iter (mean) | ms/iter (median) | tokens/s | predicted ms/iter | PP imbalance | DP imbalance | "
              "MicroPacks | planning ms/step | planning hidden | first loss | final loss |")
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows.values():
        predicted = f"{r['predicted_ms']:.1f}" if r["predicted_ms"] is not None else "-"
        lines.append(f"| {r['strategy']} | {r['steps']} | {r['ms_per_iter']:.1f} | {r['median_ms_per_iter']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | "
                     f"{predicted} | {r['pp_imbalance']:.3f} | {r['dp_imbalance']:.3f} | {r['micropacks']:.1f} | "
                     f"{r['planning_ms']:.1f} | {r['hidden_fraction']:.0%} | {r['first_loss']:.6f} | "
                     f"{r['final_loss']:.6f} |")
    if "speedup" in summary:
        lines.append("")
        lines.append(f"measured speedup of slimpack over megatron-fixed: {summary['speedup']:.3f}x median step time "
                     f"({summary['speedup_mean']:.3f}x mean; first step excluded as warm-up; the strategies "
                     "alternate step by step, so load from other jobs hits both alike)")
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


def run_demo(args) -> int:
    options = DemoOptions.from_args(args)
    if options.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {options.steps}")
    out_dir = Path(options.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if options.json:
        options.progress = False
    began = time.perf_counter()
    print(f"slimpack demo: model {options.model}, pp={options.pp} gloo processes on CPU, context "
          f"{options.context_length}, {options.global_batch_size} sequences/step, {options.steps} steps per strategy, "
          f"text from {options.data_dir or 'the Python standard library'}", file=sys.stderr, flush=True)
    result = launch(options)
    summary = summarize(result, options)
    from .simulator.report import write_gantt

    summary["gantt_files"] = []
    for strategy, run in result["runs"].items():
        summary["rows"][strategy]["last_step_tasks"] = run["gantt"]
        if run["gantt"]:
            path = out_dir / f"gantt_{strategy}.png"
            write_gantt(run["gantt"], path, title=f"{strategy}: measured step {len(run['steps'])} (pp={options.pp}, CPU)")
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


def main(argv=None) -> int:  # python -m megatron_slimpack.demo
    from .cli import main as cli_main

    return cli_main(["demo", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
