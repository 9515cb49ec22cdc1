"""mixrl trainer: the JAX learner (models, kernels, corrected objective, rollout service, loop)."""
