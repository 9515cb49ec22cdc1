"""Runs before any case module imports JAX: 8 host-platform devices on CPU.

Run one case directly with ``pytest tests/parallel/cases/case_train_step.py``;
``tests/parallel/test_mesh_cases.py`` runs them all in one process of their own from the main suite.
"""

import os
import sys

# Eight devices; and no LLVM optimisation of the CPU code: compiling dominates these tiny steps
# (3x faster this way), and each case compares programs compiled with the same flags.
FLAGS = ("--xla_force_host_platform_device_count=8", "--xla_backend_optimization_level=0")
if "jax" not in sys.modules:
    _have = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = " ".join([_have, *(f for f in FLAGS if f not in _have)]).strip()
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(__file__))
