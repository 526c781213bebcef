"""Options that set one setting twice to different values are refused before any work starts:
argparse alone keeps the last silently (`--tp 1 --tensor-model-parallel-size 2` planned tp2)."""
from __future__ import annotations

import pytest

from megatron_slimpack.apps import cli

PLAN = ["plan", "--workload", "longtail", "--model", "tiny", "--hardware", "cpu", "--dp", "1", "--pp", "1",
        "--context-length", "4096", "--global-batch-size", "2"]


@pytest.mark.parametrize("given, message", [
    (["--dp-merge", "--no-dp-merge"], "--dp-merge and --no-dp-merge set the same option to different values"),
    (["--tp", "1", "--tensor-model-parallel-size", "2"],
     "--tp 1 and --tensor-model-parallel-size 2 set the same option to different values"),
    (["--tp=1", "--tp", "2"], "--tp 1 and --tp 2 set the same option to different values"),
])
def test_contradicting_options_are_an_error_naming_both(given, message, capsys, monkeypatch):
    def no_work(args):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(cli, "cmd_plan", no_work)
    with pytest.raises(SystemExit) as stopped:
        cli.main([*PLAN, *given])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"slimpack plan: error: {message}: give one" in err


def test_the_same_value_twice_and_other_commands_options_are_fine(tmp_path, capsys):
    assert cli.main([*PLAN, "--tp", "1", "--tensor-model-parallel-size", "1", "--out", str(tmp_path / "p.json")]) == 0
    assert (tmp_path / "p.json").exists()
    compare = ["compare", "--workload", "longtail", "--model", "tiny", "--hardware", "cpu", "--gpus", "2",
               "--context-length", "4096", "--global-batch-size", "4", "--strategies", "bfd", "--workers", "1",
               "--no-cache", "--quiet", "--json", "--dp-merge", "--dp-merge"]
    assert cli.main(compare) == 0
