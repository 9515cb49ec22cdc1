"""Drive environment episodes with a sampler, turn by turn, and keep the behaviour record.

``run_episodes`` advances many episodes in lockstep: every turn, the contexts of the unfinished
episodes go to one ``generate`` call (the engine batches them), then each episode's environment
consumes its turn and appends observation tokens. The result per episode is the whole token
sequence (prompt, policy and environment tokens, never re-tokenized) with a loss mask, and the
per-policy-token records the trainer's objective needs, in the layout of the wire's Trajectory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence

import numpy as np

from envs.base import Episode
from mixrl_wire.reward_parts import clean as clean_reward_parts

log = logging.getLogger("mixrl.envs")
# Exception types already logged with their traceback: a model that trips the same bug every
# episode must not flood the sampler's log (each one is still counted).
_LOGGED: set[str] = set()


@dataclasses.dataclass
class EpisodeRecord:
    token_ids: np.ndarray  # int32 [T]: prompt, policy and environment tokens
    loss_mask: np.ndarray  # uint8 [T]: 1 on policy tokens
    logprobs: np.ndarray  # float32 [P]: log b(x_t)
    logprobs_full: np.ndarray  # float32 [P]: log q(x_t)
    head_ids: np.ndarray  # int32 [P, K]
    head_logprobs: np.ndarray  # float32 [P, K]
    support_indptr: np.ndarray  # int32 [P + 1] (CSR; empty rows: no truncation)
    support_ids: np.ndarray  # int32 [nnz]
    support_logprobs: np.ndarray  # float32 [nnz]
    versions: np.ndarray  # int32 [P]
    reward: float
    termination: str
    turns: int
    errors: dict[str, int] = dataclasses.field(default_factory=dict)  # Episode.note_error counts
    reward_parts: dict[str, float] = dataclasses.field(default_factory=dict)  # Episode.reward_parts

    @property
    def prompt_len(self) -> int:
        return int(np.argmax(self.loss_mask)) if self.loss_mask.any() else len(self.token_ids)


class _Builder:
    def __init__(self, episode: Episode, head_k: int):
        self.episode = episode
        self.tokens = list(episode.prompt)
        self.mask = [0] * len(self.tokens)
        self.head_k = head_k
        self.logprobs, self.logprobs_full, self.versions = [], [], []
        self.head_ids, self.head_logprobs = [], []
        self.indptr, self.support_ids, self.support_logprobs = [0], [], []
        self.reward, self.termination, self.turns, self.done = 0.0, "length", 0, False

    def add_turn(self, c) -> None:
        n = len(c.token_ids)
        self.tokens += list(c.token_ids)
        self.mask += [1] * n
        self.logprobs += list(c.logprobs)
        self.logprobs_full += list(c.logprobs_full)
        self.versions += list(c.versions)
        for t in range(n):
            ids = list(c.head_ids[t])[: self.head_k] if c.head_ids else []
            lps = list(c.head_logprobs[t])[: self.head_k] if c.head_logprobs else []
            pad = self.head_k - len(ids)
            self.head_ids.append(ids + [-1] * pad)
            self.head_logprobs.append(lps + [-np.inf] * pad)
            if c.support_ids is not None:
                self.support_ids += list(c.support_ids[t])
                self.support_logprobs += list(c.support_logprobs[t])
            self.indptr.append(len(self.support_ids))

    def add_observation(self, tokens: list[int]) -> None:
        self.tokens += tokens
        self.mask += [0] * len(tokens)

    def record(self) -> EpisodeRecord:
        p = len(self.logprobs)
        return EpisodeRecord(
            token_ids=np.asarray(self.tokens, np.int32), loss_mask=np.asarray(self.mask, np.uint8),
            logprobs=np.asarray(self.logprobs, np.float32),
            logprobs_full=np.asarray(self.logprobs_full, np.float32),
            head_ids=np.asarray(self.head_ids, np.int32).reshape(p, self.head_k),
            head_logprobs=np.asarray(self.head_logprobs, np.float32).reshape(p, self.head_k),
            support_indptr=np.asarray(self.indptr, np.int32),
            support_ids=np.asarray(self.support_ids, np.int32),
            support_logprobs=np.asarray(self.support_logprobs, np.float32),
            versions=np.asarray(self.versions, np.int32), reward=self.reward,
            termination=self.termination, turns=self.turns, errors=self.episode.errors,
            reward_parts=self._reward_parts())

    def _reward_parts(self) -> dict[str, float]:
        """The episode's named reward components, cleaned for the wire; none for an episode that
        did not end on its own (an error, a stop) or whose environment code raised here."""
        if self.termination in ("error", "stopped"):
            return {}
        try:
            return clean_reward_parts(self.episode.reward_parts)
        except Exception as e:  # noqa: BLE001 - environment code: never the end of the sampler
            _log_once(e)
            return {}


def segments(loss_mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """``(start, end, policy)`` runs of an episode's loss mask, in order: the policy's turns
    (``policy`` true) and the environment's observations between them."""
    mask = np.asarray(loss_mask).astype(bool)
    if not len(mask):
        return []
    cuts = [0, *(np.flatnonzero(np.diff(mask.astype(np.int8))) + 1).tolist(), len(mask)]
    return [(a, b, bool(mask[a])) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]


def run_episodes(generate: Callable, episodes: Sequence[Episode], params, *,
                 max_total_tokens: int | Sequence[int] = 512,
                 seeds: Sequence[int] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> list[EpisodeRecord]:
    """Run ``episodes`` to completion; ``generate(prompts, params) -> completions`` (the Engine API,
    with one ``SamplingParams`` per request).

    ``params`` is a ``SamplingParams``; each turn uses the episode's stop tokens and at most the
    tokens left in ``max_total_tokens`` (one for all, or episode i's: prompts differ in length, so
    a budget of prompt + new tokens is per episode). ``seeds[i]`` seeds episode i (turn j uses
    seed + 7919 j so turns draw independent streams). An episode out of budget ends with ``length``.
    ``should_stop()`` true (the sampler was told to stop) ends every open episode at the next turn
    boundary or before its next tool call, as ``stopped`` with reward 0, ungraded: a round of long
    episodes would otherwise run its remaining turns and sandboxed tests before the process exits.
    """
    builders = [_Builder(ep, params.head_k) for ep in episodes]
    limits = ([max_total_tokens] * len(episodes) if isinstance(max_total_tokens, int)
              else list(max_total_tokens))
    seeds = list(seeds) if seeds is not None else [params.seed or 0] * len(episodes)
    turn = 0
    while True:
        active = [i for i, b in enumerate(builders) if not b.done]
        if not active:
            break
        if should_stop is not None and should_stop():
            _stop(builders[i] for i in active)
            break
        requests, per_request = [], []
        for i in active:
            b = builders[i]
            budget = limits[i] - len(b.tokens)
            if budget <= 0:
                b.done, b.termination = True, "length"
                continue
            requests.append(i)
            per_request.append(dataclasses.replace(
                params, stop_token_ids=b.episode.stop_token_ids,
                max_new_tokens=min(params.max_new_tokens, budget), seed=seeds[i] + 7919 * turn))
        if not requests:
            break
        completions = generate([list(builders[i].tokens) for i in requests], per_request)
        for i, completion in zip(requests, completions, strict=True):
            if should_stop is not None and should_stop():
                builders[i].add_turn(completion)
                builders[i].turns += 1
                _stop([builders[i]])
                continue
            _finish_turn(builders[i], completion, limits[i])
        turn += 1
    return [b.record() for b in builders]


def _stop(builders) -> None:
    for b in builders:
        b.done, b.reward, b.termination = True, 0.0, "stopped"
        if 1 in b.mask:  # drop an observation no policy token follows (records end on the policy)
            end = len(b.mask) - b.mask[::-1].index(1)
            del b.tokens[end:], b.mask[end:]


def _finish_turn(b: _Builder, completion, max_total_tokens: int) -> None:
    b.add_turn(completion)
    b.turns += 1
    if getattr(b.episode, "wants_logprobs", False):  # an engine endpoint answers with them (verifiers)
        b.episode.turn_logprobs = [float(x) for x in completion.logprobs]
    try:
        result = b.episode.step(list(completion.token_ids))
        reward, observation = float(result.reward), [int(t) for t in result.observation]
    except Exception as e:  # noqa: BLE001 - no model output may end the sampler: end the episode
        _log_once(e)
        b.episode.note_error("exception")
        b.done, b.reward, b.termination = True, 0.0, "error"
        return
    if not math.isfinite(reward):
        b.episode.note_error("bad_reward")
        reward = 0.0
    if result.done:
        b.done, b.reward, b.termination = True, reward, result.termination
    elif len(b.tokens) + len(observation) >= max_total_tokens:
        # No room for another turn: end here, without an observation no policy token follows,
        # so the record never exceeds the budget.
        b.done, b.termination = True, "length"
    else:
        b.add_observation(observation)


def _log_once(e: Exception) -> None:
    name = type(e).__qualname__
    if name in _LOGGED:
        log.debug("episode ended by %s: %s (counted as env errors/exception)", name, e)
        return
    _LOGGED.add(name)
    log.error("episode ended by %s, reward 0 (counted as env errors/exception; logged once per "
              "type)", name, exc_info=e)
