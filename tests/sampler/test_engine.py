"""The engine's records, sampling statistics, seeds and continuous batching (fp32 mode, so the
engine's logits can be recomputed exactly by a teacher-forced forward)."""

import numpy as np
import pytest
import torch
from scipy import stats

from sampler_torch.engine import Engine, SamplingParams, sample_step, uniforms
from sampler_torch.models import KVCache

T, TOP_P, TOP_K, HEAD_K = 0.7, 0.8, 12, 5


@pytest.fixture(scope="module")
def engine(hf_model_dir):
    path, _ = hf_model_dir("dense_untied_gqa4")
    return Engine(path, "bf16", compute_dtype="float32", max_batch=4)


def _kept(logq: torch.Tensor, top_p: float, top_k: int) -> list[int]:
    """The kept set, computed independently: sorted by probability, prefix rule of SGLang."""
    probs = logq.double().exp().numpy()
    order = np.argsort(-probs, kind="stable")
    kept, before = [], 0.0
    for rank, tok in enumerate(order):
        if (top_k > 0 and rank >= top_k) or before > top_p:
            break
        kept.append(int(tok))
        before += probs[tok]
    return kept


def test_records_match_a_full_softmax(engine):
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11], [12, 13, 14]]
    params = SamplingParams(temperature=T, top_p=TOP_P, top_k=TOP_K, head_k=HEAD_K,
                            max_new_tokens=6, seed=11)
    outs = engine.generate(prompts, params)
    for prompt, c in zip(prompts, outs, strict=True):
        assert len(c.token_ids) == len(c.logprobs) == len(c.logprobs_full) == len(c.head_ids) \
            == len(c.support_ids) == len(c.versions) == 6
        logits = engine.logits([prompt + c.token_ids])[0][len(prompt) - 1: -1]
        for t, x in enumerate(c.token_ids):
            logq = torch.log_softmax(logits[t] / T, -1)
            assert c.logprobs_full[t] == pytest.approx(float(logq[x]), abs=1e-5)
            top = torch.topk(logq, HEAD_K)
            assert c.head_ids[t] == top.indices.tolist()
            np.testing.assert_allclose(c.head_logprobs[t], top.values.numpy(), atol=1e-5)
            kept = _kept(logq, TOP_P, TOP_K)
            assert c.support_ids[t] == kept
            assert x in c.support_ids[t]
            lse = torch.logsumexp(logq[kept], 0)
            np.testing.assert_allclose(c.support_logprobs[t], (logq[kept] - lse).numpy(), atol=1e-5)
            assert c.logprobs[t] == pytest.approx(float(logq[x] - lse), abs=1e-5)
            assert np.exp(c.support_logprobs[t]).sum() == pytest.approx(1.0, abs=1e-5)


def test_no_truncation_means_no_support(engine):
    outs = engine.generate([[1, 2, 3]], SamplingParams(temperature=1.3, max_new_tokens=5, seed=2))
    c = outs[0]
    assert c.support_ids is None and c.support_logprobs is None
    np.testing.assert_allclose(c.logprobs, c.logprobs_full, atol=0)
    # top_k >= vocab is no truncation either
    c = engine.generate([[1]], SamplingParams(top_k=10_000, max_new_tokens=2, seed=2))[0]
    assert c.support_ids is None


def test_greedy_is_a_one_token_support(engine):
    c = engine.generate([[5, 6]], SamplingParams(temperature=0, max_new_tokens=4, seed=0))[0]
    logits = engine.logits([[5, 6] + c.token_ids])[0][1:-1]
    assert c.token_ids == logits.argmax(-1).tolist()
    assert c.logprobs == [0.0] * 4
    assert c.support_ids == [[x] for x in c.token_ids]


def _chi_square_p(tokens: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the token counts against ``probs``, pooling cells expecting fewer than 5."""
    n = len(tokens)
    counts = np.bincount(tokens, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "sampled a token of probability 0"
    big = probs * n >= 5
    observed = list(counts[big]) + [counts[~big].sum()]
    expected = list(probs[big] * n) + [probs[~big].sum() * n]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    expected = np.array(expected) * sum(observed) / sum(expected)
    return stats.chisquare(observed, expected).pvalue


def _support_probs(ids: list[int], logprobs: list[float], vocab: int) -> np.ndarray:
    probs = np.zeros(vocab)
    probs[ids] = np.exp(logprobs)
    return probs


@pytest.mark.parametrize("top_p,top_k", [(1.0, 0), (0.9, 0), (1.0, 7), (0.6, 20)])
def test_sampling_frequencies_match_recorded_probabilities(top_p, top_k):
    gen = torch.Generator().manual_seed(0)
    vocab, n = 40, 20_000
    row = torch.randn(1, vocab, generator=gen) * 2
    logits = row.expand(n, vocab)
    rec = sample_step(logits, torch.full((n,), 0.9), torch.full((n,), top_p, dtype=torch.float64),
                      torch.full((n,), top_k), 0,
                      torch.from_numpy(uniforms(np.arange(n), np.zeros(n))))
    tokens, lp = rec.tokens.numpy(), rec.logprob.numpy()
    if top_p < 1 or top_k:
        n_keep = int(rec.support_len[0])
        probs = _support_probs(rec.support_ids[0, :n_keep].tolist(),
                               rec.support_logprobs[0, :n_keep].tolist(), vocab)
        assert 0 < n_keep < vocab
    else:
        probs = torch.softmax(row[0] / 0.9, -1).double().numpy()
        assert rec.support_ids.shape[1] == 0
    # Every row has the same distribution: each token's recorded probability is its b.
    np.testing.assert_allclose(np.exp(lp), probs[tokens], rtol=1e-5)
    assert _chi_square_p(tokens, probs) > 1e-3


def test_engine_frequencies_match_recorded_probabilities(hf_model_dir):
    path, _ = hf_model_dir("dense_tied_gqa2")
    eng = Engine(path, "bf16", compute_dtype="float32", max_batch=128)
    outs = eng.generate([[3, 4]] * 1500, SamplingParams(temperature=1.5, top_p=0.95,
                                                       max_new_tokens=1, seed=123))
    tokens = np.array([c.token_ids[0] for c in outs])
    probs = _support_probs(outs[0].support_ids[0], outs[0].support_logprobs[0],
                           eng.config.vocab_size)
    np.testing.assert_allclose(np.exp([c.logprobs[0] for c in outs]), probs[tokens], rtol=1e-4)
    assert _chi_square_p(tokens, probs) > 1e-3


def test_same_seed_same_tokens_regardless_of_batching(engine):
    p = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=8, seed=7)
    a = engine.generate([[1, 2], [3, 4], [5]], p)
    b = engine.generate([[1, 2], [3, 4], [5]], p)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert a[0].token_ids != engine.generate([[1, 2]], SamplingParams(
        temperature=1.0, top_p=0.9, max_new_tokens=8, seed=8))[0].token_ids
    # Request 1 alone, with the seed it had in the batch: the same tokens.
    alone = engine.generate([[3, 4]], [SamplingParams(temperature=1.0, top_p=0.9,
                                                      max_new_tokens=8, seed=8)])[0]
    assert alone.token_ids == a[1].token_ids and a[1].seed == 8


def test_continuous_batching_refills_a_finished_slot_at_once(hf_model_dir):
    path, _ = hf_model_dir("dense_untied_gqa4")
    eng = Engine(path, "bf16", compute_dtype="float32", max_batch=2)
    lengths = [2, 9, 3, 4]
    params = [SamplingParams(max_new_tokens=n, seed=100 + i) for i, n in enumerate(lengths)]
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10]]
    outs = eng.generate(prompts, params)
    st = eng.last_stats
    assert [len(c.token_ids) for c in outs] == lengths
    admitted = {req: (step, slot) for step, req, slot in st.admissions}
    retired = dict((req, step) for step, req in st.retirements)
    # Request 0 finishes at step 1; request 2 takes its slot at step 2 while request 1 runs on.
    assert retired[0] == 1 and admitted[2] == (2, admitted[0][1])
    assert admitted[3][0] == retired[2] + 1 and retired[1] > admitted[3][0]
    assert st.steps == 9 and st.decode_tokens + 4 == sum(lengths)
    # Batching changes nothing: each request alone gives the same tokens and records.
    for prompt, p, c in zip(prompts, params, outs, strict=True):
        alone = eng.generate([prompt], [p])[0]
        assert alone.token_ids == c.token_ids
        np.testing.assert_allclose(alone.logprobs, c.logprobs, atol=1e-5)


def test_stop_tokens_end_a_request(engine):
    free = engine.generate([[1, 2]], SamplingParams(max_new_tokens=12, seed=5))[0]
    stop = free.token_ids[4]
    first = free.token_ids.index(stop)
    c = engine.generate([[1, 2]], SamplingParams(max_new_tokens=12, seed=5,
                                                 stop_token_ids=(stop,)))[0]
    assert c.finish_reason == "stop" and c.token_ids == free.token_ids[: first + 1]
    assert free.finish_reason == "length"


def test_bad_requests_are_refused(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[10**6]], SamplingParams())
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="SamplingParams"):
        engine.generate([[1], [2]], [SamplingParams()])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_untruncated_sampler_records_what_sample_step_does(temperature):
    """The eager engine's steady-state sampler (rows without truncation): every record equal to
    ``sample_step``'s, at temperature 1 (where it skips the division) and below."""
    from sampler_torch.engine.sampling import sample_untruncated

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 300, generator=gen) * 3
    u = torch.rand(7, dtype=torch.float64, generator=gen)
    u[0] = 0.0
    u[1] = 1.0 - 2 ** -53
    temp = torch.full((7,), temperature)
    ref = sample_step(logits, temp, torch.ones(7, dtype=torch.float64),
                      torch.zeros(7, dtype=torch.long), HEAD_K, u)
    got = sample_untruncated(logits, None if temperature == 1 else temp, u, HEAD_K)
    for field in ("tokens", "logprob", "logprob_full", "head_ids", "head_logprobs",
                  "support_len"):
        assert torch.equal(getattr(got, field), getattr(ref, field)), field
    assert got.support_ids.shape == ref.support_ids.shape == (7, 0)
    assert int(got.tokens[1]) == int(ref.tokens[1]) and 0 <= int(got.tokens[1]) < 300


def test_the_default_bf16_engine_scores_what_it_samples(hf_model_dir):
    """The engine as mixrl-sample builds it on the CPU (bf16, eager one-token decode, keys and
    values kept in a float32 cache): its records agree with the teacher-forced logits of the
    general forward in the recipe's bf16 cache (bf16 roundings apart: decode and prefill GEMMs
    sum in different orders)."""
    path, _ = hf_model_dir("dense_untied_gqa4")
    eng = Engine(path, "bf16", max_batch=3)
    assert not eng.compile and eng.forward.sgemm  # the float32 cache's conditions
    assert eng.forward.fast_decode(KVCache(0, 0, 0, 0, 0))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
    outs = eng.generate(prompts, SamplingParams(max_new_tokens=6, head_k=HEAD_K, seed=3))
    agree = 0
    for prompt, c in zip(prompts, outs, strict=True):
        logits = eng.logits([prompt + c.token_ids])[0][len(prompt) - 1: -1]
        logq = torch.log_softmax(logits, -1)
        got = torch.tensor(c.logprobs_full)
        np.testing.assert_allclose(got, logq.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0],
                                   atol=0.05)
        agree += sum(h == logq[t].topk(HEAD_K).indices.tolist()
                     for t, h in enumerate(c.head_ids))
    assert agree >= 0.75 * 6 * len(prompts), agree


def test_should_stop_ends_every_request_within_one_step(engine):
    """A sampler told to stop: the engine asks before each step and ends every unfinished request
    (running or still waiting for a slot) with its tokens so far, ``finish_reason`` ``stopped``."""
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9], [10], [11, 12]]  # 6 requests, 4 slots
    steps: list[int] = []
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=50, seed=3, stop_token_ids=()),
                           on_step=steps.append, should_stop=lambda: len(steps) >= 3)
    assert len(steps) == 3
    assert [c.finish_reason for c in outs] == ["stopped"] * 6
    assert [len(c.token_ids) for c in outs] == [3, 3, 3, 3, 0, 0]  # the waiting two never started
    # The tokens it did sample are the ones an uninterrupted call samples (same seeds).
    full = engine.generate(prompts[:4], SamplingParams(max_new_tokens=3, seed=3, stop_token_ids=()))
    assert [c.token_ids for c in outs[:4]] == [c.token_ids for c in full]
    # Never told: the call runs to its lengths.
    outs = engine.generate(prompts[:2], SamplingParams(max_new_tokens=5, seed=3, stop_token_ids=()),
                           should_stop=lambda: False)
    assert [(c.finish_reason, len(c.token_ids)) for c in outs] == [("length", 5)] * 2
