import os

# Tests run on CPU; keep XLA from grabbing every core for its own thread pool twice over.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
