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
      data-parallel replicas and --slimpack-base-merge K (README, "Running on a GPU cluster").

Shared by every run: the model's sizes (megatron_slimpack.specs.MODELS; GQA as --group-query-attention
--num-query-groups), --seq-length / --max-position-embeddings = the context, --global-batch-size = the
grid's sequences per global batch (paper.yaml `global_batch_size`, as benchmarks/paper_table.py sizes
its batches), --bf16, --use-distributed-optimizer, --sequence-parallel whenever tp > 1, recompute
selective or full (--recompute-method uniform --recompute-num-layers 1) as the layout says; the data
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
  * context parallelism for the plugin's other strategies (wlb-llm, slimpipe, ...): --slimpack refuses
    --context-parallel-size > 1 and only slimpack/slimpack-sym read a cp as --slimpack-base-merge, so a
    grid layout with cp > 1 for them has no command line (listed as not run, with the reason).

Each run's log is parsed for Megatron's "elapsed time per iteration (ms)" lines and a table of
ms/iteration and speedup over megatron-fixed is printed. Used through scripts/reproduce_paper.sh.
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
from megatron_slimpack.specs import MODELS  # noqa: E402

ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")
REFERENCE = "megatron-fixed"
LAYOUT_TOKEN = re.compile(r"(tp|pp|vpp|cp|dp)([0-9]+)|rc-(none|selective|full)")

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

    @property
    def name(self) -> str:
        cell = self.cell
        return f"{cell['model']}_{cell['context'] // 1024}k_{self.cluster}_{cell['dataset']}.{self.strategy}"


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
    SlimPack's base merge (cp 1 in Megatron, cp times the data-parallel replicas)."""
    return {
        "tensor-model-parallel-size": layout.tp, "sequence-parallel": layout.tp > 1,
        "pipeline-model-parallel-size": layout.pp,
        "num-virtual-stages-per-pipeline-rank": layout.vpp if layout.vpp > 1 else None,
        "context-parallel-size": 1 if base_merge else layout.cp,
        "slimpack-base-merge": layout.cp if base_merge and layout.cp > 1 else None,
        "recompute-granularity": None if layout.recompute == "none" else layout.recompute,
        "recompute-method": "uniform" if layout.recompute == "full" else None,
        "recompute-num-layers": 1 if layout.recompute == "full" else None,
    }


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
        if layout.cp > 1 and not spec.cp_is_base_merge:
            run.skip = (f"its layout has context parallelism cp{layout.cp}, which Megatron cannot run for {strategy}: "
                        "--slimpack refuses --context-parallel-size > 1, and --slimpack-base-merge (SlimPack's cp) "
                        f"is read only by {', '.join(n for n, s in strategy_specs().items() if s.cp_is_base_merge)}")
            return run
    options = {
        **model_options(bench["model_presets"][cell["model"]]),
        "seq-length": cell["context"], "max-position-embeddings": cell["context"],
        "micro-batch-size": 1, "global-batch-size": bench["global_batch_size"][cell["context"]],
        "train-iters": bench["train_iters"], "log-interval": bench["log_interval"], "eval-iters": 0,
        "bf16": True, "use-distributed-optimizer": True, "calculate-per-token-loss": True,
        **{k: v for k, v in bench.get("common_args", {}).items() if k not in OWNED},
        "data-path": data_path, "split": "100,0,0",
    }
    if strategy in STOCK:
        run.note = STOCK[strategy]
        options.update({k: v for k, v in bench.get("baseline_args", {}).items() if k not in OWNED})
        options.update(layout_options(layout, base_merge=False))
        # The GPTDataset would otherwise build a dense [s, s] causal mask per sample that TE never reads.
        options["no-create-attention-mask-in-dataloader"] = True
    else:
        options.update({k: v for k, v in bench.get("slimpack_args", {}).items() if k not in OWNED})
        options.update(layout_options(layout, base_merge=spec.cp_is_base_merge))
        options.update({"slimpack": True, "slimpack-strategy": strategy, "no-rope-fusion": True,
                        "slimpack-hardware": clusters[cluster].get("hardware", "h100-sxm")})
    run.megatron_args = flags(options)
    return run


def plan_runs(grid: list[dict], bench: dict, clusters: dict, data_paths: dict, only: dict) -> list[Run]:
    """Every (cell, strategy) of the grid that passes the filters in `only`, in the grid's order."""
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


def table(runs: list[Run], times: dict) -> str:
    lines = ["| model | context | GPUs | dataset | strategy | layout | ms/iter | speedup vs megatron-fixed | note |",
             "|---|---:|---:|---|---|---|---:|---:|---|"]
    for run in runs:
        cell = run.cell
        ms = times.get(run.name)
        reference = times.get(run.name.rsplit(".", 1)[0] + "." + REFERENCE)
        speedup = f"{reference / ms:.2f}x" if ms and reference else "-"
        note = f"not run: {run.skip}" if run.skip else ("cross-document attention" if run.note else "")
        lines.append(f"| {cell['model']} | {cell['context'] // 1024}K | {cell['gpus']} | {cell['dataset']} | "
                     f"{run.strategy} | {cell['strategies'][run.strategy]['layout']} | "
                     f"{f'{ms:.1f}' if ms else '-'} | {speedup} | {note} |")
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
    parser.add_argument("--logs", default="out/paper", help="one log per run here; existing logs are reused")
    parser.add_argument("--parse-only", action="store_true", help="only parse existing logs and print the table")
    for key in ("models", "contexts", "clusters", "datasets", "strategies"):
        parser.add_argument(f"--{key}", default="", help=f"comma-separated subset of the grid's {key}")
    for dataset in ("wikipedia", "commoncrawl", "github"):
        parser.add_argument(f"--data-path-{dataset}", default=None, help=f"Megatron dataset prefix for {dataset}")
    args = parser.parse_args(argv)
    bench, clusters, data_paths = load_bench(Path(args.config))
    for dataset in data_paths:
        data_paths[dataset] = getattr(args, f"data_path_{dataset.replace('-', '_')}", None) or data_paths[dataset]
    only = {k: [x for x in getattr(args, k).split(",") if x]
            for k in ("models", "contexts", "clusters", "datasets", "strategies")}
    runs = plan_runs(json.loads(Path(args.grid).read_text()), bench, clusters, data_paths, only)
    logs = Path(args.logs)
    skip = int(bench.get("skip_first_iters", 0))
    times: dict = {}
    for run in runs:
        log = logs / f"{run.name}.log"
        command, env = launch(run, clusters, args.launcher, log)
        if args.dry_run:
            env = {"MEGATRON_DIR": args.megatron_dir or "<MEGATRON_DIR>", **env}
            print(dry_run_text(run, command, env, log, args.launcher))
            continue
        if run.skip:
            print(f"[paper] {run.name} not run: {run.skip}", file=sys.stderr)
            continue
        if not log.exists() and not args.parse_only:
            if not args.megatron_dir:
                raise SystemExit("set --megatron-dir or MEGATRON_DIR (a Megatron-LM checkout, patched for --slimpack)")
            if "<DATA_PATH" in " ".join(command):
                dataset = run.cell["dataset"]
                raise SystemExit(f"{dataset}: give --data-path-{dataset} (a Megatron dataset prefix)")
            logs.mkdir(parents=True, exist_ok=True)
            print(f"[paper] {run.name} ...", file=sys.stderr, flush=True)
            environment = {**os.environ, **env, "MEGATRON_DIR": args.megatron_dir}
            if args.launcher == "slurm":  # Slurm writes the job's output to the log (--output)
                subprocess.run(command, check=False, env=environment)
            else:
                with open(log, "w") as handle:
                    subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False, env=environment)
        times[run.name] = mean_iteration_ms(log.read_text(), skip) if log.exists() else None
    if not args.dry_run:
        print(table(runs, times))
    return 0


if __name__ == "__main__":
    sys.exit(main())
