"""The README's Python snippet runs as written."""
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
