"""The trainer's Publisher with train.weights: deltas after a full first version, bytes reported,
a bad store refused at construction."""

import pytest
from weight_versions import CFG, versions_of_weights

from convert.delta import DELTA_NAME
from convert.store import StoreError
from trainer_jax.publisher import Publisher


def test_first_version_full_then_deltas_and_bytes_per_version(tmp_path):
    announced = []
    pub = Publisher(tmp_path / "w", CFG.to_hf_dict(), lambda: ["bf16", "mxfp4"], None, 3,
                    lambda v, paths: announced.append((v, paths)), delta=True, full_every=10)
    try:
        for v, params in enumerate(versions_of_weights(3, seed=9)):
            paths = pub.publish_now(v, params)
    finally:
        pub.close()
    assert [v for v, _ in announced] == [0, 1, 2]
    assert not (tmp_path / "w" / "v00000000" / "bf16" / DELTA_NAME).exists()
    assert (paths["mxfp4"] / DELTA_NAME).is_file()
    line = pub.bytes_summary()
    assert line.startswith("weights: 3 versions") and "4 format-versions as deltas" in line
    assert [r["mxfp4"]["delta_base"] for _, r in pub.reports] == [None, 0, 1]


def test_a_bad_root_fails_at_construction(tmp_path):
    with pytest.raises(StoreError, match="nosuch://bucket/w"):
        Publisher("nosuch://bucket/w", CFG.to_hf_dict(), lambda: ["bf16"], None, 3, lambda v, p: None)
