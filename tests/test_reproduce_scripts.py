"""scripts/reproduce_paper.sh --dry-run: one run per (grid cell, strategy), each in the layout that
benchmarks/results/paper_table.json reports for it, and every printed command line accepted by the
real Megatron-LM argument parser and checks of ../shared/megatron-lm/core_v0.16.1
(`parse_args` with SlimPack's flags, `validate_args`, the TransformerConfig, the micro-batch
calculator) plus `validate_slimpack_args` for the SlimPack runs.
"""
from __future__ import annotations

import contextlib
import copy
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_slimpack.planner.strategies import strategy_specs
from megatron_slimpack.specs import MODELS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent / "real_megatron"))
import harness  # noqa: E402

GRID = json.loads((ROOT / "benchmarks" / "results" / "paper_table.json").read_text())
BENCH = yaml.safe_load((ROOT / "configs" / "bench" / "paper.yaml").read_text())
PRESETS = {m: yaml.safe_load((ROOT / "configs" / "models" / f"{m}.yaml").read_text())["preset"]
           for m in BENCH["models"]}
CLUSTERS = {name: yaml.safe_load((ROOT / "configs" / "clusters" / f"{name}.yaml").read_text())
            for name in BENCH["clusters"]}
STOCK = ("megatron-fixed", "megatron-stock")  # strategies stock pretrain_gpt.py runs without --slimpack


def _script():
    spec = importlib.util.spec_from_file_location("reproduce_paper", ROOT / "scripts" / "reproduce_paper.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


reproduce_paper = _script()


def grid_layout(text: str) -> dict:
    """The grid's layout string as numbers, read here independently of the script."""
    numbers = {key: int(value) for key, value in re.findall(r"\b(tp|pp|vpp|cp|dp)(\d+)\b", text)}
    mode = re.search(r"\brc-(\w+)", text)
    return {"vpp": 1, **numbers, "recompute": mode.group(1) if mode else "none"}


def cell_name(cell: dict) -> str:
    cluster = next(n for n, c in CLUSTERS.items() if c["nodes"] * c["gpus_per_node"] == cell["gpus"])
    return f"{cell['model']}_{cell['context'] // 1024}k_{cluster}_{cell['dataset']}"


def dry_run(*argv: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert reproduce_paper.main(["--dry-run", *argv]) == 0
    return out.getvalue()


def blocks(text: str) -> dict[str, dict]:
    """run name -> {layout, note, skip, env, args (pretrain_gpt.py's), launcher} from --dry-run's output."""
    runs: dict[str, dict] = {}
    current = None
    for line in text.splitlines():
        header = re.fullmatch(r"# (\S+): grid layout (.+)", line)
        if header:
            assert header.group(1) not in runs, f"{header.group(1)} printed twice"
            current = runs[header.group(1)] = {"layout": header.group(2), "note": None, "skip": None, "args": None}
        elif line.startswith("# NOTE: "):
            current["note"] = line[len("# NOTE: "):]
        elif line.startswith("# NOT RUN: "):
            current["skip"] = line[len("# NOT RUN: "):]
        else:
            assert current is not None and current["args"] is None and not current["skip"], line
            words = shlex.split(line)
            start = next(i for i, w in enumerate(words) if w.endswith(("launch_torchrun.sh", "slurm_h100.sbatch")))
            end = words.index(">") if ">" in words else len(words)
            assignments = [w for w in words[:start] if re.match(r"[A-Z_][A-Z0-9_]*=", w)]
            current["env"] = dict(word.split("=", 1) for word in assignments)
            current["launcher"] = words[len(assignments):start + 1]
            current["args"] = words[start + 1:end]
    return runs


@pytest.fixture(scope="module")
def printed() -> dict[str, dict]:
    return blocks(dry_run("--launcher", "torchrun"))


def expected_runs():
    for cell in GRID:
        for strategy, figures in cell["strategies"].items():
            yield cell, strategy, grid_layout(figures["layout"])


def not_expressible(strategy: str, layout: dict) -> str | None:
    """Why Megatron cannot run `strategy` in `layout` (None: it can): the plugin does not train it.
    Every strategy the plugin trains runs a layout's cp K as a base merge of K."""
    if strategy in STOCK:
        return None
    return None if strategy_specs()[strategy].trainable else "simulated for comparison only"


def test_dry_run_prints_one_run_per_grid_cell_and_strategy(printed):
    expected = {f"{cell_name(cell)}.{strategy}": (cell, strategy, layout) for cell, strategy, layout in expected_runs()}
    assert len(GRID) == 72 and set(printed) == set(expected)
    commands = 0
    for name, (_, strategy, layout) in expected.items():
        run = printed[name]
        assert grid_layout(run["layout"]) == layout
        why = not_expressible(strategy, layout)
        if why:
            assert run["args"] is None and why in run["skip"], name
            continue
        commands += 1
        assert run["skip"] is None and run["args"], name
        if strategy == "megatron-fixed":  # Megatron cannot mask documents here: said next to the command
            assert "document masking" in run["note"] and "cannot express" in run["note"]
            assert "--reset-attention-mask" not in run["args"]
    assert commands >= 2 * len(GRID)  # at least megatron-fixed and slimpack in every cell


def test_every_run_uses_the_overlaps_its_strategy_was_priced_with(printed):
    """The cluster runs hide the communication the simulator priced as hidden, and no more: TP
    overlap where tp > 1: TE's userbuffers for the fixed-shape baselines, the SlimPack runtime's
    rings (on megatron-core's local linears) for the plugin's strategies."""
    seen = set()
    for cell, strategy, layout in expected_runs():
        run = printed[f"{cell_name(cell)}.{strategy}"]
        if run["args"] is None:
            continue
        overlaps = strategy_specs()[strategy].overlaps
        tp_overlap = overlaps.tp_comm and layout["tp"] > 1
        assert ("--tp-comm-overlap" in run["args"]) == (tp_overlap and strategy in STOCK), strategy
        assert ("--slimpack-tp-overlap" in run["args"]) == (tp_overlap and strategy not in STOCK), strategy
        if "--slimpack-tp-overlap" in run["args"]:
            assert "--sequence-parallel" in run["args"] and "--transformer-impl local" in " ".join(run["args"])
        assert ("--overlap-grad-reduce" in run["args"]) == overlaps.grad_reduce, strategy
        assert ("--overlap-param-gather" in run["args"]) == overlaps.param_gather, strategy
        seen.add(("--tp-comm-overlap" in run["args"] or "--slimpack-tp-overlap" in run["args"], strategy in STOCK))
    assert (True, True) in seen and (True, False) in seen  # both kinds of TP overlap are in the grid


def test_both_launchers_give_the_same_megatron_arguments(printed):
    slurm = blocks(dry_run("--launcher", "slurm", "--models", "llama-70b"))
    assert slurm and all(name in printed for name in slurm)
    for name, run in slurm.items():
        assert run["args"] == printed[name]["args"], name
        if run["args"]:
            cell_gpus = next(c["gpus"] for c in GRID if name.startswith(cell_name(c) + "."))
            assert run["launcher"][0] == "sbatch" and f"--nodes={cell_gpus // 8}" in run["launcher"]
            assert any(w.startswith("--output=") and w.endswith(f"{name}.log") for w in run["launcher"])


def test_the_shell_wrapper_prints_what_the_script_prints():
    only = ["--models", "llama-7b", "--contexts", "65536", "--clusters", "h100-128", "--datasets", "wikipedia"]
    result = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_paper.sh"), "--dry-run", *only],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (cell,) = [c for c in GRID if (c["model"], c["context"], c["gpus"], c["dataset"]) == ("llama-7b", 65536, 128,
                                                                                           "wikipedia")]
    assert result.stdout == dry_run(*only) and len(blocks(result.stdout)) == len(cell["strategies"])


def test_layouts_the_script_does_not_know_are_refused():
    assert reproduce_paper.Layout.parse("tp2 pp4 cp2 dp8 rc-full") == reproduce_paper.Layout(2, 4, 2, 8, "full")
    assert reproduce_paper.Layout.parse("tp2 pp4 vpp5 cp2 dp8").vpp == 5
    with pytest.raises(ValueError, match="unknown part 'v2'"):
        reproduce_paper.Layout.parse("tp2 pp4 v2 cp2 dp8")
    with pytest.raises(ValueError, match="lacks dp"):
        reproduce_paper.Layout.parse("tp2 pp4 cp2")


def test_parse_only_reads_the_logs_into_a_speedup_table(tmp_path, capsys):
    only = ["--models", "llama-7b", "--contexts", "65536", "--clusters", "h100-128", "--datasets", "wikipedia"]
    cell = "llama-7b_64k_h100-128_wikipedia"
    for strategy, ms in (("megatron-fixed", [900] + [120] * 4 + [100] * 3), ("slimpack", [50] * 5 + [80] * 3)):
        (tmp_path / f"{cell}.{strategy}.log").write_text(
            "".join(f" iteration {i}/20 | elapsed time per iteration (ms): {v} | throughput per GPU "
                    f"(TFLOP/s/GPU): {10 * i} |\n" for i, v in enumerate(ms))
            + "[Rank 0] (after 2 iterations) memory (MB) | allocated: 100.0 | max allocated: 40960.0 | reserved: 1\n"
            + "[Rank 3] (after 2 iterations) memory (MB) | allocated: 100.0 | max allocated: 51200.0 | reserved: 1\n")
    assert reproduce_paper.main(["--parse-only", "--launcher", "torchrun", "--logs", str(tmp_path), *only]) == 0
    out = capsys.readouterr().out.splitlines()
    rows = {line.split("|")[5].strip(): line.split("|")[7:-2] for line in out[2:]}
    (grid_cell,) = [c for c in GRID if (c["model"], c["context"], c["gpus"], c["dataset"]) == ("llama-7b", 65536, 128,
                                                                                                "wikipedia")]
    bench = reproduce_paper.load_bench(ROOT / "configs" / "bench" / "paper.yaml")[0]
    tokens = bench["global_batch_size"][65536] * 65536
    for strategy, ms in (("megatron-fixed", 100.0), ("slimpack", 80.0)):  # the first 5 iterations are warm-up
        simulated = grid_cell["strategies"][strategy]
        assert [cell.strip() for cell in rows[strategy]] == [
            f"{ms:.1f}", f"{100.0 / ms:.2f}x", f"{simulated['mean_s'] * 1000:.1f}",
            f"{ms / (simulated['mean_s'] * 1000):.2f}", f"{tokens * 1000 / ms:,.0f}", "60.0", "50.0",
            f"{simulated['peak_gib']:.1f}"]
    assert rows["wlb-llm"][:2] == [" - ", " - "]  # no log: no figure


# ---- the real Megatron-LM argument parser and checks -------------------------------------------
@pytest.fixture(scope="module")
def megatron_arguments():
    """megatron.training.arguments of ../shared/megatron-lm/core_v0.16.1 (harness.megatron_lm())."""
    path = str(harness.megatron_lm())
    if path not in sys.path:
        sys.path.insert(0, path)
    with contextlib.redirect_stdout(io.StringIO()):
        from megatron.training import argument_utils, arguments
    # parse_args builds its parser anew each call and reads the help texts of megatron-core's config
    # dataclasses from their source (inspect + ast: most of a call's time); they only feed --help,
    # so read each class once.
    read = argument_utils.ArgumentGroupFactory._get_field_docstrings
    docstrings: dict = {}

    def read_once(self, cls):
        if cls not in docstrings:
            docstrings[cls] = read(self, cls)
        return dict(docstrings[cls])

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(argument_utils.ArgumentGroupFactory, "_get_field_docstrings", read_once)
        yield arguments


def megatron_args(arguments, monkeypatch, run: dict, gpus: int):
    """The run's arguments through Megatron's parse_args (with SlimPack's flags), validate_args, its
    TransformerConfig and micro-batch calculator, and validate_slimpack_args for --slimpack runs, in
    the environment the printed line sets, on as many ranks as the cell has GPUs."""
    from megatron.core import num_microbatches_calculator as calculator

    from megatron_slimpack.megatron import add_slimpack_args, validate_slimpack_args

    for key, value in run["env"].items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("WORLD_SIZE", str(gpus))
    monkeypatch.setenv("RANK", "0")
    # validate_args asks the GPU's architecture for tp or cp > 1: the grid's H100s are sm90.
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *run["args"]])
    with contextlib.redirect_stdout(io.StringIO()):
        args = arguments.parse_args(extra_args_provider=add_slimpack_args, ignore_unknown_args=False)
        args = arguments.validate_args(args)
        if args.slimpack:
            validate_slimpack_args(args)
        config_args = copy.copy(args)
        if importlib.util.find_spec("transformer_engine") is None:
            # TransformerConfig refuses rope fusion without Transformer Engine installed (the cluster has it).
            config_args.apply_rope_fusion = False
        config = arguments.core_transformer_config_from_args(config_args)
        calculator.init_num_microbatches_calculator(0, None, args.global_batch_size, args.micro_batch_size,
                                                    args.data_parallel_size)
        try:
            microbatches = calculator.get_num_microbatches()
        finally:
            calculator.unset_num_microbatches_calculator()
    return args, config, microbatches


def check_run(arguments, monkeypatch, cell: dict, strategy: str, run: dict) -> None:
    """The run's command line parses and validates, and runs the grid's layout for `strategy`."""
    layout = grid_layout(run["layout"])
    args, config, microbatches = megatron_args(arguments, monkeypatch, run, cell["gpus"])
    stock = strategy in STOCK
    base_merge = not stock  # the plugin runs a layout's cp K as a base merge of K, for every strategy
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (layout["tp"], layout["pp"])
    assert args.sequence_parallel == (layout["tp"] > 1) == config.sequence_parallel
    assert args.world_size == cell["gpus"]
    if base_merge:  # cp K: Megatron cp 1, K times the replicas, --slimpack-base-merge K
        assert (args.context_parallel_size, args.slimpack_base_merge) == (1, layout["cp"])
        assert args.data_parallel_size == layout["dp"] * layout["cp"]
    else:
        assert args.context_parallel_size == layout["cp"] and args.data_parallel_size == layout["dp"]
        assert args.slimpack_base_merge == 1
    # Megatron's own validation turns --num-virtual-stages-per-pipeline-rank into this (None: plain 1F1B)
    assert (args.virtual_pipeline_model_parallel_size or 1) == layout["vpp"]
    recompute = layout["recompute"]
    assert args.recompute_granularity == (None if recompute == "none" else recompute) == config.recompute_granularity
    if recompute == "full":
        assert (args.recompute_method, args.recompute_num_layers) == ("uniform", 1)
    else:
        assert args.recompute_method is None
    model = MODELS[PRESETS[cell["model"]]]
    assert (args.num_layers, args.hidden_size, args.ffn_hidden_size, args.num_attention_heads) == (
        model.num_layers, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads)
    assert args.group_query_attention == (model.num_query_groups is not None)
    assert config.num_query_groups == model.kv_heads
    assert args.seq_length == args.max_position_embeddings == cell["context"]
    assert args.global_batch_size == BENCH["global_batch_size"][cell["context"]] and args.micro_batch_size == 1
    assert microbatches * args.data_parallel_size == args.global_batch_size
    assert args.bf16 and args.use_distributed_optimizer and args.calculate_per_token_loss
    assert args.slimpack == (not stock)
    if stock:
        assert not args.reset_attention_mask and not args.create_attention_mask_in_dataloader
    else:
        assert args.slimpack_strategy == strategy and not args.apply_rope_fusion


def test_every_printed_command_line_parses_validates_and_runs_the_grid_layout(printed, megatron_arguments):
    checked = 0
    for cell in GRID:
        for strategy in cell["strategies"]:
            run = printed[f"{cell_name(cell)}.{strategy}"]
            if run["args"] is None:
                continue
            with pytest.MonkeyPatch.context() as monkeypatch:
                try:
                    check_run(megatron_arguments, monkeypatch, cell, strategy, run)
                except BaseException as error:  # SystemExit from argparse, AssertionError, ValueError
                    raise AssertionError(f"{cell_name(cell)}.{strategy}: {shlex.join(run['args'])}") from error
            checked += 1
    assert checked == sum(run["args"] is not None for run in printed.values()) >= 2 * len(GRID)


def _changed(run: dict, flag: str, value: str | None) -> dict:
    """`run` with `flag`'s value replaced (value None: the flag removed)."""
    args = list(run["args"])
    index = args.index(flag)
    if value is None:
        del args[index]
    else:
        args[index + 1] = value
    return {**run, "args": args}


def test_the_checks_catch_a_command_line_that_does_not_run_the_grid_layout(printed, megatron_arguments):
    cell = next(c for c in GRID if c["strategies"]["slimpack"]["layout"].split()[2] != "cp1"
                and c["strategies"]["megatron-fixed"]["layout"].split()[0] != "tp1")
    slimpack = printed[f"{cell_name(cell)}.slimpack"]
    fixed = printed[f"{cell_name(cell)}.megatron-fixed"]
    for strategy, run in (("slimpack", slimpack), ("megatron-fixed", fixed)):
        with pytest.MonkeyPatch.context() as monkeypatch:
            check_run(megatron_arguments, monkeypatch, cell, strategy, run)  # as printed: passes
    broken = [
        # SlimPack refuses Megatron's context parallelism (validate_slimpack_args)
        ("slimpack", _changed(slimpack, "--context-parallel-size", "2"), (ValueError, "context-parallel-size > 1")),
        # the base merge dropped: a different layout (cp1 planned over the same replicas)
        ("slimpack", _changed(slimpack, "--slimpack-base-merge", "1"), (AssertionError, None)),
        # sequence parallelism missing
        ("megatron-fixed", _changed(fixed, "--sequence-parallel", None), (AssertionError, None)),
        # tp 3 does not divide the GPUs (Megatron's validate_args)
        ("megatron-fixed", _changed(fixed, "--tensor-model-parallel-size", "3"), (AssertionError, "not divisible")),
        # a flag Megatron does not know (parse_args exits)
        ("megatron-fixed", {**fixed, "args": fixed["args"] + ["--no-such-flag"]}, (SystemExit, None)),
    ]
    for strategy, run, (error, match) in broken:
        with pytest.MonkeyPatch.context() as monkeypatch, pytest.raises(error, match=match):
            with contextlib.redirect_stderr(io.StringIO()):
                check_run(megatron_arguments, monkeypatch, cell, strategy, run)


# ---- running the grid: failures are loud, one Python, filters checked -------------------------
CELL = ["--models", "llama-7b", "--contexts", "65536", "--clusters", "h100-128", "--datasets", "wikipedia"]
FIXED_RUN = "llama-7b_64k_h100-128_wikipedia.megatron-fixed"
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"
FIXED_LAYOUT = next(cell["strategies"]["megatron-fixed"]["layout"] for cell in GRID
                    if f"{cell_name(cell)}.megatron-fixed" == FIXED_RUN)


def fake_trainer(directory: Path, body: str) -> Path:
    """A Megatron-LM directory whose pretrain_gpt.py is `body` (torchrun starts it as the trainer)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pretrain_gpt.py").write_text("import os, sys\n" + body)
    return directory


def system_python(directory: Path) -> Path:
    """A `python` for the front of PATH that fails like a system Python without torch."""
    directory.mkdir(parents=True, exist_ok=True)
    fake = directory / "python"
    fake.write_text("#!/bin/sh\necho \"ModuleNotFoundError: No module named 'torch' (system python)\" >&2\nexit 1\n")
    fake.chmod(0o755)
    return directory


def run_grid(tmp_path: Path, trainer: Path, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """reproduce_paper.sh with the torchrun launcher (one local rank) on megatron-fixed of one cell."""
    from megatron_slimpack.runtime.processes import free_port

    environment = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    environment.update({"MEGATRON_DIR": str(trainer), "GPUS_PER_NODE": "1", "MASTER_PORT": str(free_port()),
                        "PATH": f"{system_python(tmp_path / 'bin')}:{os.environ['PATH']}", **(env or {})})
    return subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_paper.sh"), "--launcher", "torchrun", *CELL,
                           "--strategies", "megatron-fixed", "--data-path-wikipedia", str(tmp_path / "data"),
                           "--logs", str(tmp_path / "logs"), *argv],
                          capture_output=True, text=True, timeout=180, env=environment)


ITERATIONS = "".join(f"print(' iteration {i}/8 | elapsed time per iteration (ms): 100.0 |')\n" for i in range(8))


def test_a_failed_run_exits_non_zero_with_its_log_tail_and_is_run_again(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    # a log without iteration times (a run that died) is not a result: it is run again
    (logs / f"{FIXED_RUN}.log").write_text("Traceback (most recent call last):\nRuntimeError: CUDA out of memory\n")
    trainer = fake_trainer(tmp_path / "megatron", "print('loading the data set'); print('boom: NCCL timeout')\n"
                                                  "sys.exit(3)\n")
    result = run_grid(tmp_path, trainer)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"{FIXED_RUN} failed: exit status" in result.stderr and "boom: NCCL timeout" in result.stderr
    assert "FAILED" in result.stdout
    assert not (logs / f"{FIXED_RUN}.log").exists() and not (logs / f"{FIXED_RUN}.log.part").exists()
    assert "boom: NCCL timeout" in (logs / f"{FIXED_RUN}.failed.log").read_text()

    # the failed log is not reused: the next call runs it again
    fake_trainer(trainer, ITERATIONS)
    result = run_grid(tmp_path, trainer)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"| megatron-fixed | {FIXED_LAYOUT} | 100.0 | 1.00x |" in result.stdout
    assert "elapsed time per iteration" in (logs / f"{FIXED_RUN}.log").read_text()
    assert not (logs / f"{FIXED_RUN}.failed.log").exists()


def test_a_run_that_prints_no_iteration_time_fails(tmp_path):
    trainer = fake_trainer(tmp_path / "megatron", "print('> building GPT model ...'); print('exiting early')\n")
    result = run_grid(tmp_path, trainer)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "no \"elapsed time per iteration (ms)\" line" in result.stderr and "exiting early" in result.stderr
    assert (tmp_path / "logs" / f"{FIXED_RUN}.failed.log").exists()
    # --parse-only says so as well, for a log kept under the successful name
    (tmp_path / "logs" / f"{FIXED_RUN}.failed.log").rename(tmp_path / "logs" / f"{FIXED_RUN}.log")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = reproduce_paper.main(["--parse-only", "--launcher", "torchrun", "--logs", str(tmp_path / "logs"),
                                       *CELL])
    assert status == 1 and "its log has no iteration times" in err.getvalue() and "FAILED" in out.getvalue()


def test_the_launcher_runs_the_python_of_reproduce_paper_never_the_system_python(tmp_path):
    body = "print('trainer python:', sys.executable, os.environ.get('WRAPPED', '-'))\n" + ITERATIONS
    trainer = fake_trainer(tmp_path / "megatron", body)
    # `python` on PATH is a system Python without torch: the project's .venv runs everything
    result = run_grid(tmp_path, trainer)
    assert result.returncode == 0, result.stdout + result.stderr
    log = (tmp_path / "logs" / f"{FIXED_RUN}.log").read_text()
    assert f"trainer python: {VENV_PYTHON} -" in log
    # PYTHON overrides it, for reproduce_paper.sh and the launcher alike
    wrapper = tmp_path / "python-wrapper"
    wrapper.write_text(f"#!/bin/sh\nWRAPPED=yes exec {VENV_PYTHON} \"$@\"\n")
    wrapper.chmod(0o755)
    (tmp_path / "logs" / f"{FIXED_RUN}.log").unlink()
    result = run_grid(tmp_path, trainer, env={"PYTHON": str(wrapper)})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"trainer python: {VENV_PYTHON} yes" in (tmp_path / "logs" / f"{FIXED_RUN}.log").read_text()
    # a PYTHON that does not exist is an error naming it, not a fall back to another interpreter
    result = run_grid(tmp_path, trainer, "--dry-run", env={"PYTHON": str(tmp_path / "nowhere" / "python")})
    assert result.returncode == 1 and "PYTHON=" in result.stderr and "nowhere" in result.stderr


def fake_slurm(directory: Path) -> Path:
    """sbatch/srun/scontrol for the front of PATH that run the batch script on this machine, one node."""
    directory.mkdir(parents=True, exist_ok=True)
    scripts = {
        "sbatch": """#!/bin/bash
output=slurm.out; args=()
for arg in "$@"; do
  case "$arg" in --output=*) output="${arg#--output=}" ;; --wait|--nodes=*|--job-name=*) ;; *) args+=("$arg") ;; esac
done
export SLURM_JOB_ID=1 SLURM_JOB_NUM_NODES=1 SLURM_JOB_NODELIST=localhost
bash "${args[@]}" > "$output" 2>&1
""",
        "srun": """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
""",
        "scontrol": "#!/bin/sh\necho localhost\n",
    }
    for name, text in scripts.items():
        (directory / name).write_text(text)
        (directory / name).chmod(0o755)
    return directory


def test_the_slurm_job_runs_the_same_python_and_its_failure_is_loud(tmp_path):
    slurm = f"{fake_slurm(tmp_path / 'slurm')}:{tmp_path / 'bin'}:{os.environ['PATH']}"
    trainer = fake_trainer(tmp_path / "megatron", "print('trainer python:', sys.executable)\n" + ITERATIONS)
    result = run_grid(tmp_path, trainer, "--launcher", "slurm", env={"PATH": slurm})
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"trainer python: {VENV_PYTHON}" in (tmp_path / "logs" / f"{FIXED_RUN}.log").read_text()
    assert "| 100.0 | 1.00x |" in result.stdout
    fake_trainer(trainer, "print('boom: rank 3 lost its GPU'); sys.exit(1)\n")
    (tmp_path / "logs" / f"{FIXED_RUN}.log").unlink()
    result = run_grid(tmp_path, trainer, "--launcher", "slurm", env={"PATH": slurm})
    assert result.returncode == 1 and "boom: rank 3 lost its GPU" in result.stderr
    assert (tmp_path / "logs" / f"{FIXED_RUN}.failed.log").exists()


def test_dry_run_lines_name_the_python_the_launchers_run(printed):
    runs = [run for run in printed.values() if run["args"]]
    assert runs and all(run["env"]["PYTHON"] == sys.executable for run in runs)


@pytest.mark.parametrize("argv, valid", [
    (["--models", "llama-8b"], "llama-7b, llama-13b, llama-70b, llama-150b"),
    (["--strategies", "slimpack,slimpak"], "megatron-fixed"),
    (["--contexts", "64k"], "65536, 131072, 262144"),
    (["--clusters", "h100-64"], "h100-128"),
    (["--datasets", "wiki"], "wikipedia"),
])
def test_a_filter_value_outside_the_grid_is_an_error_listing_the_valid_ones(argv, valid, capsys):
    assert reproduce_paper.main(["--dry-run", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert f"--{argv[0][2:]} {argv[1].split(',')[-1]}: not in the grid; valid values: " in captured.err
    assert valid in captured.err


def test_the_shell_wrapper_exits_non_zero_on_a_filter_typo():
    result = subprocess.run(["bash", str(ROOT / "scripts" / "reproduce_paper.sh"), "--dry-run", "--models",
                             "llama-8b"], capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and result.stdout == ""
    assert "llama-8b: not in the grid; valid values: llama-7b" in result.stderr


# ---- apply_patches.sh with the megatron-core wheel -----------------------------------------------
def apply_patches(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    return subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), *argv], capture_output=True,
                          text=True, timeout=120, env={**environment, **(env or {})})


def test_apply_patches_reads_the_release_of_the_installed_megatron_core(tmp_path):
    """A Megatron-LM checkout without megatron/core (the trainer extract of ../shared/megatron-lm, as used
    with the megatron-core wheel): the release is the venv's megatron-core."""
    import megatron.core.package_info as info

    checkout = tmp_path / "Megatron-LM"
    checkout.mkdir()
    shutil.copyfile(harness.megatron_lm() / "pretrain_gpt.py", checkout / "pretrain_gpt.py")
    version = f"{info.MAJOR}.{info.MINOR}"
    result = apply_patches("--check", str(checkout))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "applies cleanly" in result.stdout and f"megatron-core {version}" in result.stdout
    result = apply_patches(str(checkout))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "install_slimpack(" in (checkout / "pretrain_gpt.py").read_text()
    # an installed release without a patch is named, with where it was found
    site = tmp_path / "site" / "megatron" / "core"
    site.mkdir(parents=True)
    (site / "package_info.py").write_text("MAJOR = 0\nMINOR = 12\nPATCH = 0\n")
    result = apply_patches("--check", str(checkout), env={"PYTHONPATH": str(tmp_path / "site")})
    assert result.returncode == 1 and "megatron-core 0.12" in result.stderr and "supported" in result.stderr
    assert str(site / "package_info.py") in result.stderr
    # a Python without megatron-core: said so, with the fix
    bare = tmp_path / "bare-python"
    bare.write_text(f"#!/bin/sh\nexec {sys.executable} -S -I \"$@\"\n")  # no site-packages, no PYTHONPATH
    bare.chmod(0o755)
    result = apply_patches("--check", str(checkout), env={"PYTHON": str(bare)})
    assert result.returncode == 1 and "finds no installed megatron-core" in result.stderr
    assert "set PYTHON" in result.stderr


def test_apply_patches_prints_every_flag_slimpack_requires(tmp_path, megatron_arguments):
    """The "train with:" flags, added to a command line without them, pass validate_slimpack_args (here
    a checkout with its own megatron/core/package_info.py, as the real-trainer harness builds one)."""
    import megatron.core.package_info as info

    checkout = tmp_path / "Megatron-LM"
    (checkout / "megatron" / "core").mkdir(parents=True)
    shutil.copyfile(harness.megatron_lm() / "pretrain_gpt.py", checkout / "pretrain_gpt.py")
    shutil.copyfile(info.__file__, checkout / "megatron" / "core" / "package_info.py")
    result = apply_patches(str(checkout))
    assert result.returncode == 0, result.stdout + result.stderr
    (hint,) = [line for line in result.stdout.splitlines() if line.startswith("train with:")]
    flags = shlex.split(hint.split("pretrain_gpt.py ...", 1)[1])
    assert "--micro-batch-size" in flags and "--no-rope-fusion" in flags
    assert apply_patches("--check", str(checkout)).stdout.count(hint) == 1  # said again when already applied
    from megatron_slimpack.megatron import add_slimpack_args, validate_slimpack_args

    model = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "512",
             "--max-position-embeddings", "512", "--global-batch-size", "8", "--position-embedding-type", "rope",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "512", "--mock-data"]
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("WORLD_SIZE", "1")
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *model, *flags])
        with contextlib.redirect_stdout(io.StringIO()):
            args = megatron_arguments.validate_args(megatron_arguments.parse_args(
                extra_args_provider=add_slimpack_args, ignore_unknown_args=False))
        validate_slimpack_args(args)
