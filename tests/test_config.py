"""Configuration declared once: `SlimPackConfig` and `MegatronIntegrationConfig` fields generate the
Megatron `--slimpack-*` flags and the `slimpack` CLI options, and validate every entry point."""
from __future__ import annotations

import argparse
import dataclasses
import math

import pytest

import megatron_slimpack as ms
from megatron_slimpack.config import (
    CLI,
    MEGATRON,
    ConfigError,
    MegatronIntegrationConfig,
    PlannerTunables,
    SlimPackConfig,
    add_options,
    from_options,
    not_options,
    option_fields,
    option_name,
)

CONFIGS = (SlimPackConfig, MegatronIntegrationConfig)
# Every --slimpack-* flag there is (README, patches, tests/real_megatron rely on these names).
MEGATRON_FLAGS = {
    "--slimpack-strategy", "--slimpack-slice-tokens", "--slimpack-max-micropack-tokens",
    "--slimpack-solver-time-limit", "--slimpack-solver-deterministic-limit", "--slimpack-plan-ahead",
    "--slimpack-dp-merge", "--no-slimpack-dp-merge", "--slimpack-fixed-grouping-floor",
    "--no-slimpack-fixed-grouping-floor", "--slimpack-base-merge", "--slimpack-cost-model",
    "--slimpack-hardware", "--slimpack-dump-plans", "--slimpack-planner-process", "--no-slimpack-planner-process",
    "--slimpack-allow-untested-megatron", "--no-slimpack-allow-untested-megatron", "--slimpack-planner-timeout",
    "--slimpack-long-documents", "--slimpack-wlb-delay-fractions", "--slimpack-tp-overlap",
    "--no-slimpack-tp-overlap",
}
# Fields deliberately not flags, on each surface.
NOT_MEGATRON_FLAGS = {"context_length", "seed", "merge_threshold", "solver_workers", "tunables"}
NOT_CLI_OPTIONS = {"merge_threshold", "solver_workers", "tunables", "plan_ahead", "dump_plans", "planner_process",
                   "allow_untested_megatron", "planner_timeout", "tp_overlap"}


def megatron_parser() -> argparse.ArgumentParser:
    from megatron_slimpack.megatron import add_slimpack_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-length", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=1234)
    return add_slimpack_args(parser)


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


# ---- flags generated from the fields -------------------------------------------------------------

@pytest.mark.parametrize("surface", [MEGATRON, CLI], ids=["megatron", "cli"])
def test_every_field_is_an_option_or_says_why_not(surface):
    for cls in CONFIGS:
        exposed = {item.name for item in option_fields(cls, surface)}
        missing = not_options(cls, surface)
        assert exposed | set(missing) == {item.name for item in dataclasses.fields(cls)}
        assert not exposed & set(missing)
        assert all(reason.strip() for reason in missing.values())
    not_exposed = {name for cls in CONFIGS for name in not_options(cls, surface)}
    assert not_exposed == (NOT_MEGATRON_FLAGS if surface is MEGATRON else NOT_CLI_OPTIONS)
    # context_length and seed are read from Megatron's own flags, and named by them in messages.
    assert option_name(SlimPackConfig, "context_length", MEGATRON) == "--seq-length"
    assert option_name(SlimPackConfig, "seed", MEGATRON) == "--seed"
    assert option_name(SlimPackConfig, "merge_threshold", MEGATRON) == "SlimPackConfig.merge_threshold"


def test_megatron_flags_are_generated_with_the_dataclass_defaults():
    parser = megatron_parser()
    assert option_strings(parser) - {"-h", "--help", "--seq-length", "--seed", "--slimpack"} == MEGATRON_FLAGS
    args = parser.parse_args([])
    from megatron_slimpack.megatron.args import integration_config_from_args, slimpack_config_from_args

    assert slimpack_config_from_args(args) == SlimPackConfig(context_length=4096, seed=1234)
    assert integration_config_from_args(args) == MegatronIntegrationConfig()
    for cls in CONFIGS:
        for item in option_fields(cls, MEGATRON):
            assert getattr(args, MEGATRON.dest(item)) == item.default, item.name
    # The historic spellings: the time limit's flag drops the field's unit suffix.
    assert args.slimpack_solver_time_limit == SlimPackConfig().solver_time_limit_s == 0.5
    help_text = " ".join(parser.format_help().split())
    assert "(default: 0.5)" in help_text and "megatron-stock: simulated for comparison only" in help_text


def test_megatron_flags_reach_the_config():
    parser = megatron_parser()
    args = parser.parse_args([
        "--seq-length", "8192", "--seed", "7", "--slimpack-strategy", "bfd", "--slimpack-slice-tokens", "1024",
        "--slimpack-max-micropack-tokens", "4096", "--slimpack-solver-time-limit", "3",
        "--slimpack-solver-deterministic-limit", "0.5", "--no-slimpack-dp-merge", "--slimpack-base-merge", "4",
        "--slimpack-plan-ahead", "0", "--slimpack-hardware", "cpu", "--slimpack-dump-plans", "out/plans",
        "--slimpack-wlb-delay-fractions", "0.75,0.375"])
    from megatron_slimpack.megatron.args import integration_config_from_args, slimpack_config_from_args

    assert slimpack_config_from_args(args) == SlimPackConfig(
        strategy="bfd", context_length=8192, seed=7, slice_tokens=1024, max_micropack_tokens=4096,
        solver_time_limit_s=3.0, solver_deterministic_limit=0.5, dp_merge=False, base_merge=4,
        wlb_delay_fractions="0.75,0.375")
    assert integration_config_from_args(args) == MegatronIntegrationConfig(plan_ahead=0, hardware="cpu",
                                                                           dump_plans="out/plans")
    # An args object without the flags (another provider's parser, a stand-in) gets the defaults.
    assert slimpack_config_from_args(argparse.Namespace()) == SlimPackConfig()


def test_cli_options_are_generated_with_the_dataclass_defaults():
    parser = argparse.ArgumentParser()
    added = add_options(parser, SlimPackConfig, CLI) + add_options(parser, MegatronIntegrationConfig, CLI)
    assert set(added) == {item.name for cls in CONFIGS for item in option_fields(cls, CLI)}
    assert option_strings(parser) - {"-h", "--help"} == {
        "--strategy", "--context-length", "--max-micropack-tokens", "--slice-tokens", "--dp-merge", "--no-dp-merge",
        "--fixed-grouping-floor", "--no-fixed-grouping-floor",
        "--base-merge", "--solver-time-limit", "--solver-deterministic-limit", "--seed", "--long-documents",
        "--wlb-delay-fractions", "--cost-model", "--hardware"}
    args = parser.parse_args([])
    assert from_options(SlimPackConfig, args, CLI) == SlimPackConfig()
    assert from_options(MegatronIntegrationConfig, args, CLI) == MegatronIntegrationConfig()
    args = parser.parse_args(["--no-dp-merge", "--solver-time-limit", "2", "--context-length", "1024"])
    assert from_options(SlimPackConfig, args, CLI, seed=3) == SlimPackConfig(
        dp_merge=False, solver_time_limit_s=2.0, context_length=1024, seed=3)
    with pytest.raises(TypeError, match="no Option"):
        add_options(parser, PlannerTunables, CLI)


def test_option_help_comes_from_the_field():
    parser = argparse.ArgumentParser()
    add_options(parser, SlimPackConfig, CLI, only=["slice_tokens", "solver_deterministic_limit"])
    text = " ".join(parser.format_help().split())
    assert "Target slice size of long documents in tokens" in text and "(default: the planner tries several)" in text
    assert "--solver-deterministic-limit UNITS" in text and "(default: the wall-clock limit only)" in text


# ---- validation in the dataclass ------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    (dict(strategy=""), "SlimPackConfig.strategy must be a strategy name"),
    (dict(context_length=0), "SlimPackConfig.context_length must be a positive integer, got 0"),
    (dict(context_length=4096.0), "SlimPackConfig.context_length must be a positive integer"),
    (dict(max_micropack_tokens=0), "SlimPackConfig.max_micropack_tokens must be a positive integer"),
    (dict(context_length=4096, max_micropack_tokens=8192),
     "SlimPackConfig.max_micropack_tokens 8192 exceeds SlimPackConfig.context_length 4096"),
    (dict(slice_tokens=-5), "SlimPackConfig.slice_tokens must be a positive integer, got -5"),
    (dict(context_length=4096, slice_tokens=4097), "SlimPackConfig.slice_tokens 4097 exceeds"),
    (dict(dp_merge=1), "SlimPackConfig.dp_merge must be True or False"),
    (dict(base_merge=3), "SlimPackConfig.base_merge must be a power of two >= 1, got 3"),
    (dict(base_merge=0), "SlimPackConfig.base_merge must be a power of two >= 1, got 0"),
    (dict(base_merge=True), "SlimPackConfig.base_merge must be a power of two"),
    (dict(merge_threshold=0), "SlimPackConfig.merge_threshold must be > 0"),
    (dict(solver_time_limit_s=0), "SlimPackConfig.solver_time_limit_s must be > 0 seconds"),
    (dict(solver_time_limit_s=math.inf), "SlimPackConfig.solver_time_limit_s must be > 0 seconds and finite"),
    (dict(solver_time_limit_s=math.nan), "SlimPackConfig.solver_time_limit_s must be > 0"),
    (dict(solver_deterministic_limit=0.0), "SlimPackConfig.solver_deterministic_limit must be > 0"),
    (dict(solver_deterministic_limit=-1), "SlimPackConfig.solver_deterministic_limit must be > 0"),
    (dict(seed=-1), "SlimPackConfig.seed must be an integer >= 0"),
    (dict(solver_workers=0), "SlimPackConfig.solver_workers must be a positive integer"),
    (dict(tunables={}), "SlimPackConfig.tunables must be a PlannerTunables"),
])
def test_slimpack_config_rejects_each_bad_value_naming_the_field(changes, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as caught:
        SlimPackConfig(**changes)
    assert isinstance(caught.value, ValueError)
    assert [name for name, _ in caught.value.problems] == [next(iter(changes)) if len(changes) == 1
                                                           else list(changes)[-1]]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        SlimPackConfig().with_(**changes)  # replace() validates too


@pytest.mark.parametrize("changes, message", [
    (dict(plan_ahead=-1), "MegatronIntegrationConfig.plan_ahead must be an integer >= 0"),
    (dict(cost_model="/no/such/profile.json"), "is neither 'analytic' nor an existing profile JSON"),
    (dict(hardware="tpu"), "MegatronIntegrationConfig.hardware 'tpu' is not a hardware preset"),
    (dict(dump_plans=""), "MegatronIntegrationConfig.dump_plans must be a directory or None"),
])
def test_integration_config_rejects_each_bad_value_naming_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        MegatronIntegrationConfig(**changes)


def test_integration_config_checks_the_hardware_with_a_profile_too(tmp_path):
    """A kernel profile (`slimpack profile --kernels`) prices on --hardware's analytic model, so the
    preset must exist whatever the cost model (a model profile's own hardware still wins when loaded)."""
    profile = tmp_path / "profile.json"
    profile.write_text("{}")
    assert MegatronIntegrationConfig(cost_model=str(profile), hardware="h200").cost_model == str(profile)
    with pytest.raises(ConfigError, match="'anything' is not a hardware preset"):
        MegatronIntegrationConfig(cost_model=str(profile), hardware="anything")


def test_every_problem_is_reported_and_renders_with_flag_names():
    with pytest.raises(ConfigError) as caught:
        SlimPackConfig(context_length=1024, slice_tokens=2048, base_merge=6, solver_time_limit_s=-1)
    error = caught.value
    assert [name for name, _ in error.problems] == ["slice_tokens", "base_merge", "solver_time_limit_s"]
    assert error.messages(lambda name: option_name(SlimPackConfig, name, MEGATRON)) == [
        "--slimpack-slice-tokens 2048 exceeds --seq-length 1024",
        "--slimpack-base-merge must be a power of two >= 1, got 6",
        "--slimpack-solver-time-limit must be > 0 seconds and finite, got -1",
    ]
    assert error.messages(lambda name: option_name(SlimPackConfig, name, CLI))[0] == \
        "--slice-tokens 2048 exceeds --context-length 1024"


def test_the_python_api_validates_and_keeps_its_contract():
    config = ms.SlimPackConfig(strategy="slimpack", context_length=262144)
    assert config.to_dict() == {
        "strategy": "slimpack", "context_length": 262144, "max_micropack_tokens": None, "slice_tokens": None,
        "dp_merge": True, "fixed_grouping_floor": True, "base_merge": 1, "merge_threshold": 1.25,
        "solver_time_limit_s": 0.5,
        "solver_deterministic_limit": None, "seed": 0, "long_documents": "error", "wlb_delay_fractions": "0.5,0.25",
        "solver_workers": 1, "tunables": dataclasses.asdict(PlannerTunables())}
    with pytest.raises(ValueError, match="SlimPackConfig.base_merge must be a power of two"):
        ms.SlimPackConfig(base_merge=3)
    import numpy as np

    assert type(ms.SlimPackConfig(context_length=np.int64(2048)).context_length) is int  # to_dict stays JSON
    # base_merge > 1 without DP-Merge is a planning error (the search says so), not a config error:
    # `plan_slimpack(..., dp_merge=False)` plans a config's base merge without DP-Merge the same way.
    assert ms.SlimPackConfig(base_merge=2, dp_merge=False).base_merge == 2


def test_a_config_error_crosses_processes_with_its_problems():
    """A benchmark's worker pool sends a worker's exception back pickled; the parent must unpickle
    it as the ConfigError it was (an __init__ with its own arguments would make that a TypeError)."""
    import pickle

    with pytest.raises(ConfigError) as caught:
        SlimPackConfig(context_length=-1, merge_threshold=0)
    restored = pickle.loads(pickle.dumps(caught.value))
    assert type(restored) is ConfigError and str(restored) == str(caught.value)
    assert restored.problems == caught.value.problems and len(restored.problems) == 2
    flag = lambda name: f"--slimpack-{name}"  # noqa: E731
    assert restored.messages(flag) == caught.value.messages(flag)
