"""Dataset rows are checked as the file is read, streamed with a cap per line (issue 31, item 5).

Every kind of bad row is one error naming the file and line, or, with ``skip_bad_rows``, left
out and counted (``env/dataset/skipped_rows``); an over-long line is refused after reading the
cap's worth of it, never held whole.
"""

import json
import tracemalloc

import numpy as np
import pytest

from convert.tokenizer import char_tokenizer
from envs.dataset import BadRow, load_rows
from trainer_jax.config import ConfigError, MixEntry, load_config
from trainer_jax.service.tasks import EnvTaskSource

GOOD = [{"q": f"{i}+1?", "a": str(i + 1)} for i in range(3)]
BAD_LINES = {  # each kind of bad row -> the problem its error names
    "{not json": "invalid JSON",
    "[1, 2]": "not a JSON object (a list)",
    '"just text"': "not a JSON object (a str)",
    json.dumps({"a": "1"}): "no column 'q' (options.prompt_key)",
    json.dumps({"q": "x"}): "no column 'a' (options.answer_key)",
    json.dumps({"q": 3, "a": "1"}): "neither text nor a list of {role, content} messages",
    json.dumps({"q": [{"role": "user"}], "a": "1"}): "neither text nor a list",
    '{"q": "\xff"}'.encode("latin-1").decode("latin-1"): "no column 'a'",
    "[" * 100_000: "invalid JSON",  # nested past the parser's stack: RecursionError, one line
}


def _write(path, lines, newline="\n"):
    path.write_bytes("".join(line + newline for line in lines).encode("utf-8", "surrogateescape"))
    return path


@pytest.mark.parametrize("bad, problem", list(BAD_LINES.items()), ids=range(len(BAD_LINES)))
def test_each_bad_row_is_one_line_naming_file_and_line(tmp_path, bad, problem):
    path = _write(tmp_path / "d.jsonl", [json.dumps(GOOD[0]), "", bad, json.dumps(GOOD[1])])
    with pytest.raises(BadRow) as e:
        load_rows(str(path), prompt_key="q", answer_key="a")
    line = str(e.value)
    assert line.startswith(f"dataset {path} line 3: ") and problem in line and "\n" not in line, line
    rows = load_rows(str(path), prompt_key="q", answer_key="a", skip_bad_rows=True)
    assert (len(rows), rows.skipped, rows["q"]) == (2, 1, ["0+1?", "1+1?"])


def test_invalid_utf8_and_crlf(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(json.dumps(GOOD[0]).encode() + b"\r\n" + b'{"q": "\xff\xfe", "a": "1"}\r\n')
    with pytest.raises(BadRow, match="line 2: invalid JSON"):
        load_rows(str(path), prompt_key="q", answer_key="a")
    assert load_rows(str(path), prompt_key="q", skip_bad_rows=True)[0] == GOOD[0]


def _peak_while(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_line_over_the_cap_is_refused_without_reading_it_whole(tmp_path):
    path = tmp_path / "big.jsonl"
    big = json.dumps({"q": "x" * (2 * 1024**2), "a": "1"})  # a 2 MiB line against the 1 MiB default
    _write(path, [json.dumps(GOOD[0]), big, json.dumps(GOOD[1])])
    del big

    def refuse(**kw):
        with pytest.raises(BadRow, match=r"line 2: longer than options.max_row_bytes \((\d+) bytes\)"):
            load_rows(str(path), prompt_key="q", answer_key="a", **kw)

    # Memory follows the cap, not the line: at most the cap's worth of the line at once.
    assert _peak_while(refuse) < 1.5 * 1024**2
    assert _peak_while(lambda: refuse(max_row_bytes=4096)) < 256 * 1024
    rows = load_rows(str(path), prompt_key="q", answer_key="a", max_row_bytes=4096, skip_bad_rows=True)
    assert (rows["q"], rows.skipped) == (["0+1?", "1+1?"], 1)
    assert len(load_rows(str(path), prompt_key="q", max_row_bytes=3 * 1024**2)) == 3  # a raised cap


def test_parquet_rows_are_checked_too(tmp_path):
    import datasets

    path = tmp_path / "d.parquet"
    table = [{"q": "a", "a": "1"}, {"q": "", "a": "2"}, {"q": "c", "a": "3"}]
    datasets.Dataset.from_list(table).to_parquet(path)
    with pytest.raises(BadRow, match=r"d.parquet row 2: column 'q' is empty"):
        load_rows(str(path), prompt_key="q")
    with pytest.raises(BadRow, match="no column 'answer'"):
        load_rows(str(path), prompt_key="q", answer_key="answer")
    rows = load_rows(str(path), prompt_key="q", skip_bad_rows=True)
    assert (rows["q"], rows[1]["a"], rows.skipped) == (["a", "c"], "3", 1)


def test_bad_rows_refused_at_config_load_or_skipped_and_counted(tmp_path):
    path = _write(tmp_path / "d.jsonl", [json.dumps(r) for r in GOOD[:2]] + list(BAD_LINES)[:4]
                  + [json.dumps(GOOD[2])])
    options = {"path": str(path), "prompt_key": "q", "answer_key": "a", "reward": "exact"}
    entry = json.dumps({"env": "dataset", "options": options})
    with pytest.raises(ConfigError, match=r"tasks.mix.0: dataset .*d.jsonl line 3: invalid JSON"):
        load_config(None, ["tasks.env=mix", f"tasks.mix=[{entry}]", "sft.steps=0"])
    src = EnvTaskSource([MixEntry(env="dataset", options={**options, "skip_bad_rows": True})],
                        tokenizer=char_tokenizer())
    try:
        tok = src.tokenizer
        prompts = {tok.decode(list(src.spec(n).prompt_ids)) for n in range(9)}
        assert prompts == {f"{r['q']}\n" for r in GOOD}  # only good rows become tasks, every epoch
        assert src.metrics([]) == {"env/dataset/skipped_rows": 4.0}
        assert src.envs[0].longest_prompt() == 1 + len("0+1?\n")  # over the same good rows
    finally:
        src.close()
    with pytest.raises(ConfigError, match=r"has no rows \(2 bad rows skipped\)"):
        bad_only = _write(tmp_path / "bad.jsonl", list(BAD_LINES)[:2])
        entry = json.dumps({"env": "dataset", "options": {**options, "path": str(bad_only),
                                                          "skip_bad_rows": True}})
        load_config(None, ["tasks.env=mix", f"tasks.mix=[{entry}]", "sft.steps=0"])
    assert np.isfinite(len(prompts))


def test_the_shell_env_itself_refuses_an_unknown_family():
    # Built without the config (a test, a script): `lokup` used to become `write` tasks.
    from envs import make_env

    with pytest.raises(ValueError, match=r"unknown families \['lokup'\]"):
        make_env("shell", char_tokenizer(), families=["lokup"])
    env = make_env("shell", char_tokenizer(), families=["sum"])
    assert {env.sample_task(np.random.default_rng(i), "t").payload["family"] for i in range(8)} == {"sum"}
