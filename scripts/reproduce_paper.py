#!/usr/bin/env python3
"""Run the simulated paper grid on a GPU cluster, each strategy in the layout the grid chose for it.

What it reproduces: benchmarks/results/paper_table.json, the grid of configs/bench/paper.yaml (model x
context x GPUs x dataset) simulated by benchmarks/paper_table.py, where every strategy runs in its own
best memory-feasible layout (e.g. "tp2 pp1 cp2 dp32 rc-selective"). For every cell and every strategy
of the cell one Megatron-LM `pretrain_gpt.py` run is generated with exactly that layout:

  megatron-fixed, megatron-stock
      stock Megatron-LM (no --slimpack): --tensor/--pipeline/--context-parallel-size from the layout.
  every strategy the SlimPack plugin trains (megatron_slimpack.planner.strategies.trainable_strategy_names():
  slimpack, its ablations, wlb-llm, slimpipe, ...)
      --slimpack --slimpack-strategy NAME --calculate-per-token-loss --micro-batch-size 1 --no-rope-fusion;
      for slimpack and slimpack-sym a layout's cp K is a base merge: --context-parallel-size 1, K times the
      data-parallel replicas and --slimpack-base-merge K (docs/megatron.md).

Shared by every run: the model's sizes (megatron_slimpack.specs.MODELS; GQA as --group-query-attention
--num-query-groups), --seq-length / --max-position-embeddings = the context, --global-batch-size = the
grid's sequences per global batch (paper.yaml `global_batch_size`, as benchmarks/paper_table.py sizes
its batches), --bf16, --use-distributed-optimizer, --sequence-parallel whenever tp > 1, recompute
selective, selective-mlp (--recompute-modules core_attn mlp), full (--recompute-method uniform
--recompute-num-layers 1) or block-N (--recompute-method block --recompute-num-layers N) as the
layout says (megatron_slimpack.specs.recompute_flags); the data
parallel size follows from the cell's GPU count.

What Megatron-LM (core_v0.16.1) cannot express, said next to each affected run in --dry-run:
  * megatron-fixed's document masking. The grid prices it with per-document attention. Stock
    pretrain_gpt.py has `--reset-attention-mask --reset-position-ids` for the GPTDataset, but at these
    lengths they do not give that: --reset-attention-mask only edits the dense [s, s] mask the
    dataloader builds (4 GiB per sample at 64K, 64 GiB at 256K) and only the unfused local softmax
    (--transformer-impl local, [s, s] scores per head) reads it: Transformer Engine's fused/flash
    kernels run with attn_mask_type causal and ignore the mask. --reset-position-ids only feeds learned
    absolute position embeddings: RoPE positions come from 0..s-1 regardless. So the megatron-fixed
    runs attend causally across documents (the megatron-stock semantic), with
    --no-create-attention-mask-in-dataloader so the unused dense mask is never built.
  * context parallelism of the plugin's strategies: --slimpack refuses --context-parallel-size > 1, so
    a grid layout with cp K runs with --context-parallel-size 1, K times the data-parallel replicas
    and --slimpack-base-merge K: K-fold context parallelism by DP-Merge groups, as the grid priced
    it (SlimPack's planner reads the base merge itself; the others plan the cp-K layout and share
    each MicroPack by its group).

Each run's log is parsed for Megatron's "elapsed time per iteration (ms)" lines and a table of
ms/iteration and speedup over megatron-fixed is printed. Used through scripts/reproduce_paper.sh.

A run counts only when its launcher exits 0 and its log has iteration times. It writes NAME.log.part
while it runs; on success that becomes NAME.log (reused by later calls), otherwise NAME.failed.log,
which is never reused: the next call runs it again. A failure ends the script with exit status 1 and
the log's tail (with --keep-going after the remaining runs). The launchers get this interpreter as
PYTHON, so they run the same Python.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from megatron_slimpack.planner.strategies import strategy_specs  # noqa: E402
from megatron_slimpack.specs import BLOCK_RECOMPUTE, MODELS, RECOMPUTE_MODES, recompute_flags  # noqa: E402

ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
REFERENCE = "megatron-fixed"
LAYOUT_TOKEN = re.compile(r"(tp|pp|vpp|cp|dp)([0-9]+)|rc-(" + "|".join(RECOMPUTE_MODES) + "|"
                          + BLOCK_RECOMPUTE.pattern + ")")

# Strategies that stock pretrain_gpt.py runs without --slimpack, and what such a run measures.
STOCK = {
    "megatron-fixed": (
        "document masking: Megatron-LM cannot express it here (--reset-attention-mask only edits the dense "
        "dataloader mask that TE's fused/flash causal kernels ignore; --reset-position-ids does not reach RoPE), "
        "so this run attends causally across documents, as megatron-stock; the grid prices per-document "
        "attention"),
    "megatron-stock": None,  # cross-document causal attention is exactly what the grid prices for it
}
# Flags of paper.yaml's common_args that this script sets itself per strategy and layout, and
# --use-flash-attn, which core_v0.16.1 parses but never reads (TE chooses its attention kernel).
# baseline_args and slimpack_args are taken as given (the layout's flags still come after them).
OWNED = {"bf16", "use-distributed-optimizer", "micro-batch-size", "calculate-per-token-loss", "no-rope-fusion",
         "use-flash-attn", "sequence-parallel"}


@dataclass(frozen=True)
class Layout:
    """A grid layout string ("tp2 pp1 cp2 dp32 rc-selective", "tp4 pp8 vpp4 cp4 dp1") as numbers."""

    tp: int
    pp: int
    cp: int
    dp: int
    recompute: str = "none"
    vpp: int = 1  # virtual pipeline stages per rank (interleaved 1F1B)

    @classmethod
    def parse(cls, text: str) -> "Layout":
        values: dict = {}
        for token in text.split():
            match = LAYOUT_TOKEN.fullmatch(token)
            if not match:
                raise ValueError(f"layout {text!r}: unknown part {token!r} (expected tpN ppN [vppN] cpN dpN "
                                 "[rc-MODE]); teach scripts/reproduce_paper.py's Layout.parse the new part")
            key, number, mode = match.groups()
            if mode:
                values["recompute"] = mode
            else:
                values[key] = int(number)
        missing = [key for key in ("tp", "pp", "cp", "dp") if key not in values]
        if missing:
            raise ValueError(f"layout {text!r} lacks {', '.join(missing)}")
        return cls(**values)

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp


@dataclass
class Run:
    """One (cell, strategy) of the grid: its Megatron arguments, or why it has none."""

    cell: dict
    strategy: str
    layout: Layout
    cluster: str
    megatron_args: list[str] = field(default_factory=list)
    note: str | None = None      # what the run measures differently from the grid, if anything
    skip: str | None = None      # why there is no command line
    tokens_per_iteration: int = 0  # global batch x sequence length

    @property
    def name(self) -> str:
        cell = self.cell
        return f"{cell['model']}_{context_label(cell['context'])}_{self.cluster}_{cell['dataset']}.{self.strategy}"


def context_label(tokens: int, unit: str = "k") -> str:
    """65536 -> "64k"; a context that is no whole number of 1024 tokens as it is (512 -> "512")."""
    return f"{tokens // 1024}{unit}" if tokens % 1024 == 0 else str(tokens)


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def flags(options: dict) -> list[str]:
    """{"tensor-model-parallel-size": 2, "bf16": True, "x": None} -> ["--tensor-model-parallel-size", "2", "--bf16"]"""
    out = []
    for key, value in options.items():
        if value is True:
            out.append(f"--{key}")
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):  # a flag of several values: --recompute-modules core_attn mlp
            out += [f"--{key}", *map(str, value)]
        else:
            out += [f"--{key}", str(value)]
    return out


def model_options(preset: str) -> dict:
    """Megatron's flags for a megatron_slimpack.specs preset (a Llama-style decoder: RMSNorm, SwiGLU,
    RoPE, no biases, untied embeddings; GQA where the preset has KV groups)."""
    model = MODELS[preset]
    return {
        "num-layers": model.num_layers, "hidden-size": model.hidden_size,
        "ffn-hidden-size": model.ffn_hidden_size, "num-attention-heads": model.num_attention_heads,
        "group-query-attention": model.num_query_groups is not None, "num-query-groups": model.num_query_groups,
        "normalization": "RMSNorm", "swiglu": model.swiglu, "position-embedding-type": "rope",
        "disable-bias-linear": True, "untie-embeddings-and-output-weights": True,
    }


def layout_options(layout: Layout, *, base_merge: bool) -> dict:
    """Megatron's parallelism and recompute flags for a grid layout. `base_merge`: the layout's cp is
    run by the plugin as a base merge (cp 1 in Megatron, cp times the data-parallel replicas)."""
    return {
        "tensor-model-parallel-size": layout.tp, "sequence-parallel": layout.tp > 1,
        "pipeline-model-parallel-size": layout.pp,
        "num-virtual-stages-per-pipeline-rank": layout.vpp if layout.vpp > 1 else None,
        "context-parallel-size": 1 if base_merge else layout.cp,
        "slimpack-base-merge": layout.cp if base_merge and layout.cp > 1 else None,
        **options_of(recompute_flags(layout.recompute)),
    }


def options_of(argv: list[str]) -> dict:
    """Flags as `flags` takes them: "--name", then its values (one: the value; several: a list)."""
    options: dict = {}
    for token in argv:
        if token.startswith("--"):
            name = token[2:]
            options[name] = []
        else:
            options[name].append(int(token) if token.isdigit() else token)
    return {name: values[0] if len(values) == 1 else values for name, values in options.items()}


def cluster_of(gpus: int, clusters: dict) -> str:
    names = [name for name, cfg in clusters.items() if cfg["nodes"] * cfg["gpus_per_node"] == gpus]
    if not names:
        raise ValueError(f"no cluster config with {gpus} GPUs among {', '.join(clusters)}")
    return names[0]


def plan_run(cell: dict, strategy: str, bench: dict, clusters: dict, data_path: str) -> Run:
    """The run of `strategy` in grid cell `cell` (a row of paper_table.json)."""
    layout = Layout.parse(cell["strategies"][strategy]["layout"])
    cluster = cluster_of(cell["gpus"], clusters)
    run = Run(cell, strategy, layout, cluster)
    if layout.gpus != cell["gpus"]:
        run.skip = f"its layout covers {layout.gpus} GPUs, the cell has {cell['gpus']}"
        return run
    spec = strategy_specs().get(strategy)
    if strategy not in STOCK:
        if spec is None or not spec.trainable:
            run.skip = ("simulated for comparison only: neither stock Megatron-LM nor the SlimPack runtime trains "
                        f"{strategy}")
            return run
    run.tokens_per_iteration = bench["global_batch_size"][cell["context"]] * cell["context"]
    options = {
        **model_options(bench["model_presets"][cell["model"]]),
        "seq-length": cell["context"], "max-position-embeddings": cell["context"],
        "micro-batch-size": 1, "global-batch-size": bench["global_batch_size"][cell["context"]],
        "train-iters": bench["train_iters"], "log-interval": bench["log_interval"], "eval-iters": 0,
        "log-throughput": True,  # TFLOP/s per GPU in the log, next to the simulated figures
        "bf16": True, "use-distributed-optimizer": True, "calculate-per-token-loss": True,
        **{k: v for k, v in bench.get("common_args", {}).items() if k not in OWNED},
        "data-path": data_path, "split": "100,0,0",
    }
    if strategy in STOCK:
        run.note = STOCK[strategy]
        options.update(bench.get("baseline_args", {}))
        options.update(layout_options(layout, base_merge=False))
        # The GPTDataset would otherwise build a dense [s, s] causal mask per sample that TE never reads.
        options["no-create-attention-mask-in-dataloader"] = True
    else:
        options.update(bench.get("slimpack_args", {}))
        # The plugin runs a layout's cp K as K-fold context parallelism by DP-Merge groups, for every
        # strategy it trains (`planner.strategies.planning_view`), as `slimpack compare` priced it.
        options.update(layout_options(layout, base_merge=True))
        # Documents longer than the context are cut at it, each piece a sample of its own: the paper's
        # setting, and what the stock runs' fixed-length packing does to them, so every strategy of a
        # cell trains on the same documents (SlimPack's default refuses such a corpus).
        options.update({"slimpack": True, "slimpack-strategy": strategy, "no-rope-fusion": True,
                        "slimpack-hardware": clusters[cluster].get("hardware", "h100-sxm"),
                        "slimpack-long-documents": "split"})
    options.update(overlap_options(strategy_specs()[strategy].overlaps, layout))
    run.megatron_args = flags(options)
    return run


def overlap_options(overlaps, layout: Layout) -> dict:
    """The Megatron flags of the communication overlaps the simulator priced this strategy with
    (`StrategySpec.overlaps`): the same on the cluster as in the grid. TP overlap needs tp > 1; the
    SlimPack runtime's (--slimpack-tp-overlap) runs on megatron-core's local linears."""
    tp_overlap = overlaps.tp_comm and layout.tp > 1
    options = {overlaps.tp_comm_flag.removeprefix("--"): tp_overlap,
               "overlap-grad-reduce": overlaps.grad_reduce, "overlap-param-gather": overlaps.param_gather}
    if tp_overlap and overlaps.tp_comm_flag == "--slimpack-tp-overlap":
        options["transformer-impl"] = "local"
    return options


FILTERS = ("models", "contexts", "clusters", "datasets", "strategies")


class FilterError(ValueError):
    """A filter value the grid does not have, or filters that leave no run."""


def grid_values(grid: list[dict], clusters: dict) -> dict[str, list[str]]:
    """Each filter's values in the grid, in the grid's order (contexts in tokens, as --contexts takes them)."""
    values: dict[str, list[str]] = {key: [] for key in FILTERS}
    for cell in grid:
        found = {"models": [cell["model"]], "contexts": [str(cell["context"])],
                 "clusters": [cluster_of(cell["gpus"], clusters)], "datasets": [cell["dataset"]],
                 "strategies": list(cell["strategies"])}
        for key, names in found.items():
            values[key] += [name for name in names if name not in values[key]]
    return values


def check_filters(grid: list[dict], clusters: dict, only: dict) -> None:
    """Refuse a filter value that is not in the grid (a typo would otherwise select nothing)."""
    values = grid_values(grid, clusters)
    problems = []
    for key in FILTERS:
        unknown = [value for value in only.get(key) or [] if value not in values[key]]
        if unknown:
            problems.append(f"--{key} {','.join(unknown)}: not in the grid; valid values: {', '.join(values[key])}")
    if problems:
        raise FilterError("\n".join(problems))


def plan_runs(grid: list[dict], bench: dict, clusters: dict, data_paths: dict, only: dict) -> list[Run]:
    """Every (cell, strategy) of the grid that passes the filters in `only`, in the grid's order."""
    check_filters(grid, clusters, only)
    runs = []
    for cell in grid:
        cluster = cluster_of(cell["gpus"], clusters)
        if any(only[k] and str(v) not in only[k] for k, v in
               (("models", cell["model"]), ("contexts", cell["context"]), ("clusters", cluster),
                ("datasets", cell["dataset"]))):
            continue
        for strategy in cell["strategies"]:
            if only["strategies"] and strategy not in only["strategies"]:
                continue
            data_path = data_paths.get(cell["dataset"]) or f"<DATA_PATH:{cell['dataset']}>"
            runs.append(plan_run(cell, strategy, bench, clusters, data_path))
    if not runs:
        chosen = " ".join(f"--{key} {','.join(only[key])}" for key in FILTERS if only.get(key))
        raise FilterError(f"no cell of the grid has {chosen}: each value exists, but not together "
                          "(benchmarks/results/paper_table.json lists the cells)")
    return runs


def load_bench(config: Path) -> tuple[dict, dict, dict]:
    """paper.yaml with each model's specs preset; the cluster configs; each dataset's data_path."""
    bench = load(config)
    configs = config.resolve().parents[1]
    bench["model_presets"] = {m: load(configs / "models" / f"{m}.yaml")["preset"] for m in bench["models"]}
    clusters = {name: load(configs / "clusters" / f"{name}.yaml") for name in bench["clusters"]}
    data_paths = {d: load(configs / "datasets" / f"{d}.yaml").get("data_path") for d in bench["datasets"]}
    return bench, clusters, data_paths


def launch(run: Run, clusters: dict, launcher: str, log: Path) -> tuple[list[str], dict]:
    """The command that starts `run` (its output goes to `log`) and the environment it needs."""
    cluster = clusters[run.cluster]
    env = {key: str(value) for key, value in (cluster.get("env") or {}).items()}
    env["SLIMPACK_DIR"] = str(ROOT)
    env["PYTHON"] = sys.executable  # the launchers run this interpreter, never another python on PATH
    if launcher == "slurm":
        command = ["sbatch", "--wait", f"--nodes={cluster['nodes']}", f"--job-name={run.strategy}",
                   f"--output={log.resolve()}", str(ROOT / "scripts" / "slurm_h100.sbatch")]
    else:
        command = [str(ROOT / "scripts" / "launch_torchrun.sh")]
    return command + run.megatron_args, env


def mean_iteration_ms(text: str, skip: int) -> float | None:
    values = [float(v) for v in ELAPSED.findall(text)]
    values = values[skip:] if len(values) > skip else values
    return sum(values) / len(values) if values else None


TAIL_LINES = 60


def log_tail(path: Path, lines: int = TAIL_LINES) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else ["(no log written)"]
    return "\n".join("    " + line for line in text[-lines:])


def failed_log(log: Path) -> Path:
    return log.with_name(log.name[:-len(".log")] + ".failed.log")


def check_log(log: Path, skip: int) -> float | None:
    """A kept log's mean ms/iteration; a log without iteration times is moved to NAME.failed.log (None)."""
    if not log.exists():
        return None
    ms = mean_iteration_ms(log.read_text(errors="replace"), skip)
    if ms is None:
        log.replace(failed_log(log))
    return ms


def dry_run_text(run: Run, command: list[str], env: dict, log: Path, launcher: str) -> str:
    lines = [f"# {run.name}: grid layout {run.cell['strategies'][run.strategy]['layout']}"]
    if run.skip:
        return lines[0] + f"\n# NOT RUN: {run.skip}"
    if run.note:
        lines.append(f"# NOTE: {run.note}")
    assignments = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
    redirect = "" if launcher == "slurm" else f" > {shlex.quote(str(log))} 2>&1"
    lines.append(f"{assignments} {shlex.join(command)}{redirect}")
    return "\n".join(lines)


MAX_ALLOCATED = re.compile(r"max allocated:\s*([0-9.]+)")  # Megatron's memory report, MB
THROUGHPUT = re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*([0-9.]+)")  # with --log-throughput


def log_figures(text: str, skip: int) -> dict:
    """What a run's log measured besides its iteration time: the peak memory Megatron reports (GiB,
    the largest over the ranks that print it) and the mean TFLOP/s per GPU after the warm-up."""
    peaks = [float(v) / 1024 for v in MAX_ALLOCATED.findall(text)]
    throughput = [float(v) for v in THROUGHPUT.findall(text)]
    throughput = throughput[skip:] if len(throughput) > skip else throughput
    return {"peak_gib": max(peaks) if peaks else None,
            "tflops": sum(throughput) / len(throughput) if throughput else None}


def _figure(value: float | None, form: str) -> str:
    return "-" if value is None else format(value, form)


def table(runs: list[Run], times: dict, failed: dict | None = None, logs: Path | None = None, skip: int = 0) -> str:
    """Measured next to simulated for every run: ms/iteration and speedup over megatron-fixed, then
    the grid's simulated ms/iteration and the measured/simulated ratio (a run checks the cost model
    too), tokens/s, TFLOP/s per GPU and peak memory (measured, simulated) from its log in `logs`."""
    failed = failed or {}
    lines = ["| model | context | GPUs | dataset | strategy | layout | ms/iter | speedup vs megatron-fixed | "
             "simulated ms/iter | measured/simulated | tokens/s | TFLOP/s/GPU | peak GiB | simulated peak GiB | note |",
             "|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for run in runs:
        cell = run.cell
        figures = cell["strategies"][run.strategy]
        ms = times.get(run.name)
        reference = times.get(run.name.rsplit(".", 1)[0] + "." + REFERENCE)
        speedup = f"{reference / ms:.2f}x" if ms and reference else "-"
        simulated_ms = figures.get("mean_s", 0.0) * 1000 or None
        log = logs / f"{run.name}.log" if logs else None
        measured = log_figures(log.read_text(errors="replace"), skip) if ms and log and log.exists() else {}
        note = f"not run: {run.skip}" if run.skip else ("cross-document attention" if run.note else "")
        if run.name in failed:
            note = f"FAILED: {failed[run.name]}"
        lines.append(
            f"| {cell['model']} | {context_label(cell['context'], 'K')} | {cell['gpus']} | {cell['dataset']} | "
            f"{run.strategy} | {figures['layout']} | {_figure(ms, '.1f')} | {speedup} | "
            f"{_figure(simulated_ms, '.1f')} | {_figure(ms / simulated_ms if ms and simulated_ms else None, '.2f')} | "
            f"{_figure(run.tokens_per_iteration * 1000 / ms if ms and run.tokens_per_iteration else None, ',.0f')} | "
            f"{_figure(measured.get('tflops'), '.1f')} | {_figure(measured.get('peak_gib'), '.1f')} | "
            f"{_figure(figures.get('peak_gib'), '.1f')} | {note} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="reproduce_paper.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench" / "paper.yaml"),
                        help="training settings, clusters and datasets of the grid")
    parser.add_argument("--grid", default=str(ROOT / "benchmarks" / "results" / "paper_table.json"),
                        help="the simulated grid whose per-strategy layouts are run")
    parser.add_argument("--dry-run", action="store_true", help="print every run's command line, run nothing")
    parser.add_argument("--launcher", choices=["torchrun", "slurm"], default="slurm")
    parser.add_argument("--megatron-dir", default=os.environ.get("MEGATRON_DIR"))
    parser.add_argument("--logs", default="out/paper",
                        help="one log per run here: NAME.log of a successful run is reused, NAME.failed.log never")
    parser.add_argument("--parse-only", action="store_true", help="only parse existing logs and print the table")
    parser.add_argument("--keep-going", action="store_true",
                        help="after a failed run, run the others before exiting with status 1")
    for key in FILTERS:
        parser.add_argument(f"--{key}", default="", help=f"comma-separated subset of the grid's {key}")
    for dataset in ("wikipedia", "commoncrawl", "github"):
        parser.add_argument(f"--data-path-{dataset}", default=None, help=f"Megatron dataset prefix for {dataset}")
    args = parser.parse_args(argv)
    bench, clusters, data_paths = load_bench(Path(args.config))
    for dataset in data_paths:
        data_paths[dataset] = getattr(args, f"data_path_{dataset.replace('-', '_')}", None) or data_paths[dataset]
    only = {k: [x for x in getattr(args, k).split(",") if x] for k in FILTERS}
    try:
        runs = plan_runs(json.loads(Path(args.grid).read_text()), bench, clusters, data_paths, only)
    except FilterError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    logs = Path(args.logs)
    skip = int(bench.get("skip_first_iters", 0))
    times: dict = {}
    failed: dict = {}  # run name -> what went wrong
    for run in runs:
        log = logs / f"{run.name}.log"
        if args.dry_run:
            command, env = launch(run, clusters, args.launcher, log)
            env = {"MEGATRON_DIR": args.megatron_dir or "<MEGATRON_DIR>", **env}
            print(dry_run_text(run, command, env, log, args.launcher))
            continue
        if run.skip:
            print(f"[paper] {run.name} not run: {run.skip}", file=sys.stderr)
            continue
        if args.parse_only:
            if log.exists():
                times[run.name] = mean_iteration_ms(log.read_text(errors="replace"), skip)
                if times[run.name] is None:
                    failed[run.name] = "its log has no iteration times"
                    report_failure(run, failed[run.name], log)
            elif failed_log(log).exists():
                failed[run.name] = f"failed (its log: {failed_log(log)})"
                report_failure(run, failed[run.name], failed_log(log))
            continue
        times[run.name] = check_log(log, skip)  # a kept log without iteration times is moved aside
        if times[run.name] is None:
            times[run.name], problem = execute(run, clusters, args, log, skip)
            if problem:
                failed[run.name] = problem
                report_failure(run, problem, failed_log(log))
                if not args.keep_going:
                    break
    if not args.dry_run:
        print(table(runs, times, failed, logs, skip))
    if failed:
        print(f"error: {len(failed)} run(s) failed: {', '.join(failed)}; their logs are the *.failed.log files in "
              f"{logs} (a new call runs them again)", file=sys.stderr)
        return 1
    return 0


def execute(run: Run, clusters: dict, args, log: Path, skip: int) -> tuple[float | None, str | None]:
    """Run `run` with its output in NAME.log.part, kept as NAME.log when it succeeded (exit status 0 and
    iteration times), else as NAME.failed.log. Returns (mean ms/iteration, None) or (None, what failed)."""
    partial = log.with_name(log.name + ".part")
    command, env = launch(run, clusters, args.launcher, partial)
    if not args.megatron_dir:
        raise SystemExit("error: set --megatron-dir or MEGATRON_DIR (a Megatron-LM checkout, patched for --slimpack)")
    if "<DATA_PATH" in " ".join(command):
        dataset = run.cell["dataset"]
        raise SystemExit(f"error: {dataset}: give --data-path-{dataset} (a Megatron dataset prefix)")
    log.parent.mkdir(parents=True, exist_ok=True)
    partial.unlink(missing_ok=True)
    print(f"[paper] {run.name} ...", file=sys.stderr, flush=True)
    environment = {**os.environ, **env, "MEGATRON_DIR": args.megatron_dir}
    try:
        if args.launcher == "slurm":  # Slurm writes the job's output to the log (--output)
            status = subprocess.run(command, check=False, env=environment).returncode
        else:
            with open(partial, "w") as handle:
                status = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False,
                                        env=environment).returncode
    except OSError as error:  # the launcher itself could not start
        partial.write_text(f"{shlex.join(command[:1])}: {error}\n")
        status = 127
    text = partial.read_text(errors="replace") if partial.exists() else ""
    ms = mean_iteration_ms(text, skip)
    if status == 0 and ms is not None:
        partial.replace(log)
        failed_log(log).unlink(missing_ok=True)
        return ms, None
    if partial.exists():
        partial.replace(failed_log(log))
    else:
        failed_log(log).write_text("(the launcher wrote no log)\n")
    if status != 0:
        return None, f"exit status {status}"
    return None, "no \"elapsed time per iteration (ms)\" line in its log"


def report_failure(run: Run, problem: str, log: Path) -> None:
    print(f"error: {run.name} failed: {problem}. The last {TAIL_LINES} lines of {log}:\n{log_tail(log)}",
          file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
