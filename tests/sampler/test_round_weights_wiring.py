"""The round_weights dial from a group's config to the sampler: the recipe override a spawned sampler
gets, the recipe's parsing and refusals, the registration the service records, and the refusal of
backends that cannot round (vLLM, SGLang)."""

import pytest

from mixrl_wire import pb
from mixrl_wire.recipes import RecipeError, get_recipe
from sampler_torch.backends import open_backend
from trainer_jax.config import load_config
from trainer_jax.samplers import sampler_command
from trainer_jax.service import RolloutService


def test_round_weights_reaches_the_sampler_and_the_service(tmp_path):
    assert get_recipe("bf16", round_weights="4/32").round_weights == (4, 32)
    assert get_recipe("bf16").round_weights is None
    for bad in ("4", "9/32", "4/0", "x/y"):
        with pytest.raises(RecipeError, match="round_weights"):
            get_recipe("bf16", round_weights=bad)
    with pytest.raises(RecipeError, match="round_weights needs float weights"):
        get_recipe("fp8", round_weights="4/32")
    cfg = load_config(None, ["service.listen=127.0.0.1:0",
                             "groups=[{name: r4, recipe: bf16, round_weights: {bits: 4, block_size: 32}}]"])
    cmd = sampler_command(cfg.groups[0], 0, address="x", model_dir=tmp_path, token_file=tmp_path / "t",
                          cache_dir=tmp_path, episode_tokens=8)
    assert cmd[cmd.index("round_weights=4/32") - 1] == "--recipe-override"
    assert pb.Recipe(name="bf16", round_weights=None).HasField("round_weights") is False
    svc = RolloutService.from_config(cfg, token="tok").start()
    try:
        req = pb.RegisterRequest(group="r4", capacity=1, recipe=pb.Recipe(
            name="bf16", round_weights=dict(bits=4, block_size=32)))
        svc.scheduler.register(req, "peer")
        (s,) = svc.status()["samplers"]
        assert s["recipe"]["round_weights"] == {"bits": 4, "block_size": 32}
    finally:
        svc.stop(grace=0)
    for kind in ("sglang", "vllm"):
        with pytest.raises(ValueError, match="needs --backend engine"):
            open_backend(kind, tmp_path, get_recipe("bf16", round_weights="4/32"), server_url="http://127.0.0.1:9")
