"""The mismatch dial (``Recipe.logit_noise``): seeded Gaussian noise on the sampler's logits, with
behaviour records exact for the perturbed distribution, and sigma recorded in the registration."""

import numpy as np
import pytest
import torch

from mixrl_wire import pb
from mixrl_wire.recipes import RecipeError, get_recipe
from sampler_torch.engine import Engine, SamplingParams, logit_noise

SIGMA, T, TOP_P, HEAD_K = 0.8, 0.9, 0.85, 4


def test_noise_is_standard_normal_and_a_pure_function_of_seed_counter_and_id():
    z = logit_noise(np.array([7, 7, 8], np.uint64), np.array([0, 1, 0], np.uint64), 20_000)
    assert z.shape == (3, 20_000) and z.dtype == np.float32
    for row in z:
        assert abs(row.mean()) < 0.03 and abs(row.std() - 1) < 0.03
    assert np.corrcoef(z[0], z[1])[0, 1] < 0.03 and np.corrcoef(z[0], z[2])[0, 1] < 0.03
    alone = logit_noise(np.array([8], np.uint64), np.array([0], np.uint64), 20_000)
    np.testing.assert_array_equal(alone[0], z[2])  # batching does not change a row


def test_recipe_field_parses_and_refuses_bad_values():
    assert get_recipe("fp8", logit_noise="0.25").logit_noise == 0.25
    assert get_recipe("bf16").logit_noise == 0.0
    for bad in ("-0.1", "nan", "loud"):
        with pytest.raises(RecipeError, match="logit_noise"):
            get_recipe("bf16", logit_noise=bad)


def test_records_are_of_the_perturbed_distribution(hf_model_dir):
    path, _ = hf_model_dir("dense_untied_gqa4")
    clean = Engine(path, "bf16", compute_dtype="float32", max_batch=4)
    noisy = Engine(path, "bf16", compute_dtype="float32", max_batch=4, logit_noise=SIGMA)
    prompts = [[1, 2, 3], [4, 5, 6, 7], [9]]
    params = SamplingParams(temperature=T, top_p=TOP_P, head_k=HEAD_K, max_new_tokens=6, seed=5)
    outs = noisy.generate(prompts, params)
    plain = clean.generate(prompts, params)
    assert any(a.token_ids != b.token_ids or a.logprobs != b.logprobs
               for a, b in zip(outs, plain, strict=True))
    for prompt, c in zip(prompts, outs, strict=True):
        logits = clean.logits([prompt + c.token_ids])[0][len(prompt) - 1: -1]
        eps = logit_noise(np.full(len(c.token_ids), c.seed, np.uint64),
                          np.arange(len(c.token_ids), dtype=np.uint64), logits.shape[1])
        for t, x in enumerate(c.token_ids):
            logq = torch.log_softmax((logits[t] + SIGMA * torch.from_numpy(eps[t])) / T, -1)
            assert c.logprobs_full[t] == pytest.approx(float(logq[x]), abs=1e-5)
            top = torch.topk(logq, HEAD_K)
            assert c.head_ids[t] == top.indices.tolist()
            kept = torch.tensor(c.support_ids[t])
            lse = torch.logsumexp(logq[kept], 0)
            np.testing.assert_allclose(c.support_logprobs[t], (logq[kept] - lse).numpy(), atol=1e-5)
            assert c.logprobs[t] == pytest.approx(float(logq[x] - lse), abs=1e-5)
    again = noisy.generate(prompts, params)  # seeded: the same tokens again
    assert [c.token_ids for c in again] == [c.token_ids for c in outs]


def test_sigma_travels_in_the_group_recipe_and_registration(tmp_path):
    from trainer_jax.config import load_config
    from trainer_jax.samplers import sampler_command
    from trainer_jax.service import RolloutService

    cfg = load_config(None, ["service.listen=127.0.0.1:0",
                             "groups=[{name: noisy, recipe: bf16, logit_noise: 0.3}]"])
    cmd = sampler_command(cfg.groups[0], 0, address="x", model_dir=tmp_path, token_file=tmp_path / "t",
                          cache_dir=tmp_path, episode_tokens=8)
    assert cmd[cmd.index("logit_noise=0.3") - 1] == "--recipe-override"
    svc = RolloutService.from_config(cfg, token="tok-noise").start()
    try:
        req = pb.RegisterRequest(group="noisy", capacity=1, recipe=pb.Recipe(name="bf16", logit_noise=0.3))
        svc.scheduler.register(req, "peer")
        (sampler,) = svc.status()["samplers"]
        assert sampler["recipe"]["logit_noise"] == pytest.approx(0.3)
    finally:
        svc.stop(grace=0)


def test_server_backends_refuse_the_dial(tmp_path):
    from sampler_torch.backends import open_backend

    for kind in ("sglang", "vllm"):
        with pytest.raises(ValueError, match="needs --backend engine"):
            open_backend(kind, tmp_path, get_recipe("bf16", logit_noise=0.5), server_url="http://127.0.0.1:9")
