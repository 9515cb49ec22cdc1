"""The head-uniqueness check is exact: any id twice in a row, at any two columns, is found."""

import itertools

import numpy as np
import pytest

from trainer_jax.service.validation import _rows_have_repeats


def _reference(ids: np.ndarray) -> bool:
    return any(len(set(row.tolist())) < len(row) for row in ids)


@pytest.mark.parametrize("k", [*range(1, 24), 32, 33, 64])
def test_every_pair_of_columns(k):
    rng = np.random.default_rng(k)
    p = 7
    base = np.stack([rng.permutation(1000)[:k] for _ in range(p)]).astype(np.int32)
    assert not _rows_have_repeats(base)
    for a, b in itertools.combinations(range(k), 2):
        for row in (0, p - 1):
            ids = base.copy()
            ids[row, b] = ids[row, a]
            assert _rows_have_repeats(ids), (k, a, b, row)


def test_repeats_across_rows_are_allowed_and_random_rows_agree():
    rng = np.random.default_rng(0)
    same = np.tile(np.arange(20, dtype=np.int32), (50, 1))  # one id in many rows: fine
    assert not _rows_have_repeats(same)
    assert not _rows_have_repeats(np.zeros((0, 20), np.int32))
    for k in (2, 3, 5, 20, 40):
        for _ in range(50):
            ids = rng.integers(0, 3 * k, size=(int(rng.integers(1, 6)), k)).astype(np.int32)
            assert _rows_have_repeats(ids) == _reference(ids)
    view = np.frombuffer(np.arange(40, dtype=np.int32).tobytes(), np.int32).reshape(2, 20)
    assert not _rows_have_repeats(view)  # read-only views of received bytes
