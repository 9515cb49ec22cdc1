"""``mesh.context_attention`` (issue 33): ``ring`` by default, ``all_gather`` on request, anything
else one config error naming the key; the choice reaches the learner's parallel context (the
two forms themselves are compared with the one-device step in ``cases/case_context.py`` and
``cases/case_ring.py``)."""

from __future__ import annotations

import pytest

from trainer_jax.config import ConfigError, load_config


def test_default_is_ring_and_all_gather_is_accepted():
    assert load_config(None).mesh.context_attention == "ring"
    assert load_config(None, ["mesh.context_attention=all_gather"]).mesh.context_attention == "all_gather"


def test_an_unknown_form_is_one_config_error_naming_the_key():
    with pytest.raises(ConfigError, match=r"mesh\.context_attention: .*'ring' or 'all_gather'.*'ragged'"):
        load_config(None, ["mesh.context_attention=ragged"])


def test_the_choice_reaches_the_learner():
    from convert.qwen3_config import Qwen3Config
    from trainer_jax.learner import Learner
    from trainer_jax.models import init_model

    cfg = load_config(None, ["mesh.context_attention=all_gather"])
    tiny = Qwen3Config(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    learner = Learner(init_model(tiny, seed=0), cfg.optimizer, cfg.objective,
                      context_attention=cfg.mesh.context_attention)
    assert learner.context.context_attention == "all_gather"
