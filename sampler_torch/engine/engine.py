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

Reloads. ``load_weights(path, version)`` takes a full export or a delta on the version served
and applies it *in place* (``sampler_torch.engine.reload``): in the calling thread (any thread),
while generation goes on, it reads and verifies only what changed and stages the served
elements that differ; any failure raises and leaves the served weights untouched. The staged
writes are applied at the next step boundary of a running ``generate`` (or at once when idle):
the engine's pause, the only time generation stops. No second model is built. The KV cache is
kept across the switch (tokens after it attend to keys/values the old weights computed), as
in-flight RL samplers do; the versions record says where the switch happened.

Partial rollouts. ``partial_rollouts`` (``True`` by default; ``set_partial_rollouts``, which
``mixrl-sample`` calls with the trainer's ``train.partial_rollouts`` from its registration) says
whether a request may span a reload as above. With ``False`` a staged load waits until no
``generate`` is running: every request finishes on the weights it started with, and the next
``generate`` (the next turn of a multi-turn episode, say) starts on the new ones.

Threads. Writes happen only in the pause, under ``_lock``; ``score`` and ``logits`` run their
forwards under it too, so no forward outside ``generate`` sees half a version. ``score`` scores
the newest load: it waits for a staged one to be applied.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from convert.delta import DELTA_NAME
from sampler_torch.engine.forward import EngineForward
from sampler_torch.engine.params import Completion, SamplingParams
from sampler_torch.engine.reload import Plan, Units, plan_dir, served_at_load
from sampler_torch.engine.reload_delta import plan_delta
from sampler_torch.engine.requests import GenerateStats, Request, make_requests, record_step
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
    On that eager path for bf16 on the CPU (kernel ``auto``: attention products in float32,
    projections on the bf16 or float32 GEMM by size, ``EngineForward``) the KV cache stores
    its bf16 values in float32: the same numbers, twice the cache memory, no per-layer
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
        self._units = Units(loaded, self._forward, self.recipe, self.device)
        self._served = served_at_load(loaded, self._units, version)
        self._digest = self._served.digest
        self._version = version
        # guards _served/_version/_pending/_generating and every write into the weights
        self._lock = threading.RLock()
        self._applied = threading.Condition(self._lock)  # a staged reload was applied
        self._generate_lock = threading.Lock()  # one generate at a time
        self._reload_lock = threading.Lock()  # one reload staged at a time
        self._pending: Plan | None = None
        self._generating: int | None = None  # the generating thread's id
        #: bytes of staged changes held in memory before they spill to a temp file (None: a
        #: share of the served tensors, ``sampler_torch.engine.reload.BUDGET_SHARE``)
        self.reload_budget: int | None = None
        #: what the last reload did: ``{"version", "how", "stage_s", "pause_s", "elements",
        #: "bytes" (written), "touched_bytes" (of the tensors changed), "spilled_bytes",
        #: "read_tensors"}``
        self.last_reload: dict = {}
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
        """The forward pass of the weights being served (reloads write into its tensors)."""
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
        """The export (or delta) the version served was last loaded from."""
        return self._served.path

    def load_weights(self, model_dir: str | os.PathLike, version: int) -> None:
        """Verify ``model_dir`` (a full export, or a delta built on the version served) and
        stage it as weights ``version``; the writes land at the next step boundary (with
        ``partial_rollouts`` off: when the running ``generate`` returns), at once when idle.

        Raises ``WeightLoadError``/``RecipeError`` (and changes nothing) when the manifest or a
        delta's change digests do not match, a file is missing or malformed, the export is in
        another format, or the model differs from the one being served. A newer load replaces
        one staged and not yet applied (a delta cannot: it is built on the version before).
        """
        path = Path(model_dir)
        delta = (path / DELTA_NAME).is_file()
        with self._reload_lock:
            with self._lock:
                if self._pending is not None and delta:
                    raise WeightLoadError(f"{path}: a delta on v{self._version}, but "
                                          f"v{self._pending.served.version} is staged and not yet "
                                          "applied; load a full directory")
                dropped, self._pending = self._pending, None
            if dropped is not None:
                dropped.stage.close()
            t0 = time.perf_counter()
            plan = (plan_delta if delta else plan_dir)(self._served, self._units, path, int(version),
                                                        budget=self.reload_budget)
            plan.stage_s = time.perf_counter() - t0
            with self._lock:
                self._digest = plan.served.digest
                if self._generating is not None:
                    self._pending = plan
                else:
                    self._apply(plan)

    def _apply(self, plan: Plan) -> float:
        """Write a staged reload into the served tensors (under ``_lock``); the pause, seconds."""
        t0 = time.perf_counter()
        plan.apply(self._forward)
        pause = time.perf_counter() - t0
        served = self._served = plan.served
        self._version = served.version
        self._loaded = dataclasses.replace(self._loaded, path=served.path, manifest=served.manifest,
                                           k_scales=served.k_scales, v_scales=served.v_scales)
        st = plan.stage
        self.last_reload = {"version": served.version, "how": plan.how, "stage_s": plan.stage_s,
                            "pause_s": pause, "elements": st.elements, "bytes": st.written,
                            "touched_bytes": sum(st.touched.values()), "spilled_bytes": st.spilled,
                            "read_tensors": plan.read_tensors,
                            "lines_bytes": st.lines if st.count_lines else None}
        self._applied.notify_all()
        return pause

    def _apply_pending(self) -> float | None:
        """Apply a staged reload, if any; the pause in seconds, None when nothing was staged."""
        if self._pending is None:  # no lock on the hot path: a plain attribute read
            return None
        with self._lock:
            plan, self._pending = self._pending, None
            return None if plan is None else self._apply(plan)

    def weights_digest(self) -> str:
        """Fingerprint of the weights (and KV scales) last loaded, computed on the device at
        the first load and moved by every reload's changed elements
        (``sampler_torch.engine.fingerprint``): the version probe's no-op-reload check."""
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
        seqs = [[*map(int, p), *map(int, c)] for p, c in zip(prompts, continuations, strict=True)]
        with self._applied:  # the newest load: wait for a staged one (not inside generate itself)
            while self._pending is not None and self._generating != threading.get_ident():
                self._applied.wait()  # a staged load is applied by the generate that holds it
            all_logits = self._logits(seqs)
        out = []
        for prompt, cont, logits in zip(prompts, continuations, all_logits, strict=True):
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
        with self._lock:
            return self._logits(sequences)

    @torch.inference_mode()
    def _logits(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        loaded, fwd = self._loaded, self._forward
        out = []
        for seq in sequences:
            ids = torch.tensor([list(seq)], dtype=torch.long, device=self.device)
            cache = make_kv_cache(loaded.config, 1, len(seq), kv_torch_dtype(self.recipe),
                                  loaded.k_scales, loaded.v_scales, device=self.device)
            slots = torch.zeros(1, dtype=torch.long, device=self.device)
            out.append(fwd.logits(fwd.hidden(ids, cache=cache, slots=slots))[0].cpu())
        return out

    # ------------------------------------------------------------------ generation

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
        reqs = make_requests(prompts, params if params is not None else SamplingParams(),
                             self.config.vocab_size)
        if not reqs:
            return []
        with self._generate_lock:
            self._apply_pending()
            with self._lock:
                self._generating = threading.get_ident()
            try:
                self._run(reqs, on_step, should_stop)
            finally:
                with self._lock:
                    self._generating = None
                self._apply_pending()  # a reload staged during the last step
        return [r.out for r in reqs]

    def _run(self, reqs: list[Request], on_step: Callable[[int], None] | None,
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
        running: dict[int, Request] = {}       # slot -> request, admitted and not finished
        decoding: list[int] = []                # slots with a sampled token still to feed
        decode_slots: tuple[list[int], torch.Tensor | None] = ([], None)  # decoding's last tensor
        step = 0
        while waiting or running:
            if should_stop is not None and should_stop():
                for req in [*running.values(), *waiting]:
                    req.out.finish_reason = "stopped"
                break
            pause = self._apply_pending() if self.partial_rollouts else None
            if pause is not None:
                stats.swaps.append((step, self._version))
                stats.pauses_s.append(pause)
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
                lens = [length[s] for s in decoding]
                longest = max(lens)
                aligned = min(lens) == longest
                if decoding != decode_slots[0]:  # the slots tensor is rebuilt only when they change
                    # a copy: the cache must not follow the list if it is ever changed in place
                    decode_slots = (list(decoding), torch.tensor(decoding, device=dev))
                h = fwd.decode(torch.tensor([next_token[s] for s in decoding], device=dev),
                               torch.full((len(decoding),), longest - 1, device=dev) if aligned
                               else torch.tensor([n - 1 for n in lens], device=dev),
                               cache, decode_slots[1], length=longest,
                               read=slice(decoding[0], decoding[-1] + 1) if run else None,
                               aligned=aligned)
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
                record_step(rec, slot_order, running, version, rows=slot_order)
            elif steady:
                # The same, eagerly: ``sample_step``'s arithmetic for all-untruncated rows in
                # about half its ops (no truncation bookkeeping, no support tensors).
                ones = all(running[s].params.temperature == 1 for s in slot_order)
                order = (slice(None) if slot_order == list(range(n_slots))
                         else torch.tensor(slot_order, device=dev))
                rec = sample_untruncated(logits_parts[0], None if ones else temp[order],
                                         torch.from_numpy(u_rows).to(dev), head_k)
                record_step(rec, slot_order, running, version)
            else:
                if decode_rows is not None:
                    logits_parts.append(logits_all[torch.tensor(decode_rows, device=dev)])
                logits = torch.cat(logits_parts).float()
                counts = np.array([len(running[s].out.token_ids) for s in slot_order], np.uint64)
                logits = perturb_logits(logits, noise, seeds[slot_order], counts)  # the dial
                order = torch.tensor(slot_order, device=dev)
                rec = sample_step(logits, temp[order], top_p[order], top_k[order], head_k,
                                  torch.from_numpy(u_rows).to(dev))
                record_step(rec, slot_order, running, version)
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
