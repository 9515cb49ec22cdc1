import numpy as np
import pytest
import torch

import sampler_torch.models as torch_models
from sampler_torch.reference_sampler import sample


@pytest.fixture(scope="module")
def model(hf_model_dir):
    path, _ = hf_model_dir("dense_tied_gqa2")
    return torch_models.load_hf(path)


def test_logprobs_are_those_of_the_full_forward(model):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    out = sample(model, prompts, max_new_tokens=6, temperature=0.8, seed=3)
    for prompt, s in zip(prompts, out, strict=True):
        ids = torch.tensor([prompt + s.token_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids)[0, len(prompt) - 1:-1] / 0.8, -1)
        expected = logp[torch.arange(len(s.token_ids)), torch.tensor(s.token_ids)].numpy()
        np.testing.assert_allclose(s.logprobs, expected, atol=1e-5)
        assert s.finish_reason == "length" and len(s.token_ids) == 6


def test_seeded_and_stops(model):
    a = sample(model, [[1, 2]] * 2, max_new_tokens=20, seed=5)
    b = sample(model, [[1, 2]] * 2, max_new_tokens=20, seed=5)
    assert [s.token_ids for s in a] == [s.token_ids for s in b]
    assert a[0].token_ids != a[1].token_ids  # per-request seeds differ
    stop = a[0].token_ids[3]
    c = sample(model, [[1, 2]], max_new_tokens=20, seed=5, stop_token_ids=(stop,))
    assert c[0].finish_reason == "stop" and c[0].token_ids[-1] == stop
    assert c[0].token_ids == a[0].token_ids[: len(c[0].token_ids)]


def test_rejects_bad_requests(model):
    with pytest.raises(ValueError, match="at least one token"):
        sample(model, [[]], max_new_tokens=2)
    with pytest.raises(ValueError, match="temperature"):
        sample(model, [[1]], max_new_tokens=2, temperature=0)
