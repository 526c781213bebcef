"""The `slimpack` command's planner options: generated from `SlimPackConfig` (and the cost model's
from `MegatronIntegrationConfig`), validated by the dataclass, errors named by option."""
from __future__ import annotations

import json

import pytest

import megatron_slimpack as ms
from megatron_slimpack import cli
from megatron_slimpack.config import CLI, MegatronIntegrationConfig, SlimPackConfig, option_fields
from test_cli_output import stand_in_comparison


@pytest.fixture(scope="module")
def parser():
    return cli.build_parser()


def flags_of(parser, command: str) -> set[str]:
    sub = parser._subparsers._group_actions[0].choices[command]
    return {flag for action in sub._actions for flag in action.option_strings}


def test_plan_has_every_planner_option_with_the_dataclass_defaults(parser):
    flags = flags_of(parser, "plan")
    for cls in (SlimPackConfig, MegatronIntegrationConfig):
        for item in option_fields(cls, CLI):
            assert CLI.flag(item) in flags, item.name
    assert {"--no-dp-merge", "--strategy", "--slice-tokens", "--base-merge", "--solver-time-limit"} <= flags
    args = parser.parse_args(["plan"])
    # The one default of its own: the command splits documents longer than the context (and says so).
    assert cli.planner_config(args) == SlimPackConfig(long_documents="split")
    args = parser.parse_args(["plan", "--strategy", "bfd", "--no-dp-merge", "--max-micropack-tokens", "2048",
                              "--solver-deterministic-limit", "0.5", "--seed", "4", "--long-documents", "error"])
    assert cli.planner_config(args) == SlimPackConfig(strategy="bfd", dp_merge=False, max_micropack_tokens=2048,
                                                      solver_deterministic_limit=0.5, seed=4)


def test_compare_leaves_out_what_each_layout_search_chooses(parser):
    flags = flags_of(parser, "compare")
    assert "--strategy" not in flags and "--base-merge" not in flags
    assert {"--strategies", "--solver-time-limit", "--slice-tokens", "--context-length", "--seed"} <= flags


def test_compare_passes_the_planner_options_on(monkeypatch):
    seen = stand_in_comparison(monkeypatch)
    assert cli.main(["compare", "--json", "--solver-time-limit", "2", "--slice-tokens", "512",
                     "--context-length", "4096", "--hardware", "h200"]) == 2  # no row: exit 2
    assert seen["config"] == SlimPackConfig(solver_time_limit_s=2.0, slice_tokens=512, context_length=4096,
                                            long_documents="split")
    assert seen["hardware"] == "h200" and seen["cost"].hardware.name == "h200"


@pytest.mark.parametrize("argv, message", [
    (["--base-merge", "3"], "--base-merge must be a power of two >= 1, got 3"),
    (["--context-length", "1024", "--max-micropack-tokens", "4096"],
     "--max-micropack-tokens 4096 exceeds --context-length 1024"),
    (["--solver-time-limit", "0"], "--solver-time-limit must be > 0 seconds"),
    (["--cost-model", "/no/such.json"], "--cost-model '/no/such.json' is neither 'analytic' nor an existing profile"),
])
def test_bad_values_are_refused_naming_the_option(argv, message, capsys):
    assert cli.main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


def test_plan_runs_with_generated_options(tmp_path, capsys):
    argv = ["plan", "--workload", "longtail:n=400", "--context-length", "4096", "--global-batch-size", "4",
            "--tp", "1", "--pp", "1", "--dp", "2", "--strategy", "bfd", "--no-dp-merge", "--json",
            "--out", str(tmp_path / "plan.json")]
    assert cli.main(argv) == 0
    assert json.loads(capsys.readouterr().out)[0]["documents"] > 0
    plan = ms.Plan.from_json(tmp_path / "plan.json").validate()
    assert plan.strategy == "bfd" and plan.context_length == 4096


def test_simulate_prices_a_plan_with_the_cost_model_it_was_made_with(tmp_path, capsys):
    """`simulate` prices a plan with the model and hardware it was planned for (llama-13b/a100 here), not
    the defaults (llama-7b/h100), without the flags being repeated."""
    out = tmp_path / "p.json"
    argv = ["plan", "--workload", "longtail", "--model", "llama-13b", "--hardware", "a100", "--tp", "8", "--pp", "2",
            "--dp", "2", "--context-length", "32768", "--global-batch-size", "16", "--steps", "2", "--out", str(out)]
    assert cli.main(argv) == 0
    written = [tmp_path / "p.step0.json", tmp_path / "p.step1.json"]
    said = capsys.readouterr().err
    assert all(f"slimpack plan: wrote {path}\n" in said for path in written) and f"wrote {out}\n" not in said
    plan = ms.Plan.from_json(written[0])
    expected = ms.simulate(plan, ms.CostModel.analytic("llama-13b", "a100")).iteration_time_s
    assert cli.main(["simulate", str(written[0]), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["iteration_s"] == pytest.approx(expected, rel=1e-12)
    assert cli.main(["simulate", str(written[0]), "--model", "llama-7b"]) == 2
    assert "--model llama-7b (the plan was made with llama-13b)" in capsys.readouterr().err
    assert cli.main(["simulate", str(written[0]), "--hardware", "a100"]) == 0  # agreeing: fine
    assert "re-priced" not in capsys.readouterr().err
    # another device re-prices the same plan there, and says so
    assert cli.main(["simulate", str(written[0]), "--hardware", "h100-sxm", "--json"]) == 0
    captured = capsys.readouterr()
    repriced = ms.simulate(plan, ms.CostModel.analytic("llama-13b", "h100-sxm")).iteration_time_s
    assert json.loads(captured.out)["iteration_s"] == pytest.approx(repriced, rel=1e-12) and repriced != expected
    assert "re-priced on h100-sxm (the plan was made for a100" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["compare", "--gpus", "0"], "argument --gpus: must be a positive integer, got 0"),
    (["compare", "--gpus", "-8"], "argument --gpus: must be a positive integer, got -8"),
    (["plan", "--steps", "0"], "argument --steps: must be a positive integer"),
    (["plan", "--steps", "-3"], "argument --steps: must be a positive integer"),
    (["plan", "--dp", "0"], "argument --dp: must be a positive integer"),
    (["plan", "--global-batch-size", "x"], "argument --global-batch-size: expected a positive integer"),
    (["plan", "--hardware", "tpu"], "argument --hardware: invalid choice: 'tpu' (choose from 'h100-sxm', 'h200'"),
    (["plan", "--strategy", "bogus"], "argument --strategy: invalid choice: 'bogus' (choose from "),
    (["simulate", "p.json", "--model", "llama-150b"], "argument --model: invalid choice: 'llama-150b' (choose from "
                                                      "'llama-7b', 'llama-13b', 'llama-70b', 'llama-150b-gqa'"),
    (["demo", "--pp", "0"], "argument --pp: must be a positive integer, got 0"),
    (["demo", "--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
    (["demo", "--lr", "nan"], "argument --lr: must be a positive number, got nan"),
    (["profile", "--tp", "2"], "argument --tp: invalid choice: 2 (choose from 1)"),
])
def test_nonsense_numbers_exit_2_naming_the_flag(argv, message, capsys):
    """A nonsense number is an error naming the flag (exit 2), never a run that prints nothing or an
    empty table."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_compare_without_any_strategy_or_feasible_layout_exits_2(capsys):
    assert cli.main(["compare", "--strategies", ""]) == 2
    assert "--strategies '' names no strategy" in capsys.readouterr().err
    argv = ["compare", "--workload", "longtail", "--model", "llama-70b", "--gpus", "1", "--context-length", "131072",
            "--global-batch-size", "4", "--strategies", "megatron-fixed,bfd"]
    assert cli.main(argv) == 2
    assert "no strategy has a feasible layout on 1 GPUs (megatron-fixed: " in capsys.readouterr().err


def test_unlikely_inputs_are_warned_about(tmp_path, capsys):
    argv = ["plan", "--workload", "longtail", "--context-length", "512", "--global-batch-size", "2", "--dp", "4",
            "--tp", "1", "--pp", "1", "--model", "tiny", "--hardware", "cpu"]
    assert cli.main(argv) == 0
    err = capsys.readouterr().err
    assert "--context-length 512 is below 1K tokens" in err
    assert "--global-batch-size 2 gives fewer sequences than the 4 data-parallel replicas" in err


def test_the_planning_commands_do_not_import_torch_or_megatron():
    """Building the parser imports neither torch nor megatron-core: `--help` and the planning commands
    start in about a second, without their warnings."""
    import subprocess
    import sys

    code = ("import sys, megatron_slimpack.apps.cli as c; c.build_parser(); "
            "sys.exit(int('torch' in sys.modules or 'megatron.core' in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_bad_plan_files_and_inputs_are_one_line_errors(tmp_path, capsys):
    """A plan JSON that is a list, a directory given as the plan and plan(None) each get one clear error,
    not a traceback."""
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    assert cli.main(["simulate", str(listed)]) == 2
    assert "holds a JSON list, not a plan" in capsys.readouterr().err
    assert cli.main(["simulate", str(tmp_path)]) == 2
    assert "is a directory: give the plan's JSON file" in capsys.readouterr().err
    with pytest.raises(ms.SlimPackError, match="lengths must be a sequence of positive integers, got NoneType"):
        ms.plan(None, parallel=ms.ParallelConfig(), cost=ms.CostModel.analytic("llama-7b", "h100-sxm"))
    for error in (ms.PlanError, ms.SpecError, ms.WorkloadError, ms.ConfigError):
        assert issubclass(error, ms.SlimPackError)


def test_plan_model_error_lists_the_presets(capsys):
    """A model name that is no preset (llama-150b; the preset is llama-150b-gqa) is refused with every
    preset's name."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["plan", "--model", "llama-150b"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert "argument --model: invalid choice: 'llama-150b'" in err and "'llama-150b-gqa'" in err


def _subcommand(parser, name: str):
    return parser._subparsers._group_actions[0].choices[name]


@pytest.mark.parametrize("command", list(cli.build_parser()._subparsers._group_actions[0].choices))
def test_every_option_has_a_help_text(command):
    """Every option of every `slimpack <command>` has a help text."""
    sub = _subcommand(cli.build_parser(), command)
    bare = [action.option_strings or action.dest for action in sub._actions if not (action.help or "").strip()]
    assert bare == []


def test_the_subcommands_themselves_have_help():
    parser = cli.build_parser()
    commands = parser._subparsers._group_actions[0]
    assert all((choice.help or "").strip() for choice in commands._choices_actions)
    assert {choice.dest for choice in commands._choices_actions} == set(commands.choices)


MODEL_PRESETS = ["llama-7b", "llama-13b", "llama-70b", "llama-150b-gqa", "llama3-8b", "llama3-70b", "llama3-405b",
                 "gpt-7.1b", "gpt-70b", "gpt-177b", "tiny", "small"]


@pytest.mark.parametrize("command, flag, values", [
    ("plan", "--model", MODEL_PRESETS),
    ("plan", "--hardware", ["h100-sxm", "h200", "a100", "cpu"]),
    ("compare", "--model", MODEL_PRESETS),
    ("simulate", "--hardware", ["h100-sxm", "h200", "a100", "cpu"]),
    ("demo", "--model", MODEL_PRESETS),
    ("profile", "--model", MODEL_PRESETS),
])
def test_fixed_value_options_list_their_choices(command, flag, values):
    sub = _subcommand(cli.build_parser(), command)
    action = next(a for a in sub._actions if flag in a.option_strings)
    assert list(action.choices) == values
    assert ", ".join(values) in action.help


def test_strategy_choices_are_the_registered_strategies():
    from megatron_slimpack.planner.strategies import strategy_names

    action = next(a for a in _subcommand(cli.build_parser(), "plan")._actions if "--strategy" in a.option_strings)
    assert list(action.choices) == strategy_names()
