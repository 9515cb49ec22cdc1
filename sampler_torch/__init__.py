"""mixrl samplers: the PyTorch actors (models, engine, precision recipes, gRPC client, envs)."""
