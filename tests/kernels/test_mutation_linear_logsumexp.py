"""linear_logsumexp's behaviour its human-style mutants showed untested (issue 46; docs/testing.md)."""

from __future__ import annotations

import numpy as np
import pytest

from trainer_jax.kernels.linear_logsumexp import linear_logsumexp


@pytest.mark.parametrize("which", ["h", "w"])
def test_a_nested_list_is_refused_as_no_array_naming_the_argument(which):
    # The documented error (a ValueError naming the argument and its shape), not an
    # AttributeError from reading .ndim off a list.
    args = {"h": np.ones((4, 8), np.float32), "w": np.ones((8, 20), np.float32)}
    args[which] = args[which].tolist()
    dims = "[N, D]" if which == "h" else "[D, V]"
    with pytest.raises(ValueError, match=rf"^{which} must be an array of shape \{dims}, got list$"):
        linear_logsumexp(args["h"], args["w"])
