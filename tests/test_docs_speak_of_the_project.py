"""The project's text speaks of the project: what the code does, why, how well, and its limits.

Development history (the working periods that built it, named by the word in WORD) has no place
in the README, the changelog, the docs, the benchmark results or the code's comments, docstrings
and tests. The only uses of the word allowed are the technical ones listed in ALLOWED (a pytest
fixture's scope).
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
THIS = Path(__file__).resolve()

# The word is spelled in two parts here so that this file's own text stays free of it.
WORD = "ses" + "sion"
# Exact phrases (case-insensitive) in which the word is a technical term, not development history.
ALLOWED = (f'scope="{WORD}"',)
MENTION = re.compile(rf"\b{WORD}s?\b", re.IGNORECASE)


def project_texts() -> list[Path]:
    texts = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "benchmarks" / "results").glob("*.md"))]
    for folder in ("megatron_slimpack", "tests", "benchmarks"):
        texts += sorted((ROOT / folder).rglob("*.py"))
    return [path for path in texts if path.resolve() != THIS]


def mentions_of_history(path: Path, root: Path = ROOT) -> list[str]:
    """`file:line: text` of every line that uses WORD (or its plural) outside the ALLOWED phrases."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        technical = line
        for phrase in ALLOWED:
            technical = re.sub(re.escape(phrase), "", technical, flags=re.IGNORECASE)
        if MENTION.search(technical):
            found.append(f"{path.relative_to(root)}:{number}: {line.strip()}")
    return found


def test_the_readme_and_changelog_exist():
    assert (ROOT / "README.md").is_file() and (ROOT / "CHANGELOG.md").is_file()


def test_no_text_speaks_of_development_history():
    found = [hit for path in project_texts() if path.is_file() for hit in mentions_of_history(path)]
    assert found == [], ("development history in the project's text (say what the code does and why):\n"
                         + "\n".join(found))


def test_the_allow_list_lets_only_technical_uses_through(tmp_path):
    sample = tmp_path / "sample.py"
    history = [f"# found in the sixteenth {WORD}", f"# {WORD.capitalize()}s 3-5 moved this"]
    sample.write_text(f'@pytest.fixture(scope="{WORD}")\n' + "\n".join(history) + "\n")
    assert [hit.split(": ", 1)[1] for hit in mentions_of_history(sample, tmp_path)] == history


def test_links_between_the_docs_resolve():
    """Every relative Markdown link of the README, the changelog and docs/ names a file that exists."""
    broken = []
    for page in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)", page.read_text(encoding="utf-8")):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert broken == []
