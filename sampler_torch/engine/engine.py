"""The sampler engine: continuous batching over a slot-addressed KV cache, a precision recipe,
full per-token behaviour records, and in-flight weight reloads.

Scheduling. ``generate`` keeps up to ``max_batch`` requests in flight, one per KV-cache slot.
Each iteration (a "step") is:

1. apply a staged weight reload, if any and ``partial_rollouts`` allows (only here, between
   forwards);
2. admit waiting requests into free slots and prefill them (one batched forward, right-padded);
3. decode every other running request by one token (one batched forward);
4. sample one token for every running request from the logits of 2 and 3, and record it;
5. retire requests that hit a stop token or their length limit: their slots are free for the
   next iteration's admissions, without waiting for the rest of the batch.

Both forwards of a step use one model object, so every token's logits come from exactly one
weights version, recorded in ``Completion.versions``.

Reloads. ``load_weights(dir, version)`` verifies the export's manifest and builds a complete
new model for the recipe in the calling thread (any thread); any failure raises and leaves the
serving weights untouched. The new model is then staged and swapped in at the next step
boundary of a running ``generate`` (or at once when idle). The KV cache is kept across the swap
(tokens after it attend to keys/values the old weights computed), as in-flight RL samplers do;
the versions record says where the switch happened.

Partial rollouts. ``partial_rollouts`` (``True`` by default; ``set_partial_rollouts``, which
``mixrl-sample`` calls with the trainer's ``train.partial_rollouts`` from its registration) says
whether a request may span a reload as above. With ``False`` a staged load waits until no
``generate`` is running: every request finishes on the weights it started with, and the next
``generate`` (the next turn of a multi-turn episode, say) starts on the new ones.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from sampler_torch.engine.fingerprint import module_fingerprint
from sampler_torch.engine.forward import EngineForward
from sampler_torch.engine.params import Completion, SamplingParams, per_request
from sampler_torch.engine.sampling import (
    perturb_logits,
    sample_step,
    sample_untruncated,
    sample_untruncated_compiled,
    uniforms,
)
from sampler_torch.recipes import (
    LoadedModel,
    Recipe,
    WeightLoadError,
    get_recipe,
    kv_torch_dtype,
    load_model,
    make_kv_cache,
)
from sampler_torch.recipes.linear import matmul_kernel

#: uniforms drawn per slot at a time (``_run``)
_U_BLOCK = 64


@dataclasses.dataclass
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    seed: int
    out: Completion
    truncates: bool
    slot: int = -1


@dataclasses.dataclass
class GenerateStats:
    """What the last ``generate`` did, step by step (for tests, benchmarks and logs)."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    #: (step, request index, slot) for every admission
    admissions: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    #: (step, request index) for every retirement
    retirements: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    #: (step, version) for every weight swap applied during the call
    swaps: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    #: whether decode steps ran through the compiled static-shape step (``Engine(compile=...)``)
    compiled_decode: bool = False


class Engine:
    """``Engine(model_dir, recipe)``; ``generate(prompts, params) -> list[Completion]``.

    ``model_dir`` is an export in the recipe's weight format (a plain HF directory for ``bf16``);
    its manifest is checked when it has one (``require_manifest=True`` insists on one).
    ``recipe`` is a registered name or a ``Recipe``; ``recipe_overrides`` change its fields
    (``kv_cache_dtype="fp8_e4m3"``, ``compute_dtype="float32"``, ``attention="eager"``, ...).
    ``compile=True`` runs decode steps through the static-shape ``torch.compile``d step
    (``EngineForward.decode_step``) where the model and cache allow it: a one-off compile per
    (batch, cache length bucket), then far less per-token overhead. ``compile="auto"`` (the
    default, what ``mixrl-sample`` runs) compiles on CUDA and not on the CPU, where the eager step
    measured about as fast (``benchmarks/bench_sampler.py``: ``EngineForward.decode``, the
    eager one-token step, and ``sampling.sample_untruncated``) without a compile per shape.
    On that eager path with the CPU's float32 GEMM for bf16 (kernel ``auto``) the KV cache
    stores its bf16 values in float32: the same numbers, twice the cache memory, no per-layer
    conversion of the cache each step.

    ``device``: where the model, its KV cache, the recipe's scales and the sampling step live
    (``"cpu"``, ``"cuda"``, ``"cuda:1"``); ``sampler_torch.device.local_device`` resolves
    ``mixrl-sample --device auto``. Records leave the device once per step, as lists.
    """

    def __init__(self, model_dir: str | os.PathLike, recipe: str | Recipe = "bf16", *,
                 max_batch: int = 32, version: int = 0, device: str | torch.device = "cpu",
                 require_manifest: bool = False, compile: bool | str = "auto",
                 **recipe_overrides):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if compile not in (True, False, "auto"):
            raise ValueError(f"compile must be True, False or 'auto', got {compile!r}")
        self.recipe = get_recipe(recipe, **recipe_overrides)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.max_batch = max_batch
        self.compile = self.device.type == "cuda" if compile == "auto" else bool(compile)
        loaded = load_model(model_dir, self.recipe, device=self.device,
                            require_manifest=require_manifest)
        self._loaded: LoadedModel = loaded
        self._forward = EngineForward(loaded.model, self.recipe)
        self._digest = _digest(loaded)
        self._version = version
        self._lock = threading.Lock()  # guards _loaded/_version/_pending/_generating
        self._generate_lock = threading.Lock()  # one generate at a time
        self._pending: tuple[LoadedModel, EngineForward, int] | None = None
        self._generating = False
        #: whether a load may be applied at a step boundary of a running generate (see the
        #: module doc); False: only between generate calls
        self.partial_rollouts = True
        self.last_stats = GenerateStats()

    def set_partial_rollouts(self, enabled: bool) -> None:
        """The trainer's ``train.partial_rollouts``: whether requests may span a reload."""
        self.partial_rollouts = bool(enabled)

    # ------------------------------------------------------------------ weights

    @property
    def model(self):
        return self._loaded.model

    @property
    def forward(self) -> EngineForward:
        """The forward pass of the weights being served (rebuilt on every reload)."""
        return self._forward

    @property
    def config(self):
        return self._loaded.config

    @property
    def attention(self) -> str:
        """``sdpa`` or ``eager``: the recipe's attention with ``auto`` resolved for the device."""
        return self._forward.attention

    @property
    def matmul_kernel(self) -> str:
        """``native`` or ``emulate``: how the recipe's projections multiply on this device
        (``sampler_torch.recipes.linear.matmul_kernel``, the probe the modules were built by)."""
        return matmul_kernel(self.recipe, self.device)

    @property
    def version(self) -> int:
        return self._version

    @property
    def model_dir(self) -> Path:
        return self._loaded.path

    def load_weights(self, model_dir: str | os.PathLike, version: int) -> None:
        """Verify and load ``model_dir`` as weights ``version``; swap at the next step boundary
        (with ``partial_rollouts`` off: when the running ``generate`` returns).

        Raises ``WeightLoadError``/``RecipeError`` (and changes nothing) when the manifest does
        not match, a file is missing or malformed, the export is in another format, or the model
        architecture differs from the one being served.
        """
        loaded = load_model(model_dir, self.recipe, device=self.device, require_manifest=True)
        if loaded.config != self._loaded.config:
            raise WeightLoadError(f"{model_dir}: architecture differs from the served model "
                                  f"({loaded.config} vs {self._loaded.config})")
        staged = (loaded, EngineForward(loaded.model, self.recipe), int(version))
        digest = _digest(loaded)
        with self._lock:
            self._digest = digest
            if self._generating:
                self._pending = staged
            else:
                self._loaded, self._forward, self._version = staged
                self._pending = None

    def _apply_pending(self) -> bool:
        with self._lock:
            if self._pending is None:
                return False
            self._loaded, self._forward, self._version = self._pending
            self._pending = None
            return True

    def weights_digest(self) -> str:
        """Fingerprint of the weights (and KV scales) last loaded, computed on the device at
        load (``sampler_torch.engine.fingerprint``): the version probe's no-op-reload check."""
        with self._lock:
            return self._digest

    # ------------------------------------------------------------------ scoring

    @torch.inference_mode()
    def score(self, prompts: Sequence[Sequence[int]],
              continuations: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per continuation token t, ``log q(c_t | prompt, c_<t)`` under the newest loaded
        weights and the recipe (quantized weights, KV cache dtype and scales), at temperature 1
        before any truncation: what the version probe compares with the trainer's log p."""
        if len(prompts) != len(continuations):
            raise ValueError(f"{len(prompts)} prompts but {len(continuations)} continuations")
        with self._lock:  # the newest load, even while a generate still serves the one before
            loaded, fwd = (self._pending[:2] if self._pending is not None
                           else (self._loaded, self._forward))
        out = []
        seqs = [[*map(int, p), *map(int, c)] for p, c in zip(prompts, continuations, strict=True)]
        for prompt, cont, logits in zip(prompts, continuations,
                                        self._logits(seqs, loaded, fwd), strict=True):
            if not len(cont):
                out.append([])
                continue
            lp = torch.log_softmax(logits[len(prompt) - 1:-1].float(), dim=-1)
            idx = torch.tensor([int(t) for t in cont], dtype=torch.long)
            out.append(lp.gather(-1, idx[:, None])[:, 0].tolist())
        return out

    @torch.inference_mode()
    def logits(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """Teacher-forced float32 logits ``[len(seq), V]`` of each sequence.

        Keys and values go through a KV cache of the recipe's dtype (written, then read back
        for attention), so an FP8 KV cache's rounding shows here as it does in generation.
        """
        return self._logits(sequences, self._loaded, self._forward)

    @torch.inference_mode()
    def _logits(self, sequences: Sequence[Sequence[int]], loaded: LoadedModel,
                fwd: EngineForward) -> list[torch.Tensor]:
        out = []
        for seq in sequences:
            ids = torch.tensor([list(seq)], dtype=torch.long, device=self.device)
            cache = make_kv_cache(loaded.config, 1, len(seq), kv_torch_dtype(self.recipe),
                                  loaded.k_scales, loaded.v_scales, device=self.device)
            slots = torch.zeros(1, dtype=torch.long, device=self.device)
            out.append(fwd.logits(fwd.hidden(ids, cache=cache, slots=slots))[0].cpu())
        return out

    # ------------------------------------------------------------------ generation

    def _requests(self, prompts: Sequence[Sequence[int]],
                  params: SamplingParams | Sequence[SamplingParams]) -> list[_Request]:
        vocab = self.config.vocab_size
        plist, seeds = per_request(len(prompts), params)
        reqs = []
        for i, (prompt, p, seed) in enumerate(zip(prompts, plist, seeds, strict=True)):
            prompt = [int(t) for t in prompt]
            if not prompt:
                raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
            truncates = p.truncates(vocab)
            out = Completion(index=i, prompt_ids=prompt, seed=seed,
                             support_ids=[] if truncates else None,
                             support_logprobs=[] if truncates else None)
            reqs.append(_Request(i, prompt, p, seed, out, truncates))
        return reqs

    @torch.inference_mode()
    def generate(self, prompts: Sequence[Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 on_step: Callable[[int], None] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> list[Completion]:
        """Generate for every prompt; completions in prompt order.

        ``params``: one ``SamplingParams`` for all (request ``i`` seeded ``seed + i``) or one per
        prompt. ``on_step(step)`` runs after each step's sampling (the point where a reload
        requested from it takes effect before the next forward). ``should_stop()`` is asked before
        each step: once true, every unfinished request ends with ``finish_reason`` ``"stopped"``
        and its tokens so far (a sampler told to stop returns within one step, not one call).
        """
        reqs = self._requests(prompts, params if params is not None else SamplingParams())
        if not reqs:
            return []
        with self._generate_lock:
            self._apply_pending()
            with self._lock:
                self._generating = True
            try:
                self._run(reqs, on_step, should_stop)
            finally:
                with self._lock:
                    self._generating = False
                self._apply_pending()  # a reload staged during the last step
        return [r.out for r in reqs]

    def _run(self, reqs: list[_Request], on_step: Callable[[int], None] | None,
             should_stop: Callable[[], bool] | None = None) -> None:
        cfg, dev = self.config, self.device
        stats = self.last_stats = GenerateStats()
        n_slots = min(self.max_batch, len(reqs))
        max_len = max(len(r.prompt) + r.params.max_new_tokens for r in reqs)
        if self.compile:
            max_len = -(-max_len // 64) * 64  # length buckets: few compiled graphs
        loaded = self._loaded
        kv_dtype = kv_torch_dtype(self.recipe)
        if (not self.compile and self._forward.sgemm and kv_dtype == self._forward.dtype
                and self._forward.attention == "eager"):
            # Eager decode multiplies bf16 keys/values in float32 (EngineForward.sgemm): the
            # cache stores them in float32 (still exactly the bf16 values; twice the memory), so
            # no step converts the whole cache per layer.
            kv_dtype = torch.float32
        cache = make_kv_cache(cfg, n_slots, max_len, kv_dtype,
                              loaded.k_scales, loaded.v_scales, device=dev)
        static = self.compile and self._forward.can_compile(cache)
        stats.compiled_decode = static
        # Per-slot sampling state, indexed by slot, on the device (the sampling step runs there).
        temp = torch.ones(n_slots, device=dev)  # idle slots sample too on the compiled path: T > 0
        top_p = torch.ones(n_slots, dtype=torch.float64, device=dev)
        top_k = torch.zeros(n_slots, dtype=torch.long, device=dev)
        seeds = np.zeros(n_slots, np.uint64)
        length = [0] * n_slots                  # tokens of the slot's sequence in the cache
        next_token = [0] * n_slots              # the token to feed at the next decode
        u_block: list[list[float]] = [[] for _ in range(n_slots)]  # uniforms drawn ahead
        u_base = [0] * n_slots                  # the token index of u_block[slot][0]
        waiting = collections.deque(reqs)
        free = list(range(n_slots - 1, -1, -1))
        running: dict[int, _Request] = {}       # slot -> request, admitted and not finished
        decoding: list[int] = []                # slots with a sampled token still to feed
        step = 0
        while waiting or running:
            if should_stop is not None and should_stop():
                for req in [*running.values(), *waiting]:
                    req.out.finish_reason = "stopped"
                break
            if self.partial_rollouts and self._apply_pending():
                stats.swaps.append((step, self._version))
            fwd, version = self._forward, self._version
            # -- admit and prefill
            admitted = []
            while free and waiting:
                req = waiting.popleft()
                slot = free.pop()
                req.slot = slot
                running[slot] = req
                admitted.append(slot)
                p = req.params
                temp[slot], top_p[slot], top_k[slot] = p.temperature, p.top_p, p.top_k
                seeds[slot] = req.seed
                u_base[slot] = -_U_BLOCK  # a new request: its block is drawn at its first token
                length[slot] = len(req.prompt)
                stats.admissions.append((step, req.index, slot))
            logits_parts, slot_order, logits_all, decode_rows = [], [], None, None
            if admitted:
                longest = max(length[s] for s in admitted)
                ids = torch.zeros(len(admitted), longest, dtype=torch.long)
                for row, s in enumerate(admitted):
                    ids[row, : length[s]] = torch.tensor(running[s].prompt)
                slots_t = torch.tensor(admitted, device=dev)
                h = fwd.hidden(ids.to(dev), cache=cache, slots=slots_t)
                last = torch.tensor([length[s] - 1 for s in admitted], device=dev)
                logits_parts.append(fwd.logits(h[torch.arange(len(admitted), device=dev), last]))
                slot_order += admitted
                stats.prefill_tokens += sum(length[s] for s in admitted)
            # -- decode
            if decoding and static and fwd.can_compile(cache):
                # Every slot decodes (static shapes); idle slots write at the last position.
                tokens = torch.zeros(n_slots, dtype=torch.long)
                positions = torch.full((n_slots,), max_len - 1, dtype=torch.long)
                tokens[decoding] = torch.tensor([next_token[s] for s in decoding])
                positions[decoding] = torch.tensor([length[s] - 1 for s in decoding])
                logits_all = fwd.decode_step(tokens.to(dev), positions.to(dev), cache)
                decode_rows = decoding  # gathered from logits_all only if sampled eagerly
                slot_order += decoding
                stats.decode_tokens += len(decoding)
            elif decoding and fwd.fast_decode(cache):
                # The one-token step, told what it would otherwise sync to find out.
                run = decoding[-1] - decoding[0] == len(decoding) - 1  # sorted, distinct
                h = fwd.decode(torch.tensor([next_token[s] for s in decoding], device=dev),
                               torch.tensor([length[s] - 1 for s in decoding], device=dev),
                               cache, torch.tensor(decoding, device=dev),
                               length=max(length[s] for s in decoding),
                               read=slice(decoding[0], decoding[-1] + 1) if run else None)
                logits_parts.append(fwd.logits(h))
                slot_order += decoding
                stats.decode_tokens += len(decoding)
            elif decoding:
                slots_t = torch.tensor(decoding, device=dev)
                tokens = torch.tensor([[next_token[s]] for s in decoding], device=dev)
                positions = torch.tensor([[length[s] - 1] for s in decoding], device=dev)
                h = fwd.hidden(tokens, positions, cache=cache, slots=slots_t)
                logits_parts.append(fwd.logits(h[:, -1]))
                slot_order += decoding
                stats.decode_tokens += len(decoding)
            # -- sample
            # Each slot's uniforms come from a block drawn ahead (uniforms is elementwise, so the
            # same numbers as drawing each step, for one numpy call per _U_BLOCK tokens).
            u_list = []
            for s in slot_order:
                c = len(running[s].out.token_ids)
                if not 0 <= c - u_base[s] < _U_BLOCK:
                    u_block[s] = uniforms(np.full(_U_BLOCK, seeds[s], np.uint64),
                                          np.arange(c, c + _U_BLOCK, dtype=np.uint64)).tolist()
                    u_base[s] = c
                u_list.append(u_block[s][c - u_base[s]])
            u_rows = np.array(u_list, np.float64)
            head_k = max(running[s].params.head_k for s in slot_order)
            noise = self.recipe.logit_noise
            steady = (not admitted and head_k > 0 and not noise
                      and not any(running[s].truncates for s in slot_order))
            if steady and logits_all is not None:
                # Steady decoding without truncation: sample all slots in one compiled graph
                # (idle slots draw too, from u = 0, and are dropped).
                u = torch.zeros(n_slots, dtype=torch.float64)
                u[slot_order] = torch.from_numpy(u_rows)
                rec = sample_untruncated_compiled(logits_all.float(), temp, u.to(dev), head_k)
                self._record(rec, slot_order, running, version, rows=slot_order)
            elif steady:
                # The same, eagerly: ``sample_step``'s arithmetic for all-untruncated rows in
                # about half its ops (no truncation bookkeeping, no support tensors).
                ones = all(running[s].params.temperature == 1 for s in slot_order)
                order = (slice(None) if slot_order == list(range(n_slots))
                         else torch.tensor(slot_order, device=dev))
                rec = sample_untruncated(logits_parts[0], None if ones else temp[order],
                                         torch.from_numpy(u_rows).to(dev), head_k)
                self._record(rec, slot_order, running, version)
            else:
                if decode_rows is not None:
                    logits_parts.append(logits_all[torch.tensor(decode_rows, device=dev)])
                logits = torch.cat(logits_parts).float()
                counts = np.array([len(running[s].out.token_ids) for s in slot_order], np.uint64)
                logits = perturb_logits(logits, noise, seeds[slot_order], counts)  # the dial
                order = torch.tensor(slot_order, device=dev)
                rec = sample_step(logits, temp[order], top_p[order], top_k[order], head_k,
                                  torch.from_numpy(u_rows).to(dev))
                self._record(rec, slot_order, running, version)
            # -- retire (decode rows in slot order: a contiguous run reads the cache as a view)
            decoding = []
            for s in slot_order:
                req = running[s]
                tok = req.out.token_ids[-1]
                if tok in req.params.stop_token_ids:
                    req.out.finish_reason = "stop"
                elif len(req.out.token_ids) >= req.params.max_new_tokens:
                    req.out.finish_reason = "length"
                else:
                    next_token[s] = tok
                    length[s] += 1
                    decoding.append(s)
                    continue
                del running[s]
                free.append(s)
                stats.retirements.append((step, req.index))
            decoding.sort()
            stats.steps = step = step + 1
            if on_step is not None:
                on_step(step - 1)

    @staticmethod
    def _record(rec, slot_order: list[int], running: dict[int, _Request], version: int,
                rows: list[int] | None = None) -> None:
        """Append step records; ``rows[i]`` is the record row of ``slot_order[i]`` (default i).
        The one place records leave the device (``tolist``)."""
        if rows is not None and rows != list(range(rec.tokens.shape[0])):
            index = torch.tensor(rows, device=rec.tokens.device)
            rec = dataclasses.replace(rec, tokens=rec.tokens[index], logprob=rec.logprob[index],
                                      logprob_full=rec.logprob_full[index],
                                      head_ids=rec.head_ids[index],
                                      head_logprobs=rec.head_logprobs[index])
        tokens = rec.tokens.tolist()
        logprob = rec.logprob.tolist()
        logprob_full = logprob if rec.logprob_full is rec.logprob else rec.logprob_full.tolist()
        head_ids = rec.head_ids.tolist()
        head_lp = rec.head_logprobs.tolist()
        has_support = rec.support_ids.shape[1] > 0
        if has_support:
            sup_ids, sup_lp = rec.support_ids.tolist(), rec.support_logprobs.tolist()
            sup_len = rec.support_len.tolist()
        width = rec.head_ids.shape[1]
        for row, s in enumerate(slot_order):
            req = running[s]
            out, k = req.out, req.params.head_k
            out.token_ids.append(tokens[row])
            out.logprobs.append(logprob[row])
            out.logprobs_full.append(logprob_full[row])
            out.head_ids.append(head_ids[row] if k >= width else head_ids[row][:k])
            out.head_logprobs.append(head_lp[row] if k >= width else head_lp[row][:k])
            out.versions.append(version)
            if req.truncates:
                n = sup_len[row]
                out.support_ids.append(sup_ids[row][:n])
                out.support_logprobs.append(sup_lp[row][:n])


def _digest(loaded: LoadedModel) -> str:
    return module_fingerprint(loaded.model, (loaded.k_scales, loaded.v_scales))
