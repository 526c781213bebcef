"""`scripts/reproduce_paper.sh --launcher torchrun` end to end on CPU: a two-cell grid of a tiny
model, each cell running megatron-fixed, megatron-stock and slimpack in its grid layout with the
real Megatron-LM trainer (`../shared/megatron-lm/`, the SlimPack patch applied to a scratch copy by
`apply_patches.sh`), through the real `launch_torchrun.sh` with two gloo ranks per run; the logs
are parsed into the table. A grid whose run fails makes the script exit non-zero.

What is test-only: a scratch config tree (a CPU "cluster" of 2 ranks, the tiny model, a Megatron
dataset built here) and `tests/real_megatron/torchrun_site` on PYTHONPATH, which applies the CPU
shim in each torchrun worker (`real_megatron/cpu_shim.py`)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_slimpack.runtime.processes import free_port

sys.path.insert(0, str(Path(__file__).resolve().parent / "real_megatron"))
import harness  # noqa: E402

pytestmark = [pytest.mark.real_megatron, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(__file__).resolve().parent / "real_megatron" / "torchrun_site"
STRATEGIES = ("megatron-fixed", "megatron-stock", "slimpack")
# Each cell's layouts (2 ranks): data, pipeline and tensor parallelism, and for slimpack a base
# merge (cp2: one DP-Merge group of both ranks) in the second cell. The stock strategies keep tp 1:
# with tp > 1 they are priced with --tp-comm-overlap, which needs Transformer Engine.
CELLS = {
    512: {"megatron-fixed": "tp1 pp1 cp1 dp2", "megatron-stock": "tp1 pp2 cp1 dp1", "slimpack": "tp2 pp1 cp1 dp1"},
    1024: {"megatron-fixed": "tp1 pp2 cp1 dp1", "megatron-stock": "tp1 pp1 cp1 dp2", "slimpack": "tp1 pp1 cp2 dp1"},
}
# The CPU-only flags of the real-trainer tests (harness.MODEL_FLAGS), as a bench's common_args.
COMMON_ARGS = {
    "tokenizer-type": "NullTokenizer", "vocab-size": harness.VOCAB_SIZE, "lr": 1.0e-3,
    "lr-decay-style": "constant", "weight-decay": 0, "clip-grad": 0, "seed": 1234, "init-method-std": 0.05,
    "attention-dropout": 0, "hidden-dropout": 0, "eval-interval": 100000,
    "transformer-impl": "local", "use-cpu-initialization": True, "no-gradient-accumulation-fusion": True,
    "no-masked-softmax-fusion": True, "no-bias-gelu-fusion": True, "no-bias-dropout-fusion": True,
    "no-persist-layer-norm": True, "distributed-backend": "gloo",
}
SLIMPACK_ARGS = {"slimpack-plan-ahead": 0, "slimpack-solver-deterministic-limit": 0.5,
                 "slimpack-solver-time-limit": 30}


def write_configs(directory: Path, data_prefix: str) -> Path:
    """A config tree as load_bench reads it: bench/tiny.yaml and its model, cluster and dataset."""
    for sub in ("bench", "models", "clusters", "datasets"):
        (directory / sub).mkdir(parents=True, exist_ok=True)
    bench = {"name": "tiny", "train_iters": 3, "log_interval": 1, "skip_first_iters": 1, "models": ["tiny"],
             "clusters": ["cpu-2"], "datasets": ["text"], "global_batch_size": {512: 4, 1024: 2},
             "common_args": COMMON_ARGS, "baseline_args": {"sequence-parallel": True, "no-rope-fusion": True},
             "slimpack_args": SLIMPACK_ARGS}
    (directory / "bench" / "tiny.yaml").write_text(yaml.safe_dump(bench))
    (directory / "models" / "tiny.yaml").write_text(yaml.safe_dump({"name": "tiny", "preset": "tiny"}))
    cluster = {"name": "cpu-2", "hardware": "cpu", "nodes": 1, "gpus_per_node": 2,
               "env": {"GPUS_PER_NODE": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath()}}
    (directory / "clusters" / "cpu-2.yaml").write_text(yaml.safe_dump(cluster))
    (directory / "datasets" / "text.yaml").write_text(yaml.safe_dump({"name": "text", "data_path": data_prefix}))
    return directory / "bench" / "tiny.yaml"


def pythonpath() -> str:
    """The CPU shim's site folder, then the trainer's (megatron-core and the release's extract)."""
    return os.pathsep.join([str(SITE), harness.python_path(harness.DEFAULT)])


def write_grid(path: Path) -> Path:
    cells = [{"model": "tiny", "context": context, "gpus": 2, "dataset": "text",
              "strategies": {name: {"layout": layout, "mean_s": 0.5, "peak_gib": 0.1}
                             for name, layout in layouts.items()}}
             for context, layouts in CELLS.items()]
    path.write_text(json.dumps(cells))
    return path


def reproduce(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """reproduce_paper.sh on a free rendezvous port. A run whose rendezvous found its port taken
    (another test process bound it first: nothing ran) is run again on a new port; the script
    keeps the runs that succeeded and runs the failed ones again, as for a user."""
    checkout = harness.patched_checkout(tmp_path / "megatron").parent
    logs = tmp_path / "logs"
    for _attempt in range(3):
        environment = {**os.environ, "MEGATRON_DIR": str(checkout), "PYTHON": sys.executable,
                       "MASTER_PORT": str(free_port())}
        result = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_paper.sh"), "--launcher", "torchrun",
                                 "--logs", str(logs), *args],
                                capture_output=True, text=True, env=environment, timeout=1200)
        if not any("EADDRINUSE" in log.read_text(errors="replace") for log in logs.glob("*.failed.log")):
            break
    return result


@pytest.fixture(scope="module")
def grid_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("reproduce")
    prefix = harness.build_dataset(tmp_path / "data" / "text", harness.random_documents(count=200, high=900))
    config = write_configs(tmp_path / "configs", str(prefix))
    grid = write_grid(tmp_path / "grid.json")
    result = reproduce(tmp_path, "--config", str(config), "--grid", str(grid))
    return tmp_path, result


def table_rows(stdout: str) -> dict[tuple[str, str], list[str]]:
    """(context, strategy) -> the row's cells, from the printed markdown table."""
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if len(cells) > 5 and cells[4] in STRATEGIES:
            rows[(cells[1], cells[4])] = cells
    return rows


def megatron_argument(log: str, name: str) -> str:
    """The value Megatron's argument dump at start-up prints for `name`."""
    match = re.search(rf"^\s*{name} \.+ (\S+)\s*$", log, re.MULTILINE)
    assert match, f"{name} is not in the argument dump"
    return match.group(1)


def test_a_two_cell_grid_runs_every_strategy_with_the_real_trainer_and_parses_the_table(grid_run):
    tmp_path, result = grid_run
    assert result.returncode == 0, result.stdout + result.stderr[-6000:]
    rows = table_rows(result.stdout)
    assert set(rows) == {("512", name) for name in STRATEGIES} | {("1K", name) for name in STRATEGIES}, result.stdout
    for (_, strategy), cells in rows.items():
        ms, speedup, simulated = float(cells[6]), cells[7], float(cells[8])
        assert ms > 0 and simulated == 500.0, cells  # measured next to the grid's simulated 0.5 s
        assert speedup.endswith("x") and (strategy != "megatron-fixed" or speedup == "1.00x"), cells
    logs = {path.name: path.read_text() for path in (tmp_path / "logs").glob("*.log")}
    assert len(logs) == 6 and not list((tmp_path / "logs").glob("*.failed.log")), sorted(logs)
    for name, text in logs.items():
        context, strategy = name.split("_")[1], name.rsplit(".", 2)[-2]
        assert text.count("elapsed time per iteration (ms)") == 3, name  # train_iters 3, log_interval 1
        # slimpack through the plugin, the others through stock Megatron, each in its grid layout
        assert megatron_argument(text, "slimpack") == str(strategy == "slimpack"), name
        layout = CELLS[512 if context == "512" else 1024][strategy]
        tp, pp = (int(layout.split()[i][2:]) for i in (0, 1))
        assert megatron_argument(text, "tensor_model_parallel_size") == str(tp), name
        assert megatron_argument(text, "pipeline_model_parallel_size") == str(pp), name
        if strategy == "slimpack" and context != "512":  # cp2 as a base merge, cp 1 in Megatron
            assert megatron_argument(text, "slimpack_base_merge") == "2", name
            assert megatron_argument(text, "context_parallel_size") == "1", name


def test_a_grid_whose_run_fails_exits_non_zero(grid_run):
    tmp_path, _ = grid_run
    config = write_configs(tmp_path / "bad_configs", str(tmp_path / "data" / "missing"))
    result = reproduce(tmp_path / "bad", "--config", str(config), "--grid", str(tmp_path / "grid.json"),
                       "--strategies", "megatron-stock", "--contexts", "512")
    assert result.returncode == 1, result.stdout + result.stderr[-3000:]
    assert "run(s) failed" in result.stderr and "failed.log" in result.stderr
    assert list((tmp_path / "bad" / "logs").glob("*.failed.log"))
