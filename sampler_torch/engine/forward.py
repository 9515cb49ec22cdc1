"""The engine's forward pass over a recipe-loaded ``Qwen3ForCausalLM``: the same math as the
model's own ``forward``, arranged for decode throughput.

- The projections of one input are fused when they are plain ``nn.Linear`` (bf16 recipes):
  ``[q; k; v]`` and ``[gate; up]`` run as one matmul each (the outputs are the same numbers:
  a fused GEMM computes each output column exactly as the separate one does). Quantized
  projections (``QuantLinear``) and MoE blocks are called as modules, so every recipe keeps its
  own kernels.
- Matmul kernel for bf16 weights: on CPU, ``kernel="auto"`` picks per projection between the
  bf16 GEMM and the float32 GEMM of the same bf16 operands (weight upcast once at load, output
  rounded to bf16). Both are the arithmetic of a bf16 tensor-core GEMM -- bf16 x bf16 products
  are exact in float32, accumulation in float32, output rounded to bf16 -- only the summation
  order can differ. The bf16 GEMM (oneDNN) costs ~15 us a call more on this CPU but streams half
  the weight bytes: the float32 GEMM wins below ``_BF16_GEMM_MIN`` weight elements (the tiny
  test and benchmark models: 4 us vs 15 us at 48 x 48), the bf16 GEMM above (2.1x at 256 x 1536,
  2.6x at 1024 x 6144, batch 32; ``benchmarks/bench_sampler.py --size small``).
  ``kernel="native"`` uses the bf16 GEMM everywhere, ``kernel="emulate"`` the float32 one.
- RoPE tables and the attention mask are built once per forward, not once per layer; KV-cache
  reads of a contiguous run of slots are views, not gathers.

- ``decode`` serves the eager engine's one-token steps (dense fused layers, eager attention,
  a plain cache): the general loop's operations without its per-layer bookkeeping, RoPE read
  from per-cache-length tables; decode on the CPU at small sizes costs per op, so it is within
  about 10 % of the compiled step (``benchmarks/bench_sampler.py``) without compiling.
- ``decode_step`` (``Engine(compile=...)``; ``auto``, the default, uses it on CUDA, where one
  compiled graph per step replaces hundreds of kernel launches, and not on the CPU, where the
  eager step measured faster in ``benchmarks/bench_sampler.py``): one decode token for every KV-cache slot
  with static shapes -- all slots, attention over the whole cache length under the position
  mask -- compiled once with ``torch.compile`` (weights and cache are graph inputs, so a reload
  of same-shaped weights reuses the compiled graph). Available for dense models whose projections
  are all fused and whose KV cache stores the compute dtype; ``can_compile`` says.

Everything else (RMSNorm in float32 then cast, RoPE in float32, softmax in float32 for the
explicit attention, the float32 logits) follows ``sampler_torch.models.qwen3``;
``tests/sampler/test_engine_forward.py`` holds the two equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sampler_torch.models import KVCache, Qwen3ForCausalLM
from sampler_torch.models.qwen3 import MLP, rope_cos_sin
from sampler_torch.recipes import Recipe, resolve_attention, torch_dtype
from sampler_torch.recipes.kv_cache import ScaledFP8KVCache


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x))`` with the normalisation in float32, as ``models.qwen3.RMSNorm``.

    ``F.rms_norm`` of a bf16/fp16 ``x`` normalises in float32 and rounds once: the same values
    as ``F.rms_norm(x.float()).to(x.dtype)`` in two dispatches fewer (a decode step runs 13 of
    these on the small benchmark model; ``tests/sampler/test_engine_forward.py`` pins the
    equality). The weight is applied after the rounding, as the model does (``F.rms_norm``'s own
    ``weight`` would multiply before it)."""
    return weight * F.rms_norm(x, (x.shape[-1],), eps=eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE of ``x [B, heads, T, hd]`` in float32: ``x cos + rotate_half(x) sin``.

    ``rotate_half(x) = [-x2, x1]``; with ``sin_signed = [-sin1, sin2]`` (built once per forward)
    that is ``[x2, x1] * sin_signed``, the same products with the sign moved to the table.
    """
    x32 = x.float()
    swapped = x32.roll(x.shape[-1] // 2, dims=-1)  # [x2, x1]: one op instead of two slices + cat
    return (x32 * cos + swapped * sin_signed).to(x.dtype)


def _static_decode(weights: tuple, caches: tuple, tokens: torch.Tensor, positions: torch.Tensor,
                   slots: torch.Tensor, cfg: tuple) -> torch.Tensor:
    """One token for each of ``S`` slots (static shapes): float32 logits ``[S, V]``.

    ``weights = (embed, final_norm, lm_head, *per layer (ln1, qk_norm, qkv, o, ln2, gate_up,
    down))``, ``caches = (*per layer (k, v))`` of shape ``[S, K, L, hd]`` (written in place at
    ``positions``), ``cfg = (heads, kv_heads, head_dim, eps, theta, sdpa)``. The same math as
    ``EngineForward.hidden`` with the mask over all ``L`` cache positions.
    """
    nh, nk, hd, eps, theta, sdpa = cfg
    embed, final_norm, lm_head = weights[:3]
    dtype = embed.dtype
    s = tokens.shape[0]
    x = F.embedding(tokens, embed)[:, None]                       # [S, 1, D]
    pos = positions[:, None]
    cos, sin = rope_cos_sin(pos, hd, theta)
    sin = torch.cat([-sin[..., : hd // 2], sin[..., hd // 2:]], dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    length = caches[0].shape[2]
    mask = (torch.arange(length, device=tokens.device)[None, :] <= pos)[:, None, None, :]
    heads = torch.arange(nk, device=tokens.device)[None, :]
    for i in range(len(caches) // 2):
        ln1, qk_norm, w_qkv, w_o, ln2, w_gu, w_down = weights[3 + 7 * i: 10 + 7 * i]
        k_cache, v_cache = caches[2 * i], caches[2 * i + 1]
        h = _rms(x, ln1, eps)
        qkv = F.linear(h.to(w_qkv.dtype), w_qkv).to(dtype).view(s, 1, nh + 2 * nk, hd)
        qk = _rope(_rms(qkv[:, :, : nh + nk], qk_norm, eps).transpose(1, 2), cos, sin)
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, :, nh + nk:].transpose(1, 2)
        k_cache.index_put_((slots[:, None], heads, pos), k[:, :, 0].to(k_cache.dtype))
        v_cache.index_put_((slots[:, None], heads, pos), v[:, :, 0].to(v_cache.dtype))
        kk, vv = k_cache.to(dtype), v_cache.to(dtype)  # rows are slots 0..S-1
        if sdpa:
            out = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, enable_gqa=nh > nk)
        else:
            kk = kk.repeat_interleave(nh // nk, dim=1)
            vv = vv.repeat_interleave(nh // nk, dim=1)
            scores = (q.float() @ kk.float().transpose(-1, -2)) * hd ** -0.5
            scores = scores.masked_fill(~mask, torch.finfo(torch.float32).min)
            out = scores.softmax(-1).to(vv.dtype) @ vv
        out = out.transpose(1, 2).reshape(s, 1, nh * hd)
        x = x + F.linear(out.to(w_o.dtype), w_o).to(dtype)
        h = _rms(x, ln2, eps)
        gu = F.linear(h.to(w_gu.dtype), w_gu).to(dtype)
        gate, up = gu.chunk(2, dim=-1)
        x = x + F.linear((F.silu(gate) * up).to(w_down.dtype), w_down).to(dtype)
    h = _rms(x, final_norm, eps)
    return F.linear(h.to(lm_head.dtype), lm_head)[:, 0].float()


def _grouped_eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hidden: torch.Tensor,
                   groups: int, hd: int) -> torch.Tensor:
    """Explicit attention (float32 scores and softmax) of ``q [B, H, T, hd]`` over ``k, v
    [B, K, L, hd]`` with ``H = K * groups``, without repeating keys and values per query head:
    the ``groups`` query heads of a KV head are stacked as ``groups * T`` rows against it (the same
    products as ``repeat_interleave``, for a copy of the cache per layer and step less).

    ``hidden [B, 1, T, L]`` is True where a key must not be seen (the inverted mask, built once
    per forward rather than once per layer).
    """
    b, nh, t, _ = q.shape
    nk, length = k.shape[1], k.shape[2]
    qg = q.float().reshape(b, nk, groups * t, hd)
    scores = (qg @ k.float().transpose(-1, -2)) * hd ** -0.5            # [B, K, groups*T, L]
    scores = scores.view(b, nk, groups, t, length).masked_fill(
        hidden[:, :, None], torch.finfo(torch.float32).min).view(b, nk, groups * t, length)
    return (scores.softmax(-1).to(v.dtype) @ v).view(b, nh, t, -1)


def _mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``F.linear(x.to(w.dtype), w).to(x.dtype)`` without the dispatch of a conversion that
    changes nothing (decode on a small model pays per op)."""
    if w.dtype == x.dtype:
        return F.linear(x, w)
    return F.linear(x.to(w.dtype), w).to(x.dtype)


def _f32(cached: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``cached.to(dtype).float()`` in as few dispatches as the dtypes allow: a float32 cache
    holds values of the compute dtype (every write is a compute-dtype tensor), so it is used as
    it is, and a cache of the compute dtype needs only the exact upcast."""
    if cached.dtype == torch.float32:
        return cached
    return (cached if cached.dtype == dtype else cached.to(dtype)).float()


#: weight elements from which ``kernel="auto"`` on the CPU multiplies a bf16 projection with the
#: bf16 GEMM rather than the float32 one (measured at batch 32: 256 x 256 is 50 vs 60 us, 64 x 512
#: 28 vs 26 us, 64 x 192 19 vs 8 us)
_BF16_GEMM_MIN = 65536

_COMPILED: dict[str, object] = {}


def _compiled_decode():
    # One compiled function for every EngineForward: graphs are keyed by input shapes/dtypes,
    # so same-shaped weights (a reload) reuse them.
    if "fn" not in _COMPILED:
        # emulate_precision_casts: round at every cast to a low-precision dtype, as eager does
        # (inductor would otherwise keep fused bf16 intermediates in float32).
        _COMPILED["fn"] = torch.compile(_static_decode, dynamic=False,
                                        options={"emulate_precision_casts": True})
    return _COMPILED["fn"]


class _Proj:
    """One (possibly fused) projection: a weight for ``F.linear`` or the recipe's module(s)."""

    def __init__(self, modules: list[nn.Module], mm_dtype: torch.dtype,
                 small_dtype: torch.dtype | None = None):
        """``small_dtype``: the matmul dtype instead of ``mm_dtype`` for a (fused) weight of
        fewer than ``_BF16_GEMM_MIN`` elements."""
        self.sizes = [m.out_features for m in modules]
        #: (module weight, flat offset in ``weight``) of a fused projection: where an in-place
        #: reload writes each module's changed elements a second time (``EngineForward.copies``)
        self.parts: list[tuple[torch.Tensor, int]] = []
        if all(type(m) is nn.Linear for m in modules):
            if small_dtype is not None and sum(m.weight.numel() for m in modules) < _BF16_GEMM_MIN:
                mm_dtype = small_dtype
            self.weight = torch.cat([m.weight.detach() for m in modules]).to(mm_dtype)
            self.modules = None
            offset = 0
            for m in modules:
                self.parts.append((m.weight, offset))
                offset += m.weight.numel()
        else:
            self.weight = None
            self.modules = modules

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.weight is None:
            return [m(x) for m in self.modules]
        y = self.fused(x)
        return list(y.split(self.sizes, dim=-1)) if len(self.sizes) > 1 else [y]

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """All outputs side by side (only for fused projections)."""
        if self.weight is None:
            return torch.cat([m(x) for m in self.modules], dim=-1)
        return F.linear(x.to(self.weight.dtype), self.weight).to(x.dtype)


class EngineForward:
    """``forward(ids [B, T], positions [B, T], cache, slots) -> final hidden states [B, T, D]``
    and ``logits(hidden) -> float32``; built once per engine (a reload writes into the same
    tensors: ``copies``, ``rederive``)."""

    def __init__(self, model: Qwen3ForCausalLM, recipe: Recipe):
        self.model = model
        cfg = self.config = model.config
        self.dtype = torch_dtype(recipe)
        device = model.lm_head.weight.device
        use_sgemm = (self.dtype == torch.bfloat16 and device.type == "cpu"
                     and recipe.kernel in ("auto", "emulate"))
        small = torch.float32 if use_sgemm else None
        # ``emulate`` keeps every projection on the float32 GEMM; ``auto`` picks by size
        mm = torch.float32 if use_sgemm and recipe.kernel == "emulate" else self.dtype
        #: the CPU's ``auto`` kernel for bf16: small projections and the decode step's
        #: attention products (scores, probabilities @ values) multiply the bf16 operands with
        #: the float32 GEMM (see above), and the eager engine's KV cache stores float32
        self.sgemm = use_sgemm
        self.eps = cfg.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                    cfg.num_key_value_heads, cfg.head_dim)
        self._rope: dict = {}  # (length, device) -> RoPE tables of positions 0..length-1
        #: ``sdpa`` or ``eager``: the recipe's choice, ``auto`` resolved for this device
        self.attention = resolve_attention(recipe.attention, device.type)
        self.layers = []
        for layer in model.model.layers:
            attn = layer.self_attn
            mlp = layer.mlp
            dense = isinstance(mlp, MLP)
            self.layers.append(dict(
                ln1=layer.input_layernorm.weight, ln2=layer.post_attention_layernorm.weight,
                # q and k heads are normalised and rotated together: one weight row per head.
                qk_norm=torch.cat([attn.q_norm.weight.expand(self.heads, self.head_dim),
                                   attn.k_norm.weight.expand(self.kv_heads, self.head_dim)]),
                qkv=_Proj([attn.q_proj, attn.k_proj, attn.v_proj], mm, small),
                o=_Proj([attn.o_proj], mm, small),
                gate_up=_Proj([mlp.gate_proj, mlp.up_proj], mm, small) if dense else None,
                down=_Proj([mlp.down_proj], mm, small) if dense else None,
                moe=None if dense else mlp))
        self.final_norm = model.model.norm.weight
        self.embed = model.model.embed_tokens
        self.lm_head = _Proj([model.lm_head], mm, small)
        # dense layers, every projection a fused plain weight (decode_step and decode need it)
        self._fused = (all(lyr["moe"] is None and lyr["qkv"].weight is not None
                           and lyr["o"].weight is not None and lyr["gate_up"].weight is not None
                           and lyr["down"].weight is not None for lyr in self.layers)
                       and self.lm_head.weight is not None)

    def copies(self) -> dict[int, list[tuple[torch.Tensor, int]]]:
        """``{id(model tensor): [(fused copy, flat offset), ...]}``: where this object holds a
        copy of a model weight (the fused projections, in the matmul dtype): an in-place
        reload writes a changed element there too, as ``dtype(copy)(new value)``, the cast
        ``__init__`` made."""
        out: dict[int, list[tuple[torch.Tensor, int]]] = {}
        projs = [self.lm_head] + [lyr[k] for lyr in self.layers
                                  for k in ("qkv", "o", "gate_up", "down") if lyr[k] is not None]
        for proj in projs:
            for weight, offset in proj.parts:
                out.setdefault(id(weight), []).append((proj.weight, offset))
        return out

    def rederive(self) -> None:
        """Recompute, in place, what ``__init__`` derived from the norms (the q/k norm rows per
        head) after an in-place reload changed model weights."""
        for lyr, layer in zip(self.layers, self.model.model.layers, strict=True):
            attn = layer.self_attn
            lyr["qk_norm"].copy_(torch.cat([attn.q_norm.weight.expand(self.heads, self.head_dim),
                                            attn.k_norm.weight.expand(self.kv_heads, self.head_dim)]))

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor a forward reads that this object owns (fused weights) or borrows."""
        out = [p for p in self.model.parameters()] + [b for b in self.model.buffers()]
        for lyr in self.layers:
            out += [p.weight for p in (lyr["qkv"], lyr["o"], lyr["gate_up"], lyr["down"])
                    if p is not None and p.weight is not None]
        if self.lm_head.weight is not None:
            out.append(self.lm_head.weight)
        return out

    def can_compile(self, cache: KVCache) -> bool:
        """Whether ``decode_step`` applies: dense layers, fused projections, plain KV cache."""
        return self._fused and not isinstance(cache, ScaledFP8KVCache)

    @torch.inference_mode()
    def decode_step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache, *,
                    compiled: bool = True) -> torch.Tensor:
        """Logits ``[S, V]`` for one token in every one of the cache's ``S`` slots.

        Row ``s`` is slot ``s``: ``tokens[s]`` at ``positions[s]``. Slots with nothing to decode
        should get position ``L - 1`` (the last cache position): whatever they write there is
        overwritten before any query can attend to it, since a query at ``L - 1`` writes its
        own key first.
        """
        weights = [self.embed.weight, self.final_norm, self.lm_head.weight]
        for lyr in self.layers:
            weights += [lyr["ln1"], lyr["qk_norm"], lyr["qkv"].weight, lyr["o"].weight,
                        lyr["ln2"], lyr["gate_up"].weight, lyr["down"].weight]
        caches = tuple(t for pair in zip(cache.k, cache.v, strict=True) for t in pair)
        slots = torch.arange(cache.slots, device=tokens.device)
        cfg = (self.heads, self.kv_heads, self.head_dim, self.eps, float(self.config.rope_theta),
               self.attention == "sdpa")
        fn = _compiled_decode() if compiled else _static_decode
        return fn(tuple(weights), caches, tokens, positions, slots, cfg)

    def _attend(self, q, k, v, mask):
        """``mask``: the boolean attention mask for sdpa, its inverse for the eager attention."""
        groups = self.heads // self.kv_heads
        if self.attention == "sdpa":
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups > 1)
        return _grouped_eager(q, k, v, mask, groups, self.head_dim)

    def fast_decode(self, cache: KVCache | None) -> bool:
        """Whether ``decode`` serves a one-token step: eager attention, dense fused layers and
        a plain cache (whose ``write``/``read`` it inlines)."""
        return (cache is not None and self.attention == "eager" and type(cache) is KVCache
                and self._fused)

    def _rope_at(self, positions: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rope_cos_sin(positions)`` (sin with rotate_half's signs) read from tables of
        positions ``0..length-1`` built once per cache length (the same elementwise values),
        instead of a dozen ops per forward."""
        tables = self._rope_tables(length, positions.device)
        return tables[0][positions], tables[1][positions]

    def _rope_tables(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, sin with rotate_half's signs)`` of positions ``0..length-1``, ``[length, hd]``."""
        key = (length, device)
        tables = self._rope.get(key)
        if tables is None:
            hd = self.head_dim
            cos, sin = rope_cos_sin(torch.arange(length, device=device), hd,
                                    self.config.rope_theta)
            tables = (cos, torch.cat([-sin[..., : hd // 2], sin[..., hd // 2:]], dim=-1))
            self._rope = {key: tables}  # one cache length at a time (a new dict: no reader races)
        return tables

    @torch.inference_mode()
    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
               cache: KVCache | None = None, slots: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states; with a cache, rows ``slots`` at ``positions`` (default 0..T-1).

        Keys at positions past a query's own are masked, so padding and stale cache entries are
        never attended (``sampler_torch.models.kv_cache``).
        """
        b, t = input_ids.shape
        dev = input_ids.device
        if t == 1 and positions is not None and self.fast_decode(cache):
            return self.decode(input_ids[:, 0], positions[:, 0], cache, slots)[:, None]
        if positions is None:
            positions = torch.arange(t, device=dev).expand(b, t)
        hd, nh, nk = self.head_dim, self.heads, self.kv_heads
        if cache is not None and int(positions.max()) < cache.max_len:
            cos, sin = self._rope_at(positions, cache.max_len)
        else:
            cos, sin = rope_cos_sin(positions, hd, self.config.rope_theta)
            sin = torch.cat([-sin[..., : hd // 2], sin[..., hd // 2:]], dim=-1)
        cos, sin = cos[:, None], sin[:, None]
        read_slots: torch.Tensor | slice | None = slots
        if cache is None:
            key_pos = positions
        else:
            length = int(positions.max()) + 1
            key_pos = torch.arange(length, device=dev).expand(b, length)
            first = int(slots[0])
            if b == 1 or bool((slots == torch.arange(first, first + b, device=dev)).all()):
                read_slots = slice(first, first + b)  # a view instead of a gather
        if self.attention == "sdpa":
            mask = key_pos[:, None, None, :] <= positions[:, None, :, None]
        else:  # the eager attention fills where a key is hidden
            mask = key_pos[:, None, None, :] > positions[:, None, :, None]
        if cache is not None:
            if length > cache.max_len:  # checked once here: layers store unchecked
                raise ValueError(f"position {length - 1} is past the cache length {cache.max_len}")
            store = cache.store if type(cache).write is KVCache.write else cache.write
        x = self.embed(input_ids)
        for i, lyr in enumerate(self.layers):
            h = _rms(x, lyr["ln1"], self.eps)
            qkv = lyr["qkv"].fused(h).view(b, t, nh + 2 * nk, hd)
            qk = _rms(qkv[:, :, : nh + nk], lyr["qk_norm"], self.eps).transpose(1, 2)
            qk = _rope(qk, cos, sin)
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[:, :, nh + nk:].transpose(1, 2)
            if cache is not None:
                store(i, slots, positions, k, v)
                k, v = cache.read(i, read_slots, length, q.dtype)
            out = self._attend(q, k, v, mask)
            x = x + lyr["o"](out.transpose(1, 2).reshape(b, t, nh * hd))[0]
            h = _rms(x, lyr["ln2"], self.eps)
            if lyr["moe"] is not None:
                x = x + lyr["moe"](h)
            else:
                gate, up = lyr["gate_up"](h)
                x = x + lyr["down"](F.silu(gate) * up)[0]
        return _rms(x, self.final_norm, self.eps)

    @torch.inference_mode()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
               slots: torch.Tensor, *, length: int | None = None,
               read: slice | None = None, aligned: bool = False) -> torch.Tensor:
        """``hidden`` for one token per row (``tokens, positions, slots [B]``) -> ``[B, D]``;
        only where ``fast_decode(cache)``. ``length`` (``max(positions) + 1``) and ``read``
        (``slots`` as a slice when they are a contiguous run) spare the device syncs of
        computing them when the caller knows them; ``aligned=True`` says every position is
        ``length - 1`` (no key to hide: the mask is skipped, the same numbers in fewer ops).

        The same operations on the same values as ``hidden``'s loop, in fewer of them: decode
        on a small model is bound by per-op overhead, not arithmetic. One product differs in
        kind, not in value: with ``sgemm`` (bf16 on the CPU, kernel ``auto``) probabilities @
        values is the float32 GEMM of the bf16 operands, as the projections are (exact
        products, float32 sums, rounded to bf16; about twice as fast as the CPU's bf16 bmm at
        decode shapes), and a float32 cache (the eager engine's, holding bf16 values) is read
        without conversion. ``tests/sampler/test_engine_forward.py`` holds the two paths equal.
        Rows stay 2-D (``F.linear`` is one GEMM call, no folding of a length-1 axis), heads
        need no transposes at T = 1, keys and values are stored by plain indexing (through a
        cache view, converting as they are copied, when ``aligned`` and the slots are a
        contiguous run), and the mask is one row per sequence (none when ``aligned``).
        """
        b = tokens.shape[0]
        dev = tokens.device
        hd, nh, nk, eps = self.head_dim, self.heads, self.kv_heads, self.eps
        groups = nh // nk
        if length is None:
            length = int(positions.max()) + 1
        if length > cache.max_len:
            raise ValueError(f"position {length - 1} is past the cache length {cache.max_len}")
        if read is None:
            first = int(slots[0])
            read = slots
            if b == 1 or bool((slots == torch.arange(first, first + b, device=dev)).all()):
                read = slice(first, first + b)  # a view instead of a gather
        if aligned:  # one position for every row: its table row, broadcast (no gather)
            cos, sin = (t[length - 1] for t in self._rope_tables(cache.max_len, dev))  # [hd]
        else:
            cos, sin = self._rope_at(positions, cache.max_len)              # [B, hd]
            cos, sin = cos[:, None], sin[:, None]                           # per head
        hide = (None if aligned else
                (torch.arange(length, device=dev) > positions[:, None])[:, None, None])  # [B,1,1,L]
        fill = torch.finfo(torch.float32).min
        scale = hd ** -0.5
        # every row at position ``length - 1`` in a contiguous run of slots: keys and values are
        # stored through a view (``cache[read, :, at] = ...``) instead of an index_put of
        # converted copies
        at = length - 1 if aligned and isinstance(read, slice) else None
        x = F.embedding(tokens, self.embed.weight)
        dtype = x.dtype
        for i, lyr in enumerate(self.layers):
            h = _rms(x, lyr["ln1"], eps)
            qkv = _mm(h, lyr["qkv"].weight).view(b, nh + 2 * nk, hd)
            qk = _rope(_rms(qkv[:, : nh + nk], lyr["qk_norm"], eps), cos, sin)
            k_cache, v_cache = cache.k[i], cache.v[i]
            if at is not None:  # one strided copy (with the dtype conversion) per tensor
                k_cache[read, :, at] = qk[:, nh:]
                v_cache[read, :, at] = qkv[:, nh + nk:]
            else:
                k_cache[slots, :, positions] = qk[:, nh:].to(k_cache.dtype)
                v_cache[slots, :, positions] = qkv[:, nh + nk:].to(v_cache.dtype)
            kk = _f32(k_cache[read, :, :length], dtype)
            vv = v_cache[read, :, :length]
            # _grouped_eager at T = 1: the query heads of a KV head as rows against it.
            q = qk[:, :nh].float().view(b, nk, groups, hd)
            scores = (q @ kk.transpose(-1, -2)) * scale                     # [B, K, groups, L]
            if hide is not None:
                scores = scores.masked_fill(hide, fill)
            probs = scores.softmax(-1).to(dtype)
            if self.sgemm:  # bf16 x bf16 products, float32 sums, rounded: as the projections
                out = (probs.float() @ _f32(vv, dtype)).to(dtype)
            else:
                out = probs @ vv.to(dtype)
            x = x + _mm(out.view(b, nh * hd), lyr["o"].weight)
            gate, up = _mm(_rms(x, lyr["ln2"], eps), lyr["gate_up"].weight).chunk(2, dim=-1)
            x = x + _mm(F.silu(gate) * up, lyr["down"].weight)
        return _rms(x, self.final_norm, self.eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)[0].float()
