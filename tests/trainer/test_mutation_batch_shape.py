"""batch_shape's behaviour its cosmic-ray mutants showed untested (issue 46; docs/testing.md): where
a task environment that cannot be built is named, under ``tasks`` for a single ``tasks.env`` and
under ``tasks.mix`` for an entry of a mix, whatever the environment's name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from trainer_jax.config import ConfigError, load_config

ROOT = Path(__file__).parent.parent.parent
_spec = importlib.util.spec_from_file_location("chat_dir", ROOT / "tests" / "envs" / "chat_dir.py")
chat_dir = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat_dir)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A model's own tokenizer (a byte-level BPE with a chat template, trained here): the
    character-level tasks refuse it."""
    from convert.tokenizer import load_tokenizer

    return load_tokenizer(chat_dir.make_model_dir(tmp_path_factory.mktemp("model")))


# names on both sides of "mix" in sort order: the option path must not depend on it
@pytest.mark.parametrize("env", ["arithmetic", "reverse"])
def test_an_environment_that_cannot_be_built_is_named_where_the_config_sets_it(tokenizer, env):
    from trainer_jax.batch_shape import longest_prompts

    single = load_config(None, [f"tasks.env={env}", "tasks.mix=[]"])
    with pytest.raises(ConfigError, match=rf"^tasks \({env}\): {env}: needs a tokenizer with <bos>"):
        longest_prompts(single, tokenizer)
    mix = load_config(None, ["tasks.env=mix", f"tasks.mix=[{{env: {env}}}]"])
    with pytest.raises(ConfigError, match=rf"^tasks\.mix \({env}\): {env}: needs a tokenizer with <bos>"):
        longest_prompts(mix, tokenizer)
