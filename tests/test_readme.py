"""The README's Python snippet and quick-start commands run as written."""
from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_the_python_snippet_runs(tmp_path, monkeypatch):
    snippet = re.search(r"From Python \(the public contract\):\n\n```python\n(.*?)```", README.read_text(), re.S)
    assert snippet, "the README's Python snippet is gone"
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(snippet.group(1), "README.md", "exec"), scope)
    report, plan = scope["report"], scope["p"]
    assert report.iteration_time_s >= report.lower_bound_s > 0
    assert (tmp_path / "plan.json").is_file() and plan.num_tokens > 0


def quick_start_commands() -> list[str]:
    """The `slimpack ...` commands of the README's Quick start block, continuation lines joined."""
    block = re.search(r"## Quick start\n.*?```bash\n(.*?)```", README.read_text(), re.S)
    assert block, "the README's Quick start block is gone"
    text = block.group(1).replace("\\\n", " ")
    return [line.strip() for line in text.splitlines() if line.strip().startswith("slimpack ")]


def test_the_quick_start_commands_run_as_printed(tmp_path, monkeypatch):
    """Each quick-start command, run in an empty folder in the README's order, exits 0 and writes
    what it names. `compare` is left out here (about half a minute; its options are those the
    compare tests run)."""
    import shlex

    from megatron_slimpack.apps import cli

    monkeypatch.chdir(tmp_path)
    commands = quick_start_commands()
    assert [command.split()[1] for command in commands] == ["plan", "simulate", "compare", "cost"]
    for command in commands:
        if command.split()[1] == "compare":
            continue
        assert cli.main(shlex.split(command)[1:]) == 0, command
    assert all((tmp_path / name).is_file() for name in ("plan.json", "plan.png", "plan.trace.json"))
