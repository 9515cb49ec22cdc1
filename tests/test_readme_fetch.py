"""README "Train your own model": the commands that fetch Qwen3-0.6B and GSM8K put the files where
configs/qwen3_gsm8k.yaml reads them, and every install extra the docs name is one pyproject.toml
defines (one spelling of the CUDA extra).

No network: the ``hf download`` lines are read (repository, type, what they include, where they
write); what ``hf download openai/gsm8k --include 'main/*'`` writes is stood in for by parquet
files of GSM8K's layout on the Hub (``main/{train,test}-00000-of-00001.parquet``, columns
``question`` / ``answer``); the README's conversion then runs for real on them, and the shipped
config loads from the result (the dataset env reads every row at load).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
SECTION = re.compile(r"^## Train your own model$(.*?)^##? ", re.M | re.S)


def _section() -> str:
    m = SECTION.search((ROOT / "README.md").read_text())
    assert m, "README.md has no 'Train your own model' section"
    return m.group(1)


def _bash_blocks(text: str) -> list[str]:
    """The ```bash blocks of ``text``, their list indentation removed."""
    blocks = []
    for m in re.finditer(r"^( *)```bash\n(.*?)^\1```", text, re.M | re.S):
        blocks.append("\n".join(line[len(m.group(1)):] for line in m.group(2).splitlines()))
    return blocks


def _downloads(blocks: list[str]) -> dict[str, list[str]]:
    """``repo id -> hf download arguments`` of the blocks' ``hf download`` lines."""
    out = {}
    for block in blocks:
        for line in block.splitlines():
            if line.startswith("hf download "):
                args = shlex.split(line)[2:]
                out[args[0]] = args[1:]
    return out


def _option(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_fetch_commands_write_what_the_config_reads(tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    from trainer_jax.config import load_config

    blocks = _bash_blocks(_section())
    downloads = _downloads(blocks)
    assert set(downloads) == {"Qwen/Qwen3-0.6B", "openai/gsm8k"}, downloads
    raw = (ROOT / "configs/qwen3_gsm8k.yaml").read_text()
    model = downloads["Qwen/Qwen3-0.6B"]
    data = downloads["openai/gsm8k"]
    assert _option(model, "--repo-type") is None  # a model repository, the default
    assert _option(data, "--repo-type") == "dataset" and _option(data, "--include") == "main/*"

    # what `hf download` leaves: the model directory (its files come from the Hub as they are) and
    # GSM8K's parquet shards under main/; the rows are the independent reference
    (tmp_path / _option(model, "--local-dir")).mkdir(parents=True)
    shards = tmp_path / _option(data, "--local-dir") / "main"
    shards.mkdir(parents=True)
    rows = {split: [{"question": f"{split} {i}: Tom has {i} apples and buys {i + 1} more. How many now? é",
                     "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"} for i in range(n)]
            for split, n in (("train", 5), ("test", 3))}
    for split, split_rows in rows.items():
        pd.DataFrame(split_rows).to_parquet(shards / f"{split}-00000-of-00001.parquet")

    # the README's conversion, as written (a here-document fed to python)
    script = next(b for b in blocks if "python - <<'EOF'" in b)
    body = script.split("python - <<'EOF'\n", 1)[1].split("\nEOF", 1)[0]
    out = subprocess.run([sys.executable, "-"], input=body, cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr

    here = os.getcwd()
    os.chdir(tmp_path)  # the config's paths are relative to where mixrl-train runs
    try:
        cfg = load_config(ROOT / "configs/qwen3_gsm8k.yaml")
    finally:
        os.chdir(here)
    assert cfg.model.hf_dir == _option(model, "--local-dir"), (cfg.model.hf_dir, raw)
    entry = next(e for e in cfg.tasks.mix if e.env == "dataset").options
    for split, key in (("train", "path"), ("test", "eval_path")):
        written = [json.loads(line) for line in (tmp_path / entry[key]).read_text().splitlines()]
        assert written == rows[split], split
        assert {entry["prompt_key"], entry["answer_key"]} <= set(written[0])


def test_every_extra_the_docs_name_is_defined():
    """``pip install -e '.[X]'`` / ``mixrl[X]`` in README.md and docs/*.md name extras of
    pyproject.toml (the README said `.[cuda]` in one place and `jax[cuda12]` in another)."""
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert "cuda" in extras
    named = set()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for m in re.finditer(r"(?:\.|mixrl)\[([a-z0-9_,-]+)\]", text):
            named |= {(doc.name, extra) for extra in m.group(1).split(",")}
        assert "jax[cuda" not in text, f"{doc.name}: install the CUDA extra as '.[cuda]'"
    assert ("README.md", "cuda") in named
    assert {extra for _, extra in named} <= extras, sorted(e for e in named if e[1] not in extras)
