"""Two spellings that set one setting to different values are refused before any work starts:
argparse alone keeps the last silently (`--tp 1 --tensor-model-parallel-size 2` planned tp2). One
option given twice keeps its last value (a launch script's appended override). Output paths that
cannot be written are refused before any work too."""
from __future__ import annotations

import pytest

from megatron_slimpack.apps import cli

PLAN = ["plan", "--workload", "longtail", "--model", "tiny", "--hardware", "cpu", "--dp", "1", "--pp", "1",
        "--context-length", "4096", "--global-batch-size", "2"]


@pytest.mark.parametrize("given, message", [
    (["--dp-merge", "--no-dp-merge"], "--dp-merge and --no-dp-merge set the same option to different values"),
    (["--tp", "1", "--tensor-model-parallel-size", "2"],
     "--tp 1 and --tensor-model-parallel-size 2 set the same option to different values"),
    (["--tensor-model-parallel-size=1", "--tp", "2"],
     "--tensor-model-parallel-size 1 and --tp 2 set the same option to different values"),
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


def test_the_same_value_twice_and_an_appended_override_are_fine(tmp_path, capsys):
    assert cli.main([*PLAN, "--tp", "1", "--tensor-model-parallel-size", "1", "--out", str(tmp_path / "p.json")]) == 0
    assert (tmp_path / "p.json").exists()
    assert cli.main([*PLAN, "--tp", "2", "--tp", "1", "--out", str(tmp_path / "p.json")]) == 0  # the last wins
    assert (tmp_path / "p.json").exists()
    compare = ["compare", "--workload", "longtail", "--model", "tiny", "--hardware", "cpu", "--gpus", "2",
               "--context-length", "4096", "--global-batch-size", "4", "--strategies", "bfd", "--workers", "1",
               "--no-cache", "--quiet", "--json", "--dp-merge", "--dp-merge"]
    assert cli.main(compare) == 0


@pytest.mark.parametrize("given, message", [
    (["--out", "{tmp}/missing/plan.json"], "--out {tmp}/missing/plan.json: the folder {tmp}/missing does not exist"),
    (["--out", "{tmp}"], "--out {tmp} is a directory; name a file"),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_planning(given, message, tmp_path, capsys,
                                                                           monkeypatch):
    def no_work(args):
        raise AssertionError("nothing may run")

    monkeypatch.setattr(cli, "cmd_plan", no_work)
    with pytest.raises(SystemExit) as stopped:
        cli.main([*PLAN, *(part.format(tmp=tmp_path) for part in given)])
    assert stopped.value.code == 2
    assert f"slimpack plan: error: {message.format(tmp=tmp_path)}" in capsys.readouterr().err


def test_a_gantt_folder_that_is_a_file_is_refused_before_the_search(tmp_path, capsys, monkeypatch):
    from megatron_slimpack.apps import comparison

    def no_search(*args, **kwargs):
        raise AssertionError("nothing may be searched")

    monkeypatch.setattr(comparison, "best_layout", no_search)
    taken = tmp_path / "charts"
    taken.write_text("a file")
    with pytest.raises(SystemExit) as stopped:
        cli.main(["compare", "--workload", "longtail", "--model", "tiny", "--hardware", "cpu", "--gpus", "2",
                  "--global-batch-size", "4", "--strategies", "bfd", "--workers", "1", "--gantt-dir", str(taken)])
    assert stopped.value.code == 2
    assert f"--gantt-dir {taken} is a file; name a directory" in capsys.readouterr().err


def test_cp_and_a_base_merge_together_are_refused(capsys):
    two_replicas = [*PLAN, "--dp", "2"]  # the last --dp wins
    assert cli.main([*two_replicas, "--cp", "2", "--base-merge", "2"]) == 2
    assert "--cp 2 and --base-merge 2 both share every MicroPack" in capsys.readouterr().err
