"""Calibrating the published scales with the trainer's own policy (no torch).

At each publication the trainer runs one forward pass of its policy over a few hundred tokens
of recent trajectories (``CalibrationBatch``: the newest trained samples, each its own segment of
one packed row, so positions restart per sequence as in sampling) and records, through the
model's capture points (``trainer_jax.models.capture``), the largest ``|x|`` entering every
quantized projection and the largest ``|K|`` (after q/k-norm and RoPE) and ``|V|`` of every layer.
``convert.calibration.Calibration`` carries them into the publish, which turns them into NVFP4
``input_scale = amax / (6 * 448)`` and FP8 KV ``k_scale``/``v_scale = amax / 448`` (ModelOpt's
"max" calibration) and records the calibration in each export's manifest.

Costs: one jitted forward of ``tokens`` tokens per published version (compiled once: the row
always holds exactly ``tokens`` tokens, sequences repeated when there are too few), in the
training thread, so the maxima are of exactly the weights being published. Before the first
trajectory exists (version 0) the batch is built from upcoming task prompts instead.

Projections fed the same tensor share its maximum (q/k/v, gate/up), as the fused kernels of
vLLM/SGLang need one input scale per fused GEMM. A MoE expert that no calibration token was
routed to takes the largest maximum of its layer's experts (no calibrated activation of it
would saturate).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Mapping, Sequence

import jax
import numpy as np
from flax import nnx

from convert.calibration import Calibration
from convert.qwen3_config import Qwen3Config
from trainer_jax.models import Qwen3, capture

# Capture name (relative to a layer) -> the projections whose input it is.
_INPUTS = {"self_attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "self_attn.o": ("self_attn.o_proj",),
           "mlp.gate_up": ("mlp.gate_proj", "mlp.up_proj"),
           "mlp.down": ("mlp.down_proj",)}
_EXPERTS = {"mlp.experts.gate_up": ("gate_proj", "up_proj"), "mlp.experts.down": ("down_proj",)}
_LAYER_START = "self_attn.qkv"
#: FP8 KV scales are at least this (ModelOpt's export floor; see ``convert.calibration``)
KV_FLOOR = 1.0
#: a group's registered KV dtype (``Recipe.describe``) or config value that takes e4m3 scales
FP8_KV = ("fp8_e4m3", "float8_e4m3fn")


def pack_calibration_ids(sequences: Sequence[Sequence[int]],
                         tokens: int) -> tuple[np.ndarray, np.ndarray, int]:
    """One row of exactly ``tokens`` ids: ``sequences`` in order, each its own segment
    (ids 1, 2, ...), repeated from the first when they run out, the last one cut at the end.

    Returns ``(ids [1, tokens] int32, segment_ids [1, tokens] int32, distinct sequences used)``.
    A repeated sequence gives the same activations again, so the maxima are those of the
    distinct sequences; the fixed length keeps the compiled forward the same every time.
    """
    seqs = [np.asarray(s, np.int32).reshape(-1) for s in sequences]
    seqs = [s for s in seqs if s.size]
    if not seqs:
        raise ValueError("no token ids to calibrate on")
    ids, segs, used, filled, i = [], [], set(), 0, 0
    while filled < tokens:
        s = seqs[i % len(seqs)][: tokens - filled]
        ids.append(s)
        segs.append(np.full(s.size, i + 1, np.int32))
        used.add(i % len(seqs))
        filled += s.size
        i += 1
    return np.concatenate(ids)[None], np.concatenate(segs)[None], len(used)


def module_maxima(cfg: Qwen3Config, names: Sequence[str], values: Sequence[np.ndarray]) -> tuple[
        dict[str, float], dict[int, tuple[float, float]]]:
    """The recorded ``(name, max)`` sequence of one forward -> (``{HF module: input amax}``,
    ``{layer: (K amax, V amax)}``). Records belong to the layer of the latest ``self_attn.qkv``.
    Zero maxima are left out (the module keeps the format's uncalibrated scale)."""
    inputs: dict[str, float] = {}
    kv: dict[int, list[float]] = {}
    layer = -1
    for name, value in zip(names, values, strict=True):
        value = np.asarray(value, np.float64)
        if not np.isfinite(value).all():
            raise ValueError(f"calibration: {name} of layer {layer} has a NaN/Inf maximum")
        if name == _LAYER_START:
            layer += 1
        prefix = f"model.layers.{layer}"
        if name in _INPUTS:
            for module in _INPUTS[name]:
                inputs[f"{prefix}.{module}"] = float(value)
        elif name in _EXPERTS:
            fill = float(value.max())  # experts no token reached: the layer's largest
            for e, amax in enumerate(value):
                for proj in _EXPERTS[name]:
                    inputs[f"{prefix}.mlp.experts.{e}.{proj}"] = float(amax) if amax > 0 else fill
        elif name in ("self_attn.k", "self_attn.v"):
            kv.setdefault(layer, [0.0, 0.0])[name == "self_attn.v"] = float(value)
        else:
            raise ValueError(f"calibration: unknown capture point {name!r}")
    if layer + 1 != cfg.num_hidden_layers or len(kv) != cfg.num_hidden_layers:
        raise ValueError(f"calibration recorded {layer + 1} layers, the model has "
                         f"{cfg.num_hidden_layers} (a layer ran under a transform the capture "
                         "does not see through)")
    return ({m: v for m, v in inputs.items() if v > 0},
            {i: (k, v) for i, (k, v) in sorted(kv.items())})


def _forward(graphdef: nnx.GraphDef) -> tuple[Callable, list[str]]:
    """A jitted ``f(state, ids, segment_ids) -> [max, ...]`` recording the capture points, and
    the list its names land in when it is traced."""
    names: list[str] = []

    def run(state, ids, segment_ids):
        model = nnx.merge(graphdef, state)
        model.remat = "none"  # no backward pass here, and the records must not cross a remat
        with capture.recording() as record:
            model.hidden_states(ids, segment_ids=segment_ids)
        names[:] = [name for name, _ in record]
        return [value for _, value in record]

    return jax.jit(run), names


def calibrate(model: Qwen3, ids: np.ndarray, segment_ids: np.ndarray, *, version: int,
              sequences: int, data: str = "trajectories", kv_floor: float = KV_FLOOR,
              cache: dict | None = None) -> Calibration:
    """Run ``model`` over ``ids [1, T]`` (``segment_ids``: one id per sequence) and return the
    calibration of version ``version`` (``kv_floor``: ``convert.calibration.kv_scale``;
    ``cache``: reuse compiled forwards across calls)."""
    graphdef, state = nnx.split(model)
    cache = {} if cache is None else cache
    if graphdef not in cache:
        cache[graphdef] = _forward(graphdef)
    fn, names = cache[graphdef]
    # Host arrays, not device arrays: over several processes jit places them replicated beside
    # the sharded state (a one-device array would clash with the mesh).
    values = jax.device_get(fn(state, np.asarray(ids, np.int32), np.asarray(segment_ids, np.int32)))
    inputs, kv = module_maxima(model.config, names, values)
    return Calibration(input_amax=inputs, kv_amax=kv, tokens=int(ids.size), sequences=sequences,
                       source_version=int(version), data=data, kv_floor=kv_floor)


class Calibrator:
    """What the publisher calls at each publication: ``calibrator(version) -> Calibration``.

    ``observe`` keeps the newest trained sequences (the trainer feeds every step's batch);
    ``prompts`` supplies token ids before any has been observed (task prompts, for version 0).
    Call it from the thread that owns the model (the training thread), never concurrently with
    a step. Returns ``None`` (no calibration) before any token ids exist. ``collective(ids,
    segment_ids)``: over several JAX processes the forward is a collective; this hook announces it
    to the other processes and returns the ids they all run on (``trainer_jax.loop.collectives``).
    """

    def __init__(self, model: Qwen3, tokens: int, *,
                 prompts: Callable[[], Iterable[Sequence[int]]] | None = None, keep: int = 64,
                 kv_floor: float = KV_FLOOR,
                 collective: Callable[[np.ndarray, np.ndarray], tuple] | None = None):
        if tokens <= 0:
            raise ValueError(f"calibration tokens must be > 0, got {tokens}")
        self.model, self.tokens, self.prompts, self.kv_floor = model, tokens, prompts, kv_floor
        self.collective = collective
        self.recent: collections.deque[np.ndarray] = collections.deque(maxlen=keep)
        self._compiled: dict = {}
        self.history: list[Calibration] = []

    def observe(self, sequences: Iterable[Sequence[int]]) -> None:
        """Remember ``sequences`` (token ids of whole trajectories) as the newest."""
        for s in sequences:
            self.recent.appendleft(np.asarray(s, np.int32))

    def __call__(self, version: int) -> Calibration | None:
        if self.recent:
            seqs, data = list(self.recent), "trajectories"
        elif self.prompts is not None:
            seqs, data = list(self.prompts()), "prompts"
        else:
            return None
        ids, segs, n = pack_calibration_ids(seqs, self.tokens)
        if self.collective is not None:
            ids, segs = self.collective(ids, segs)
        result = calibrate(self.model, ids, segs, version=version, sequences=n, data=data,
                           kv_floor=self.kv_floor, cache=self._compiled)
        self.history.append(result)
        return result


def fp8_kv_formats(groups: Iterable[tuple[str, str | None]]) -> list[str]:
    """The weight formats loaded with an FP8 e4m3 KV cache, from ``(weight format, KV dtype)``
    pairs (config groups, registered recipes): those exports carry calibrated K/V scales."""
    return sorted({fmt for fmt, kv in groups if kv in FP8_KV})


def group_kv_pairs(groups: Iterable, registered: Iterable[Mapping]) -> list[tuple[str, str | None]]:
    """``(weight format, KV dtype)`` of the configured groups (``SamplerGroupConfig``) and of
    registered samplers (the service's ``status()["samplers"]``)."""
    from mixrl_wire.recipes import get_recipe

    pairs = [(g.weight_format, g.kv_cache_dtype or get_recipe(g.recipe).kv_cache_dtype)
             for g in groups]
    pairs += [(s["recipe"].get("weight_format", ""), s["recipe"].get("kv_dtype"))
              for s in registered]
    return pairs


__all__ = ["FP8_KV", "KV_FLOOR", "Calibrator", "calibrate", "fp8_kv_formats", "group_kv_pairs",
           "module_maxima", "pack_calibration_ids"]
