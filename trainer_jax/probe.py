"""The trainer's half of the version probe (``mixrl_wire.probe``): sample a short continuation of
a few fixed prompts from the policy being published and score it, once per publish.

Each version's continuation is drawn at temperature 1 with a key folded from the run's probe seed
and the version, so it is reproducible; the log-probabilities written are teacher-forced (the same
computation a sampler does when it scores the tokens). The previous version's continuation is
scored again by the new weights, which is what lets the trainer tell "serves the previous version"
from "serves this one" (``mixrl_wire.probe.judge``).

Runs in the thread that owns the model, between steps (like the calibration forward); over
several JAX processes it is a collective every process joins (``trainer_jax.loop.collectives``). No hooks
are active here: the forward runs unsharded-by-constraint on whatever placement the state has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mixrl_wire.probe import PreviousProbe, Probe
from trainer_jax.models import Qwen3

#: a prompt longer than this keeps its last tokens (the probe needs context, not whole tasks)
MAX_PROMPT_TOKENS = 128


def _functions(graphdef: nnx.GraphDef) -> tuple[Callable, Callable]:
    """Jitted ``next_token(state, ids, lengths, key) -> (token [B], ...)`` and
    ``score(state, ids, starts, targets) -> log p [B, n]`` (teacher-forced)."""

    def hidden(state, ids):
        model = nnx.merge(graphdef, state)
        model.remat = "none"  # forward only
        return model, model.hidden_states(ids)

    def log_softmax_rows(model, h):  # h [..., D] -> float32 log-probabilities [..., V]
        w = model.lm_head_weight().astype(model.dtype)
        logits = jnp.einsum("...d,dv->...v", h.astype(model.dtype), w,
                            preferred_element_type=jnp.float32)
        return jax.nn.log_softmax(logits, axis=-1)

    def next_token(state, ids, lengths, key):
        model, h = hidden(state, ids)
        last = jnp.take_along_axis(h, (lengths - 1)[:, None, None], axis=1)[:, 0]
        return jax.random.categorical(key, log_softmax_rows(model, last), axis=-1).astype(jnp.int32)

    def score(state, ids, starts, targets):
        # position starts-1+t predicts token t of the continuation
        model, h = hidden(state, ids)
        pos = starts[:, None] - 1 + jnp.arange(targets.shape[1])[None, :]
        rows = jnp.take_along_axis(h, pos[:, :, None], axis=1)
        lp = log_softmax_rows(model, rows)
        return jnp.take_along_axis(lp, targets[:, :, None], axis=-1)[:, :, 0]

    return jax.jit(next_token), jax.jit(score)


def _buffer(prompts: Sequence[Sequence[int]], tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Prompts left-aligned in a ``[B, max prompt + tokens]`` buffer, and their lengths. The
    padding never matters: attention is causal and only positions before each length are read."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    ids = np.zeros((len(prompts), int(lengths.max()) + tokens), np.int32)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = p
    return ids, lengths


def inputs_template(prompts: int, tokens: int) -> tuple[np.ndarray, ...]:
    """The shapes the probe's inputs are shared in between processes: (version, prompt matrix
    ``[prompts, MAX_PROMPT_TOKENS]``, prompt lengths, previous continuations ``[prompts, tokens]``)."""
    return (np.zeros((), np.int64), np.zeros((prompts, MAX_PROMPT_TOKENS), np.int32),
            np.ones(prompts, np.int32), np.zeros((prompts, tokens), np.int32))


def run_shared(model: Qwen3, inputs: tuple, tokens: int, seed: int, cache: dict
               ) -> tuple[list[list[int]], list[list[int]], list[list[float]], list[list[float]]]:
    """``run_probe`` on inputs in ``inputs_template``'s layout; also returns the prompts."""
    version, matrix, lengths, previous = inputs
    prompts = [matrix[i, :int(n)].tolist() for i, n in enumerate(lengths)]
    return (prompts, *run_probe(model, prompts, tokens, seed, int(version), np.asarray(previous),
                                cache))


class Prober:
    """``prober(model, version) -> Probe``: the publisher's per-version probe.

    ``prompts``: the fixed prompts (token ids; the last ``MAX_PROMPT_TOKENS`` of each are kept).
    ``tokens``: continuation length. ``seed``: the run's probe seed (each version folds its number
    in). ``collective(inputs)``: over several processes, announces the probe to the other
    processes and returns the inputs (``inputs_template``'s layout) they all run on.
    """

    def __init__(self, prompts: Sequence[Sequence[int]], *, tokens: int = 16, seed: int = 0,
                 collective: Callable[[tuple], tuple] | None = None):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("the probe needs at least one non-empty prompt")
        if tokens < 1:
            raise ValueError(f"probe tokens must be >= 1, got {tokens}")
        self.prompts = [[int(t) for t in p][-MAX_PROMPT_TOKENS:] for p in prompts]
        self.tokens, self.seed, self.collective = tokens, int(seed), collective
        self.previous: Probe | None = None
        self._compiled: dict = {}

    def __call__(self, model: Qwen3, version: int) -> Probe:
        prev = self.previous
        version_a, matrix, lengths, previous = inputs_template(len(self.prompts), self.tokens)
        version_a[...] = version
        for i, p in enumerate(self.prompts):
            matrix[i, :len(p)], lengths[i] = p, len(p)
        if prev is not None:
            previous[...] = np.asarray(prev.continuations, np.int32)
        inputs = (version_a, matrix, lengths, previous)
        if self.collective is not None:
            inputs = self.collective(inputs)
        _, conts, logprobs, now = run_shared(model, inputs, self.tokens, self.seed, self._compiled)
        previous_probe = None
        if prev is not None:
            previous_probe = PreviousProbe(prev.version, prev.continuations, prev.logprobs, now)
        probe = Probe(int(version), self.seed, self.prompts, conts, logprobs, previous_probe)
        self.previous = probe
        return probe


def run_probe(model: Qwen3, prompts: list[list[int]], tokens: int, seed: int, version: int,
              previous: np.ndarray, cache: dict | None = None
              ) -> tuple[list[list[int]], list[list[float]], list[list[float]]]:
    """Sample ``tokens`` tokens after each prompt (key: ``seed`` folded with ``version``) and
    return (continuations, their log p, log p of ``previous`` ``[B, tokens]`` continuations)."""
    cache = {} if cache is None else cache
    graphdef, state = nnx.split(model)
    if graphdef not in cache:
        cache[graphdef] = _functions(graphdef)
    next_token, score = cache[graphdef]
    ids, lengths = _buffer(prompts, tokens)
    key = jax.random.fold_in(jax.random.key(seed), version)
    cur = lengths.copy()
    for t in range(tokens):
        tok = np.asarray(jax.device_get(next_token(state, ids, cur, jax.random.fold_in(key, t))))
        ids[np.arange(len(prompts)), cur] = tok
        cur += 1
    conts = [ids[i, lengths[i]:lengths[i] + tokens].tolist() for i in range(len(prompts))]
    logp = np.asarray(jax.device_get(score(state, ids, lengths, np.asarray(conts, np.int32))))
    prev_ids, _ = _buffer(prompts, tokens)
    prev_ids[np.arange(len(prompts))[:, None], lengths[:, None] + np.arange(tokens)] = previous
    logp_prev = np.asarray(jax.device_get(score(state, prev_ids, lengths, previous)))
    return conts, logp.astype(float).tolist(), logp_prev.astype(float).tolist()


__all__ = ["MAX_PROMPT_TOKENS", "Prober", "inputs_template", "run_probe", "run_shared"]
