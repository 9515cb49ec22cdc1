"""docs/design.md is the map of where each concept lives: every path it names exists. The README
stays a page for users (issue 47): short, no long table cells.

A backticked span is a path when it is made of path characters and holds a ``/`` or ends in a
source or data file's extension. Spans with a ``/`` are read from the repository root. A bare file
name (``loss.py``) is checked only in the map's table (section 6), where it names a file of its
row's packages: it must exist in one of the directories the row's "where" column names (a
directory, or the directory of a file named there). Outside the table a bare name is a file a run
writes (``probe.json``, ``manifest.json``), not one of the tree's.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "design.md"
SPAN = re.compile(r"`([^`\n]+)`")
PATHLIKE = re.compile(r"[\w.-]+(?:/[\w.-]*)*")
EXTENSIONS = (".py", ".json", ".yaml", ".yml", ".md", ".proto", ".sh", ".toml")


def _is_path(span: str) -> bool:
    """A file name, or a path: rooted at a top-level entry of the repository, or ending like a
    directory or a file (``support_indptr/ids/logprobs`` in the wire's table is three fields)."""
    if not PATHLIKE.fullmatch(span):
        return False
    if "/" not in span:
        return span.endswith(EXTENSIONS)
    return _exists(span.split("/", 1)[0]) or span.endswith(("/", *EXTENSIONS))


def _exists(path: str) -> bool:
    return (ROOT / path).exists()


def _map_rows(text: str) -> list[list[str]]:
    """The cells of each row of section 6's concept table (header and rule rows left out)."""
    section = text.split("## 6. ", 1)[1].split("\n## ", 1)[0]
    table = section.split("| concept | where | notes |", 1)[1].split("\n\n", 1)[0]
    return [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in table.strip().splitlines() if not line.startswith("|---")]


def missing_rooted(text: str) -> list[str]:
    """The paths with a ``/`` that ``text`` names and the repository lacks."""
    return sorted({s for s in SPAN.findall(text) if _is_path(s) and "/" in s and not _exists(s)})


def missing_in_rows(text: str) -> list[tuple[str, str]]:
    """``(concept, name)`` of each bare file name of the map that none of its row's packages holds."""
    missing = []
    for concept, where, notes in _map_rows(text):
        where_paths = [s for s in SPAN.findall(where) if _is_path(s) and "/" in s]
        assert where_paths, f"row {concept!r} names no path in its 'where' column"
        dirs = {p if p.endswith("/") else str(Path(p).parent) for p in where_paths}
        for name in SPAN.findall(where + " " + notes):
            if _is_path(name) and "/" not in name and not any(_exists(f"{d}/{name}") for d in dirs):
                missing.append((concept, name))
    return missing


def test_every_path_design_md_names_exists():
    text = DOC.read_text()
    named = {s for s in SPAN.findall(text) if _is_path(s) and "/" in s}
    assert len(named) >= 40, sorted(named)  # the map names the tree; a parser that finds few is broken
    assert missing_rooted(text) == []


def test_every_file_a_map_row_names_is_in_the_rows_packages():
    text = DOC.read_text()
    concepts = [row[0] for row in _map_rows(text)]
    for concept in ("objective", "learner", "parallel", "checkpoint", "the run loop", "rollout service",
                    "samplers", "engine", "recipes and quantization", "convert", "envs",
                    "rewards and their isolation", "fleet", "experiments", "config"):
        assert concept in concepts, (concept, concepts)
    assert missing_in_rows(text) == []


def test_a_missing_path_is_caught():
    """A made-up path in the text, and a file its row's package does not hold, are both reported;
    a file of another package does not count for the row."""
    doc = ("See `trainer_jax/loss_v2.py`, `trainer_jx/objective/`, `docs/design.md` and the field\n"
           "`support_indptr/ids/logprobs`.\n\n## 6. Map\n\n"
           "| concept | where | notes |\n|---|---|---|\n"
           "| objective | `trainer_jax/objective/` | `loss.py`, `no_such.py`, `cli.py` |\n\n## 7. End\n")
    assert missing_rooted(doc) == ["trainer_jax/loss_v2.py", "trainer_jx/objective/"]
    assert missing_in_rows(doc) == [("objective", "no_such.py"), ("objective", "cli.py")]


def test_the_readme_stays_a_users_page():
    """Issue 47: the README under 250 lines, no table cell over 700 characters (history and long
    figures live in docs/benchmarks.md), the generated blocks in place."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) < 250, len(text.splitlines())
    rows = [line.strip().strip("|") for line in text.splitlines() if line.startswith("|")]
    cells = [c.strip() for row in rows for c in row.split("|")]
    assert cells and max(map(len, cells)) <= 700, max(cells, key=len)
    for tag in ("demo", "results"):
        assert text.count(f"<!-- {tag}:begin -->") == 1 and text.count(f"<!-- {tag}:end -->") == 1, tag
