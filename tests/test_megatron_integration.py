"""Megatron-LM integration: flags and their validation, the trainer seams install()/uninstall()
swap, the planner iterator (same plan on every rank, exact resume), and the pretrain_gpt.py
patches with scripts/apply_patches.sh."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from conftest import run_multiprocess

ROOT = Path(__file__).resolve().parents[1]


# ---- arguments -----------------------------------------------------------------------------
def megatron_like_parser() -> argparse.ArgumentParser:
    """The few Megatron flags validation looks at, as Megatron spells them."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--calculate-per-token-loss", action="store_true")
    parser.add_argument("--context-parallel-size", type=int, default=1)
    parser.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    parser.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--fp8-format", dest="fp8", default=None)
    parser.add_argument("--qk-clip", action="store_true")
    parser.add_argument("--log-max-attention-logit", action="store_true")
    parser.add_argument("--tp-comm-overlap", action="store_true")
    parser.add_argument("--transformer-impl", default="transformer_engine")
    parser.add_argument("--enable-cuda-graph", action="store_true")
    parser.add_argument("--external-cuda-graph", action="store_true")
    parser.add_argument("--cuda-graph-impl", default="none")
    return parser


def parse(*argv):
    from megatron_slimpack.megatron import add_slimpack_args

    return add_slimpack_args(megatron_like_parser()).parse_args(list(argv))


def test_flags_parse_with_defaults():
    args = parse()
    assert args.slimpack is False and args.slimpack_strategy == "slimpack"
    assert args.slimpack_dp_merge is True and args.slimpack_plan_ahead == 1
    assert args.slimpack_cost_model == "analytic" and args.slimpack_dump_plans is None
    args = parse("--slimpack", "--calculate-per-token-loss", "--slimpack-strategy", "slimpack-sym",
                 "--slimpack-slice-tokens", "2048", "--slimpack-max-micropack-tokens", "4096",
                 "--slimpack-solver-time-limit", "2", "--slimpack-plan-ahead", "3", "--no-slimpack-dp-merge",
                 "--slimpack-dump-plans", "/tmp/plans", "--slimpack-base-merge", "2",
                 "--slimpack-solver-deterministic-limit", "0.25")
    assert (args.slimpack_slice_tokens, args.slimpack_max_micropack_tokens, args.slimpack_plan_ahead) == (2048, 4096, 3)
    assert args.slimpack_dp_merge is False and args.slimpack_solver_time_limit == 2.0
    from megatron_slimpack.megatron import SlimPackArgumentError, slimpack_config_from_args, validate_slimpack_args

    with pytest.raises(SlimPackArgumentError, match="--slimpack-base-merge > 1 shares MicroPacks through DP-Merge"):
        validate_slimpack_args(args)
    args.slimpack_dp_merge = True
    validate_slimpack_args(args)
    config = slimpack_config_from_args(args)
    assert (config.strategy, config.context_length, config.dp_merge, config.slice_tokens) == (
        "slimpack-sym", 4096, True, 2048)
    assert config.base_merge == 2 and slimpack_config_from_args(parse()).base_merge == 1
    assert config.solver_deterministic_limit == 0.25 and parse().slimpack_solver_deterministic_limit is None


def test_with_slimpack_args_chains_another_provider():
    from megatron_slimpack.megatron import with_slimpack_args

    def other(parser):
        parser.add_argument("--other-flag", action="store_true")
        return parser

    args = with_slimpack_args(other)(megatron_like_parser()).parse_args(["--other-flag", "--slimpack"])
    assert args.other_flag and args.slimpack
    assert with_slimpack_args(None)(megatron_like_parser()).parse_args([]).slimpack is False


@pytest.mark.parametrize("argv, message", [
    ((), "--calculate-per-token-loss"),
    (("--calculate-per-token-loss", "--context-parallel-size", "2"), "--context-parallel-size"),
    (("--calculate-per-token-loss", "--num-layers-per-virtual-pipeline-stage", "2"), "virtual"),
    (("--calculate-per-token-loss", "--virtual-pipeline-model-parallel-size", "2"), "virtual"),
    (("--calculate-per-token-loss", "--micro-batch-size", "2"), "--micro-batch-size 1"),
    (("--calculate-per-token-loss", "--slimpack-strategy", "nope"), "--slimpack-strategy 'nope' is unknown"),
    (("--calculate-per-token-loss", "--slimpack-max-micropack-tokens", "8192"), "exceeds --seq-length"),
    (("--calculate-per-token-loss", "--slimpack-cost-model", "/no/such/profile.json"), "slimpack profile"),
    (("--calculate-per-token-loss", "--slimpack-plan-ahead", "-1"), "--slimpack-plan-ahead"),
    (("--calculate-per-token-loss", "--slimpack-solver-deterministic-limit", "0"),
     "--slimpack-solver-deterministic-limit must be > 0"),
    (("--calculate-per-token-loss", "--slimpack-base-merge", "3"), "--slimpack-base-merge must be a power of two"),
    # The configs' own checks (`__post_init__`), named by flag:
    (("--calculate-per-token-loss", "--slimpack-base-merge", "0"), "--slimpack-base-merge must be a power of two"),
    (("--calculate-per-token-loss", "--slimpack-slice-tokens", "8192"),
     "--slimpack-slice-tokens 8192 exceeds --seq-length"),
    (("--calculate-per-token-loss", "--slimpack-solver-time-limit", "0"), "--slimpack-solver-time-limit must be > 0"),
    (("--calculate-per-token-loss", "--slimpack-hardware", "tpu"),
     "--slimpack-hardware 'tpu' is not a hardware preset"),
    # Megatron features the sliced runtime cannot serve:
    (("--calculate-per-token-loss", "--fp8-format", "hybrid"), "--fp8-format"),
    (("--calculate-per-token-loss", "--qk-clip"), "--qk-clip"),
    (("--calculate-per-token-loss", "--log-max-attention-logit"), "--log-max-attention-logit"),
    (("--calculate-per-token-loss", "--seq-length", "0"), "--seq-length must be a positive integer"),
    # Megatron features built for one fixed activation shape:
    (("--calculate-per-token-loss", "--tp-comm-overlap"),
     "--tp-comm-overlap: .*remove --tp-comm-overlap and use --slimpack-tp-overlap"),
    (("--calculate-per-token-loss", "--slimpack-tp-overlap", "--tensor-model-parallel-size", "2",
      "--transformer-impl", "local"), "--slimpack-tp-overlap hides .*add --sequence-parallel"),
    (("--calculate-per-token-loss", "--slimpack-tp-overlap", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"), "not --transformer-impl transformer_engine's .*use --transformer-impl local"),
    (("--calculate-per-token-loss", "--enable-cuda-graph"), "--enable-cuda-graph: .*use --cuda-graph-impl none"),
    (("--calculate-per-token-loss", "--external-cuda-graph"), "--external-cuda-graph: .*use --cuda-graph-impl none"),
    (("--calculate-per-token-loss", "--cuda-graph-impl", "local"),
     "--cuda-graph-impl local: .*use --cuda-graph-impl none"),
    (("--calculate-per-token-loss", "--cuda-graph-impl", "transformer_engine"),
     "--cuda-graph-impl transformer_engine: .*remove --enable-cuda-graph"),
])
def test_validation_errors_name_the_flag(argv, message):
    from megatron_slimpack.megatron import SlimPackArgumentError, validate_slimpack_args

    args = parse("--slimpack", *argv)
    with pytest.raises(SlimPackArgumentError, match=message.replace("(", r"\(")):
        validate_slimpack_args(args)


def test_the_tp_overlap_is_accepted_where_it_runs():
    from megatron_slimpack.megatron import validate_slimpack_args

    validate_slimpack_args(parse("--slimpack", "--calculate-per-token-loss", "--slimpack-tp-overlap",
                                 "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                 "--transformer-impl", "local"))
    validate_slimpack_args(parse("--slimpack", "--calculate-per-token-loss", "--slimpack-tp-overlap"))  # tp 1: no-op


def test_slimpack_flags_without_slimpack_are_reported():
    import warnings

    from megatron_slimpack.megatron import validate_slimpack_args

    with pytest.warns(UserWarning, match=r"^--slimpack-strategy, --no-slimpack-dp-merge given without --slimpack: "
                                         r"ignored \(add --slimpack"):
        validate_slimpack_args(parse("--slimpack-strategy", "bfd", "--no-slimpack-dp-merge"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate_slimpack_args(parse("--slimpack-strategy", "slimpack"))  # the default: nothing to say


def test_an_unwritable_plan_dump_directory_is_refused(tmp_path):
    from megatron_slimpack.megatron import SlimPackArgumentError, validate_slimpack_args

    a_file = tmp_path / "plans.txt"
    a_file.write_text("")
    with pytest.raises(SlimPackArgumentError, match="--slimpack-dump-plans .*plans.txt: exists and is not a directory"):
        validate_slimpack_args(parse("--slimpack", "--calculate-per-token-loss", "--slimpack-dump-plans", str(a_file)))
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):
        pytest.skip("running as a user who can write anywhere (root)")
    with pytest.raises(SlimPackArgumentError, match="locked is not writable"):
        validate_slimpack_args(parse("--slimpack", "--calculate-per-token-loss", "--slimpack-dump-plans",
                                     str(locked / "new" / "plans")))
    validate_slimpack_args(parse("--slimpack", "--calculate-per-token-loss", "--slimpack-dump-plans",
                                 str(tmp_path / "new" / "plans")))  # created later, by the iterator
    assert not (tmp_path / "new").exists()


def test_validation_reports_every_problem_one_line_each():
    from megatron_slimpack.megatron import SlimPackArgumentError, validate_slimpack_args

    args = parse("--slimpack", "--micro-batch-size", "2", "--slimpack-strategy", "megatron-hybrid-cp",
                 "--slimpack-base-merge", "3", "--slimpack-plan-ahead", "-2")
    with pytest.raises(SlimPackArgumentError) as caught:
        validate_slimpack_args(args)
    lines = str(caught.value).splitlines()[1:]
    assert [line.split()[1] for line in lines] == [
        "--slimpack", "--slimpack", "--slimpack-strategy", "--slimpack-base-merge", "--slimpack-plan-ahead"]
    assert "is simulated for comparison only" in lines[2]


def test_validation_is_silent_without_slimpack_and_checks_the_version():
    from megatron_slimpack.megatron import SlimPackArgumentError, validate_slimpack_args

    validate_slimpack_args(parse("--context-parallel-size", "4"))  # not our business without --slimpack
    args = parse("--slimpack", "--calculate-per-token-loss")
    validate_slimpack_args(args)  # the installed megatron-core (0.16.1) is supported
    validate_slimpack_args(parse("--slimpack", "--calculate-per-token-loss", "--tensor-model-parallel-size", "2",
                                 "--sequence-parallel"))  # sequence parallelism runs
    with pytest.raises(SlimPackArgumentError, match=r"megatron-core 0\.12\.0 is not supported"):
        validate_slimpack_args(args, version=(0, 12, 0))


@pytest.mark.parametrize("version", [(0, 19, 3), (0, 20, 0), (1, 0, 0)])
def test_a_release_newer_than_the_newest_tested_needs_the_override(version):
    from megatron_slimpack.megatron import SlimPackArgumentError, validate_slimpack_args

    args = parse("--slimpack", "--calculate-per-token-loss")
    with pytest.raises(SlimPackArgumentError, match=r"newer than 0\.19\.2.*--slimpack-allow-untested-megatron"):
        validate_slimpack_args(args, version=version)
    validate_slimpack_args(parse("--slimpack", "--calculate-per-token-loss", "--slimpack-allow-untested-megatron"),
                           version=version)
    validate_slimpack_args(args, version=(0, 19, 2))
    validate_slimpack_args(args, version=(0, 17, 0))  # an older patch release of a tested minor


def test_the_version_ignores_the_git_hash_megatron_core_appends():
    from megatron_slimpack.megatron.args import parse_version

    assert parse_version("0.19.2+a7fe95f") == (0, 19, 2)  # megatron-core inside a git work tree
    assert parse_version("0.20.0rc1") == (0, 20, 0)


# ---- install / uninstall ------------------------------------------------------------------
@pytest.fixture
def real_megatron_training(monkeypatch):
    """Megatron-LM's real trainer modules (megatron.training.training, gpt_builders) from
    ../shared/megatron-lm, imported in this process; install() swaps their attributes and the
    fixture restores them. (Training through them runs in test_real_megatron.py.)"""
    sys.path.insert(0, str(ROOT / "tests" / "real_megatron"))
    import harness

    monkeypatch.syspath_prepend(str(harness.megatron_lm()))
    import gpt_builders
    from megatron.training import global_vars, training

    originals = {name: getattr(training, name) for name in
                 ("get_forward_backward_func", "build_train_valid_test_data_iterators", "get_model_config")}
    yield types.SimpleNamespace(training=training, builders=gpt_builders, originals=originals,
                                global_vars=global_vars)
    from megatron_slimpack.megatron import hooks

    hooks.uninstall()
    global_vars._GLOBAL_ARGS = None


def test_install_swaps_exactly_the_documented_seams(real_megatron_training):
    from megatron_slimpack.megatron import hooks

    real = real_megatron_training
    before = {name: getattr(real.training, name) for name in dir(real.training)}
    before_builders = {name: getattr(real.builders, name) for name in dir(real.builders)}
    state = hooks.install(parse("--slimpack", "--calculate-per-token-loss"))
    assert state.convention == "pretrain-extra-args"  # megatron-core 0.16.1
    assert sorted(hooks.installed_seams()) == sorted([
        "megatron.training.training.get_forward_backward_func",
        "megatron.training.training.build_train_valid_test_data_iterators",
        "megatron.training.training.get_model_config", "gpt_builders.GPTModel"])
    changed = {n for n in before if getattr(real.training, n) is not before[n]}
    assert changed == set(hooks.TRAINING_SEAMS)
    assert {n for n in before_builders if getattr(real.builders, n) is not before_builders[n]} == {"GPTModel"}
    with pytest.raises(hooks.SlimPackInstallError, match="already"):
        hooks.install()
    hooks.uninstall()
    assert not hooks.is_installed()
    assert all(getattr(real.training, n) is before[n] for n in before)
    assert all(getattr(real.builders, n) is before_builders[n] for n in before_builders)
    hooks.uninstall()  # a second uninstall is a no-op


def test_used_seams_and_the_sliced_model_check(real_megatron_training, megatron_cpu):
    """install() lists what it replaced; used_seams() only what ran with --slimpack. The schedule's
    check refuses a model built without the sliced core attention, naming each layer."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_slimpack.megatron import hooks
    from megatron_slimpack.runtime.model import tiny_config

    real = real_megatron_training
    hooks.install(parse("--slimpack", "--calculate-per-token-loss"))
    assert hooks.used_seams() == []
    config = tiny_config(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64)
    sliced = real.builders.GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=64)
    assert hooks.used_seams() == ["gpt_builders.GPTModel"]
    hooks.check_sliced_model([sliced])
    stock = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=64, max_sequence_length=64)
    with pytest.raises(hooks.SlimPackInstallError) as refused:
        hooks.check_sliced_model([types.SimpleNamespace(module=stock)])  # unwrapped like DDP's .module
    message = str(refused.value)
    assert "chunk 0 is a GPTModel, not a SlimPackGPTModel" in message
    assert "decoder.layers.0.self_attention.core_attention is DotProductAttention" in message
    assert "used: gpt_builders.GPTModel" in message


def test_install_without_args_reads_megatron_args_lazily(real_megatron_training):
    """0.16/0.17 convention: install() before pretrain(); validation on first use of a seam."""
    from megatron_slimpack.megatron import SlimPackArgumentError, hooks

    real = real_megatron_training
    hooks.install()
    real.global_vars.set_args(parse("--slimpack"))  # no --calculate-per-token-loss
    with pytest.raises(SlimPackArgumentError, match="--calculate-per-token-loss"):
        real.training.get_forward_backward_func()


def test_install_rejects_bad_args_and_missing_seams(real_megatron_training, monkeypatch):
    from megatron_slimpack.megatron import SlimPackArgumentError, hooks

    real = real_megatron_training
    with pytest.raises(SlimPackArgumentError):
        hooks.install(parse("--slimpack"))
    assert not hooks.is_installed()
    monkeypatch.delattr(real.training, "get_model_config")
    with pytest.raises(hooks.SlimPackInstallError, match="does not match"):
        hooks.install(parse("--slimpack", "--calculate-per-token-loss"))
    assert not hooks.is_installed()
    assert real.training.get_forward_backward_func is real.originals["get_forward_backward_func"]


def test_convention_by_version():
    from megatron_slimpack.megatron.hooks import convention_for

    assert convention_for((0, 16, 1)) == convention_for((0, 17, 0)) == "pretrain-extra-args"
    assert convention_for((0, 18, 0)) == convention_for((0, 19, 1)) == "parse-and-validate"


def test_sliced_layer_spec_replaces_only_core_attention():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from megatron_slimpack.runtime.attention.core import SlicedDotProductAttention
    from megatron_slimpack.runtime.attention.core import with_sliced_core_attention as sliced_layer_spec

    spec = get_gpt_layer_local_spec(normalization="RMSNorm")
    sliced = sliced_layer_spec(spec)
    assert sliced.submodules.self_attention.submodules.core_attention.module is SlicedDotProductAttention
    original = spec.submodules.self_attention.submodules.core_attention
    assert getattr(original, "module", original) is not SlicedDotProductAttention  # the input is not modified
    assert sliced.submodules.mlp == spec.submodules.mlp
    assert (sliced.submodules.self_attention.submodules.linear_qkv
            == spec.submodules.self_attention.submodules.linear_qkv)


# ---- the planner iterator -----------------------------------------------------------------
def _plan_fn():
    from megatron_slimpack import CostModel, ParallelConfig, SlimPackConfig
    from megatron_slimpack.planner.strategies import new_planner

    cost = CostModel.analytic("tiny", "cpu")
    parallel = ParallelConfig(dp=2, pp=2)
    # Plans are compared across separate runs: a deterministic budget, not the wall clock, stops CP-SAT.
    config = SlimPackConfig(context_length=512, solver_time_limit_s=60, solver_deterministic_limit=0.05)
    planner = new_planner("slimpack")
    return lambda batch: planner.plan(batch.lengths, parallel, cost, config).validate()


def _sampler():
    from megatron_slimpack.workload import GlobalBatchSampler, load_lengths

    return GlobalBatchSampler(load_lengths("longtail:n=2000", seed=3), 512, 8, seed=3, long_documents="split")


def test_planner_iterator_resumes_exactly():
    from megatron_slimpack.megatron.data import PlannerIterator

    with PlannerIterator(_sampler(), _plan_fn(), plan_ahead=2, steps=6) as full:
        reference = [(p.batch.lengths, p.plan.fingerprint()) for p in full]
    assert len(reference) == 6
    first = PlannerIterator(_sampler(), _plan_fn(), plan_ahead=2, steps=6)
    seen = [(p.batch.lengths, p.plan.fingerprint()) for _, p in zip(range(3), first)]
    state = first.state_dict()  # the worker has planned ahead: those batches must not be skipped
    first.close()
    resumed = PlannerIterator(_sampler(), _plan_fn(), plan_ahead=2, steps=6)
    resumed.load_state_dict(state)
    seen += [(p.batch.lengths, p.plan.fingerprint()) for p in resumed]
    assert seen == reference
    summary = resumed.planning_summary()
    assert summary["steps"] == 3 and summary["planning_s"] > 0


def test_planner_iterator_inline_and_errors():
    from megatron_slimpack.megatron.data import PlannerError, PlannerIterator

    inline = PlannerIterator(_sampler(), _plan_fn(), plan_ahead=0, steps=2)
    assert [p.step for p in inline] == [0, 1]

    def broken(batch):
        raise ValueError("solver exploded")

    with pytest.raises(PlannerError, match="solver exploded"):
        next(PlannerIterator(_sampler(), broken, plan_ahead=1, steps=2))


def _same_plan_worker(rank, world_size, port, state_path):
    import json

    import torch
    import torch.distributed as dist

    from megatron_slimpack.megatron.data import PlannerIterator

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    # Only rank 0 plans; a different planning function on rank 1 must never be called.
    plan_fn = _plan_fn() if rank == 0 else (lambda batch: (_ for _ in ()).throw(AssertionError("rank 1 planned")))
    iterator = PlannerIterator(_sampler(), plan_fn, plan_ahead=1, steps=4)
    prints = []
    for index, planned in enumerate(iterator):
        prints.append(planned.plan.fingerprint())
        assert planned.stage_order(1, 1) == [planned.plan.replicas_of_rank(1)[0].stage_orders[1]]
        if index == 1:
            state = iterator.state_dict()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, (prints, state))
    assert gathered[0] == gathered[1], "ranks got different plans or states"
    if rank == 0:
        Path(state_path).write_text(json.dumps({"prints": prints, "state": state}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_planner_iterator_same_plan_on_all_ranks(tmp_path):
    import json

    from megatron_slimpack.megatron.data import PlannerIterator

    path = tmp_path / "state.json"
    run_multiprocess(_same_plan_worker, 2, str(path), timeout_s=120)
    saved = json.loads(path.read_text())
    with PlannerIterator(_sampler(), _plan_fn(), steps=4, broadcast=False) as local:
        assert [p.plan.fingerprint() for p in local] == saved["prints"]
    resumed = PlannerIterator(_sampler(), _plan_fn(), steps=4, broadcast=False)
    resumed.load_state_dict(saved["state"])  # saved after step 2 (index 1)
    assert [p.plan.fingerprint() for p in resumed] == saved["prints"][2:]


# ---- patches ------------------------------------------------------------------------------
PATCHES = sorted((ROOT / "patches").glob("pretrain_gpt.mcore-*.patch"))


def pre_image(patch: Path) -> str:
    """The patch's own expected context: the ' ' and '-' lines of every hunk, in order, with a
    filler line between hunks (a minimal pretrain_gpt.py the patch applies to)."""
    lines = []
    for line in patch.read_text().splitlines()[2:]:
        if line.startswith("@@"):
            lines.append("# ...")
        elif line.startswith((" ", "-")):
            lines.append(line[1:])
        elif line == "":
            lines.append("")
    return "\n".join(lines) + "\n"


def fake_checkout(root: Path, version: str, body: str) -> Path:
    major, minor = version.split(".")[:2]
    (root / "megatron" / "core").mkdir(parents=True)
    (root / "megatron" / "core" / "package_info.py").write_text(f"MAJOR = {major}\nMINOR = {minor}\nPATCH = 0\n")
    (root / "pretrain_gpt.py").write_text(body)
    return root


def run_script(*argv) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "apply_patches.sh"), *argv], capture_output=True, text=True)


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the `patch` program")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_apply_patches_check_and_apply(tmp_path, patch):
    assert len(PATCHES) >= 4
    version = patch.name.split("mcore-")[1].rsplit(".patch", 1)[0]
    checkout = fake_checkout(tmp_path / "Megatron-LM", version, pre_image(patch))
    result = run_script("--check", str(checkout))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "applies cleanly" in result.stdout
    assert "install_slimpack" not in (checkout / "pretrain_gpt.py").read_text()  # --check changes nothing
    result = run_script(str(checkout))
    assert result.returncode == 0, result.stdout + result.stderr
    patched = (checkout / "pretrain_gpt.py").read_text()
    assert "with_slimpack_args(" in patched and "install_slimpack(" in patched
    result = run_script("--check", str(checkout))
    assert result.returncode == 0 and "already applied" in result.stdout


@pytest.mark.skipif(shutil.which("patch") is None, reason="needs the `patch` program")
def test_apply_patches_reports_a_mismatch(tmp_path):
    checkout = fake_checkout(tmp_path / "Megatron-LM", "0.16", "print('not the pretrain_gpt.py we know')\n")
    result = run_script("--check", str(checkout))
    assert result.returncode != 0
    assert "does not match" in result.stderr
    other = fake_checkout(tmp_path / "old", "0.12", "x = 1\n")
    result = run_script("--check", str(other))
    assert result.returncode != 0 and "0.12" in result.stderr and "supported" in result.stderr
    result = run_script("--check", str(tmp_path / "nowhere"))
    assert result.returncode != 0 and "not a Megatron-LM checkout" in result.stderr


# ---- the Megatron-side data path on CPU (no megatron.training needed) -----------------------
def _megatron_args(**overrides):
    # Documents up to 600 tokens (and the mock corpus's up to 4,095) at --seq-length 256: cut at it.
    args = parse("--slimpack", "--calculate-per-token-loss", "--seq-length", "256",
                 "--slimpack-long-documents", "split")
    values = dict(num_layers=4, hidden_size=128, ffn_hidden_size=352, num_attention_heads=4, num_query_groups=2,
                  group_query_attention=True, padded_vocab_size=256, swiglu=True, data_parallel_size=2,
                  pipeline_model_parallel_size=2, tensor_model_parallel_size=1, global_batch_size=4,
                  slimpack_hardware="cpu", mock_data=False, data_path=None, recompute_granularity=None)
    values.update(overrides)
    for key, value in values.items():
        setattr(args, key, value)
    return args


def test_plans_are_priced_with_the_attention_backend_the_runtime_runs(monkeypatch):
    """What is planned is what runs: the planner's cost model prices the kernel the runtime's 'auto'
    picks on this machine (the torch kernel on a CPU; flash-attn where only it is installed)."""
    from megatron_slimpack.costmodel import CostModel
    from megatron_slimpack.megatron import hooks
    from megatron_slimpack.runtime.attention import kernels

    assert hooks.planned_attention_backend() == kernels.resolve_backend("auto") == "torch"
    priced = []
    load = CostModel.load.__func__

    def recording_load(cls, cost_model, model, hardware, **options):
        cost = load(cls, cost_model, model, hardware, **options)
        priced.append(cost.attention_backend)
        return cost

    monkeypatch.setattr(CostModel, "load", classmethod(recording_load))
    monkeypatch.setattr(kernels, "resolve_backend", lambda backend="auto": "flash")
    iterator = hooks.build_planner_iterator(_megatron_args(mock_data=True))
    iterator.close()
    assert priced == ["flash"]


def test_planner_iterator_from_megatron_args_on_an_indexed_dataset(tmp_path):
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from megatron_slimpack.megatron.hooks import build_planner_iterator

    prefix = str(tmp_path / "corpus")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    rng = np.random.default_rng(0)
    documents = [rng.integers(0, 256, size=int(n)) for n in rng.integers(5, 600, size=40)]
    for document in documents:
        builder.add_document(torch.tensor(document, dtype=torch.int32), [len(document)])
    builder.finalize(prefix + ".idx")

    args = _megatron_args(data_path=[prefix], slimpack_dump_plans=str(tmp_path / "plans"))
    iterator = build_planner_iterator(args)
    planned = next(iterator)
    planned.plan.validate()
    assert iterator.planner.backend == "process"  # the hook's plan function pickles: planned in a worker process
    assert planned.plan.parallel.dp == 2 and planned.plan.parallel.pp == 2
    source = planned.token_source(iterator.corpus)
    sample = planned.batch.sample_ids[0]
    document, offset = planned.batch.sources[0]
    length = planned.batch.lengths[0]
    assert list(source.tokens(sample, 0, length)) == list(documents[document][offset:offset + length])
    assert (tmp_path / "plans" / "plan_step0000000.json").exists()
    state = iterator.planner_state_dict()
    iterator.close()
    assert state["consumed"] == 1
    from megatron.core.rerun_state_machine import RerunDataIterator

    assert isinstance(iterator, RerunDataIterator)  # Megatron's rerun machine requires it

    with pytest.raises(Exception, match="one dataset prefix"):
        build_planner_iterator(_megatron_args(data_path=["0.5", prefix, "0.5", prefix]))
    mock = build_planner_iterator(_megatron_args(mock_data=True))
    batches = [next(mock).batch.lengths for _ in range(3)]
    mock.close()
    resumed = build_planner_iterator(_megatron_args(mock_data=True, iteration=2))  # Megatron resumed at step 2
    assert next(resumed).batch.lengths == batches[2]
    resumed.close()


def test_seams_exist_in_a_real_megatron_lm_checkout():
    """The names install() swaps exist in Megatron-LM's trainer source (../shared/megatron-lm, or
    the checkout SLIMPACK_MEGATRON_LM names), read without importing it."""
    import ast

    sys.path.insert(0, str(ROOT / "tests" / "real_megatron"))
    import harness

    root = harness.megatron_lm()
    from megatron_slimpack.megatron.hooks import TRAINING_SEAMS

    tree = ast.parse((Path(root) / "megatron" / "training" / "training.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {alias.asname or alias.name for alias in node.names}
        elif isinstance(node, ast.FunctionDef):
            names.add(node.name)
    assert set(TRAINING_SEAMS) <= names
    builders = ast.parse((Path(root) / "gpt_builders.py").read_text())
    imported = {a.asname or a.name for n in ast.walk(builders) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "GPTModel" in imported


def _merge_groups_worker(rank, world_size, port):
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_slimpack.megatron import hooks
    from megatron_slimpack.plan import MicroPack, Plan, ReplicaPlan, Sample, Slice
    from megatron_slimpack.specs import ParallelConfig

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=2)  # dp=2 per stage

    def plan(merged: bool) -> Plan:
        def replica(ranks, sample_id):
            return ReplicaPlan([MicroPack([Slice(sample_id, 0, 4)])], [[0]], [[0]], [[("F", 0), ("B", 0)]] * 2, ranks)
        replicas = ([replica([0, 1], 2)] if merged else []) + [replica([0], 0), replica([1], 1)]
        samples = [Sample(i, 4) for i in range(3 if merged else 2)]
        return Plan(replicas, samples, ParallelConfig(dp=2, pp=2), 8, "test")

    assert hooks._merge_process_groups(plan(False)) is None  # no merge group: nothing created
    groups = hooks._merge_process_groups(plan(True))
    assert hooks._merge_process_groups(plan(True)) is groups  # created once, then reused
    dp_ranks = dist.get_process_group_ranks(parallel_state.get_data_parallel_group())
    assert list(groups) == [(0, 1)] and dist.get_process_group_ranks(groups[(0, 1)]) == dp_ranks
    dist.destroy_process_group()


@pytest.mark.slow
def test_megatron_hook_creates_merge_groups_once_per_stage():
    run_multiprocess(_merge_groups_worker, 4, timeout_s=120)
