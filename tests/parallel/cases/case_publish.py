"""Weight publication from sharded params: each tensor gathered once; same bytes as one device."""

from __future__ import annotations

import numpy as np
import pytest
from mesh_common import MESHES, MOE

from convert.hf_checkpoint import HFCheckpoint
from convert.publish import publish
from trainer_jax.models import init_model, iter_hf_tensors
from trainer_jax.parallel import make_mesh, publish_sharded, shard_model
from trainer_jax.parallel.publish import iter_gathered_hf_tensors


@pytest.mark.parametrize("mesh_name", ["2fsdp_4tensor", "2data_2fsdp_2expert"])
def test_gathered_tensors_equal_the_single_device_ones(mesh_name):
    want = dict(iter_hf_tensors(init_model(MOE, seed=4)))
    model = shard_model(init_model(MOE, seed=4), make_mesh(**MESHES[mesh_name]))
    gathers: list[str] = []
    got = dict(iter_gathered_hf_tensors(model, on_gather=lambda name, nbytes: gathers.append(name)))
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    # One gather per parameter: the 4 experts x 3 projections of the MoE layer come from 3 gathers.
    n_params = len(want) - 3 * MOE.num_experts + 3
    assert len(gathers) == len(set(gathers)) == n_params


def test_publish_sharded_writes_what_publish_writes(tmp_path):
    model = init_model(MOE, seed=5)
    want = publish(dict(iter_hf_tensors(model)), MOE, tmp_path / "single", 1, ["bf16"])["bf16"]
    shard_model(model, make_mesh(fsdp=2, tensor=4))
    paths = publish_sharded(model, MOE, tmp_path / "sharded", 1, ["bf16"])
    got = HFCheckpoint(paths["bf16"])
    ref = HFCheckpoint(want)
    assert set(got.names()) == set(ref.names())
    for name in ref.names():
        np.testing.assert_array_equal(got.get(name), ref.get(name), err_msg=name)
    assert (tmp_path / "sharded" / "LATEST").read_text().strip() == "v00000001"
