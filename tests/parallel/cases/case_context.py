"""Context parallelism (issue 33): a step with each row's sequence split over ``context`` equals
the single-device step (fp32, 1e-5 relative), MoE on (context 4 x fsdp 2) and (context 2 x
tensor 2 x data 2), the dense model on the second; and the compiled step moves no row's hidden
states over the context axis.

Attention in both forms (``mesh.context_attention``): ``ring`` (the default, ``parallel/ring.py``)
passes K/V blocks and their gradients round the axis with collective-permutes, and the test
finds no all-gather of K/V at all; ``all_gather`` gathers each layer's K/V heads,
``[rows, T, K_local, hd]``, and the test names that gather. Neither has an all-gather of hidden
states ``[rows, T, D]`` (residual, MLP, attention output) or of the ``[N, D]`` policy tokens (the
loss's gather runs as a ppermute ring).
"""

from __future__ import annotations

import dataclasses
import re

import pytest
from case_train_step import OBJ, OPT, _compare, _run
from mesh_common import MOE, packed_batch

from trainer_jax.learner import Learner
from trainer_jax.models import init_model
from trainer_jax.parallel import make_mesh
from trainer_jax.parallel.sequence import zigzag_order

# 2 x context 4 chunks of 6 (sequences cross chunk and device boundaries); no weight dimension
# is a multiple of 48 or equal to the 72 token slots, so the HLO check below can tell them apart.
ROW_LEN, TOKENS = 48, 72
DENSE = dataclasses.replace(MOE, mlp_only_layers=[0, 1])
MESHES = {"context4_fsdp2": dict(context=4, fsdp=2, data=1),
          "context2_tensor2_data2": dict(context=2, tensor=2, data=2)}


@pytest.fixture(scope="module")
def batch():
    return packed_batch(rows=8, row_len=ROW_LEN, max_tokens=TOKENS)


def test_zigzag_layout_balances_the_causal_work():
    order = zigzag_order(16, 4)
    assert sorted(order) == list(range(16))
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    work = [sum(int(p) + 1 for p in dev) for dev in order.reshape(4, 4)]  # keys each device's queries see
    assert len(set(work)) == 1


@pytest.fixture(scope="module")
def references(batch):
    """Two single-device steps per model, computed once for both meshes."""
    cache = {}

    def get(model):
        if model not in cache:
            cfg = DENSE if model == "dense" else MOE
            cache[model] = _run(Learner(init_model(cfg, seed=1), OPT, OBJ), *batch)
        return cache[model]

    return get


# Ring attention (the default) on every mesh; the all-gather form on one. The MoE model's layer 0
# is a dense MLP, so its cases cover the dense model's parts on each mesh too: the dense-only model
# runs on one mesh (on context 4 x fsdp 2 it repeated the MoE case's assertions; 37 s of compile).
# The MoE ring on context 2 x tensor 2 x data 2 is `slow` (make test-slow; 27 s of compile): that
# mesh's ring runs on the dense model, the MoE ring on context 4 x fsdp 2.
_SLOW = {"context2_tensor2_data2"}
FORMS = [pytest.param(mesh, "moe", "ring", marks=[pytest.mark.slow] if mesh in _SLOW else [])
         for mesh in MESHES]
FORMS += [("context2_tensor2_data2", "dense", "ring"), ("context4_fsdp2", "moe", "all_gather")]


@pytest.mark.parametrize("mesh_name, model, form", FORMS)
def test_context_parallel_step_matches_single_device(mesh_name, model, form, batch, references):
    cfg = DENSE if model == "dense" else MOE
    ref_results, ref_state = references(model)
    learner = Learner(init_model(cfg, seed=1), OPT, OBJ, make_mesh(**MESHES[mesh_name]),
                      context_attention=form)
    compiled = learner.compile_step(*batch)
    results, state = _run(learner, *batch)
    _compare(results, state, ref_results, ref_state)
    if model == "moe":
        _check_no_hidden_gather(compiled.as_text(), cfg, form)


def _check_no_hidden_gather(hlo: str, cfg, form: str) -> None:
    """No all-gather (over context or any axis) yields hidden states of a whole row, ``[.., T, D]``
    or the merged ``[rows * T, D]`` the linears use, nor all ``N`` policy tokens' ``[N, D]``.

    ``all_gather``: the K/V gather (4-D ``[rows, T, K, hd]``, named here) is there, once per
    attention layer (K, V). ``ring``: no all-gather of K/V at all (4-D ``[.., hd]``); K/V and
    their gradients travel by collective-permutes (``[rows, K, 2T/C, hd]`` blocks: K and V,
    dK and dV, each in the layer scan's body).
    """
    kv_gathers = kv_permutes = 0
    for line in hlo.splitlines():
        m = re.search(r"= \(?(\w+)\[([\d,]*)\][^ ]* (all-gather|collective-permute)(?:-start)?\(", line)
        if not m:
            continue
        dims = [int(x) for x in m.group(2).split(",") if x]
        if m.group(3) == "collective-permute":
            kv_permutes += len(dims) == 4 and dims[3] == cfg.head_dim
            continue
        if len(dims) == 4 and dims[3] == cfg.head_dim:
            assert form == "all_gather" and dims[1] == ROW_LEN, f"a K/V all-gather: {line.strip()[:200]}"
            kv_gathers += 1
            continue
        if dims and dims[-1] == cfg.hidden_size:
            assert not any(d % ROW_LEN == 0 or d == TOKENS for d in dims[:-1]), (
                f"an all-gather of hidden states: {line.strip()[:200]}")
    if form == "all_gather":
        assert kv_gathers >= 2 * cfg.num_hidden_layers, f"K/V gathers: {kv_gathers}"
    else:
        assert kv_permutes >= 4, f"K/V collective-permutes: {kv_permutes}"  # K, V; dK, dV
