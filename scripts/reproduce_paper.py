#!/usr/bin/env python3
"""Run the paper grid (configs/bench/paper.yaml) on a GPU cluster: for every (model, context,
cluster, dataset) one Megatron-LM baseline run and one SlimPack run with the same model, data,
global batch and GPU count; parse Megatron's "elapsed time per iteration (ms)" lines and print
the speedup table. Used through scripts/reproduce_paper.sh (see --help)."""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from itertools import product
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
ELAPSED = re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.]+)")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def flags(options: dict) -> list[str]:
    out = []
    for key, value in options.items():
        if value is True:
            out.append(f"--{key}")
        elif value is False or value is None:
            continue
        else:
            out += [f"--{key}", str(value)]
    return out


def runs(bench: dict, configs: Path, only: dict) -> list[dict]:
    grid = []
    for model, context, cluster, dataset in product(bench["models"], bench["context_lengths"], bench["clusters"],
                                                   bench["datasets"]):
        if any(only[k] and str(v) not in only[k] for k, v in
               (("models", model), ("contexts", context), ("clusters", cluster), ("datasets", dataset))):
            continue
        grid.append({"model": model, "context": int(context), "cluster": cluster, "dataset": dataset,
                     "model_cfg": load(configs / "models" / f"{model}.yaml"),
                     "cluster_cfg": load(configs / "clusters" / f"{cluster}.yaml"),
                     "dataset_cfg": load(configs / "datasets" / f"{dataset}.yaml")})
    return grid


def commands(run: dict, bench: dict, args) -> dict[str, list[str]]:
    cluster = run["cluster_cfg"]
    gpus = cluster["nodes"] * cluster["gpus_per_node"]
    layout = dict(bench["layouts"][run["model"]][run["context"]])
    tp, pp, cp = layout["tp"], layout["pp"], layout.get("cp", 1)
    data_path = getattr(args, f"data_path_{run['dataset']}", None) or run["dataset_cfg"].get("data_path")
    common = {
        **run["model_cfg"]["megatron_args"], **bench["common_args"],
        "seq-length": run["context"], "max-position-embeddings": run["context"],
        "global-batch-size": bench["global_batch_size"][run["context"]],
        "train-iters": bench["train_iters"], "log-interval": bench["log_interval"],
        "tensor-model-parallel-size": tp, "pipeline-model-parallel-size": pp,
        "recompute-granularity": "full" if bench.get("recompute") == "full" else None,
        "recompute-method": "uniform" if bench.get("recompute") == "full" else None,
        "recompute-num-layers": 1 if bench.get("recompute") == "full" else None,
        "data-path": data_path or f"<DATA_PATH:{run['dataset']}>", "split": "100,0,0", "eval-iters": 0,
    }
    if gpus % (tp * pp * cp):
        return {"skip": f"tp*pp*cp = {tp}*{pp}*{cp} does not divide {gpus} GPUs; adjust layouts in the config"}
    baseline = {**common, "context-parallel-size": cp, **bench.get("baseline_args", {})}
    # SlimPack slices long documents instead of context parallelism: cp folds into dp.
    slimpack = {**common, "context-parallel-size": 1, "slimpack": True,
                "slimpack-strategy": bench.get("slimpack_strategy", "slimpack"),
                "slimpack-hardware": cluster.get("hardware", "h100-sxm"), **bench.get("slimpack_args", {})}
    launcher = ["sbatch", "--wait", f"--nodes={cluster['nodes']}", str(ROOT / "scripts" / "slurm_h100.sbatch")] \
        if args.launcher == "slurm" else [str(ROOT / "scripts" / "launch_torchrun.sh")]
    return {"baseline": launcher + flags(baseline), "slimpack": launcher + flags(slimpack)}


def mean_iteration_ms(text: str, skip: int) -> float | None:
    values = [float(v) for v in ELAPSED.findall(text)]
    values = values[skip:] if len(values) > skip else values
    return sum(values) / len(values) if values else None


def name_of(run: dict) -> str:
    return f"{run['model']}_{run['context'] // 1024}k_{run['cluster']}_{run['dataset']}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="reproduce_paper.sh", description=__doc__)
    parser.add_argument("--config", default=str(ROOT / "configs" / "bench" / "paper.yaml"))
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--launcher", choices=["torchrun", "slurm"], default="slurm")
    parser.add_argument("--megatron-dir", default=os.environ.get("MEGATRON_DIR"))
    parser.add_argument("--logs", default="out/paper", help="one log per run here; existing logs are reused")
    parser.add_argument("--parse-only", action="store_true", help="only parse existing logs and print the table")
    for key in ("models", "contexts", "clusters", "datasets"):
        parser.add_argument(f"--{key}", default="", help=f"comma-separated subset of the grid's {key}")
    for dataset in ("wikipedia", "commoncrawl", "github"):
        parser.add_argument(f"--data-path-{dataset}", default=None, help=f"Megatron dataset prefix for {dataset}")
    args = parser.parse_args(argv)
    bench = load(Path(args.config))
    only = {k: [x for x in getattr(args, k).split(",") if x] for k in ("models", "contexts", "clusters", "datasets")}
    grid = runs(bench, Path(args.config).resolve().parents[1], only)
    logs = Path(args.logs)
    skip = int(bench.get("skip_first_iters", 0))
    rows = []
    for run in grid:
        pair = commands(run, bench, args)
        times = {}
        if "skip" in pair:
            print(f"# {name_of(run)} skipped: {pair['skip']}", file=sys.stderr)
            continue
        for kind, command in pair.items():
            log = logs / f"{name_of(run)}.{kind}.log"
            env = f"MEGATRON_DIR={shlex.quote(args.megatron_dir or '<MEGATRON_DIR>')}"
            if args.dry_run:
                print(f"# {name_of(run)} {kind}\n{env} {shlex.join(command)} > {log} 2>&1")
                continue
            if not log.exists() and not args.parse_only:
                if not args.megatron_dir:
                    raise SystemExit("set --megatron-dir or MEGATRON_DIR (a patched Megatron-LM checkout)")
                if "<DATA_PATH" in " ".join(command):
                    raise SystemExit(f"{run['dataset']}: give --data-path-{run['dataset']} (a Megatron dataset prefix)")
                logs.mkdir(parents=True, exist_ok=True)
                print(f"[paper] {name_of(run)} {kind} ...", file=sys.stderr, flush=True)
                with open(log, "w") as handle:
                    subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, check=False,
                                   env={**os.environ, "MEGATRON_DIR": args.megatron_dir})
            times[kind] = mean_iteration_ms(log.read_text(), skip) if log.exists() else None
        if not args.dry_run:
            rows.append((run, times))
    if args.dry_run:
        return 0
    print("| model | context | GPUs | dataset | baseline ms/iter | SlimPack ms/iter | speedup |")
    print("|---|---:|---:|---|---:|---:|---:|")

    def cell(v):
        return f"{v:.1f}" if v else "-"

    for run, times in rows:
        gpus = run["cluster_cfg"]["nodes"] * run["cluster_cfg"]["gpus_per_node"]
        base, ours = times.get("baseline"), times.get("slimpack")
        speedup = f"{base / ours:.2f}x" if base and ours else "-"
        print(f"| {run['model']} | {run['context'] // 1024}K | {gpus} | {run['dataset']} | {cell(base)} | "
              f"{cell(ours)} | {speedup} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
