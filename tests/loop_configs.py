"""Tiny `mixrl-train` runs shared by the end-to-end tests (config YAML as text)."""

from __future__ import annotations

#: one dense layer, arithmetic tasks, a bf16 and an int8 sampler group, 3 steps, a checkpoint at 3.
#: The service's buffer holds 16 samples (4 steps' worth): with the default 4,096 the samplers
#: generated, and the service validated and scored, 900-2,500 samples a test on the cores the
#: trainer compiles on, for the 12-20 a run of a few steps trains on (make test's CPU, issue 47).
TINY_LOOP = """
run: {name: mesh, seed: 0, steps: 3}
model: {hidden_size: 32, intermediate_size: 64, num_hidden_layers: 1, num_attention_heads: 4,
        num_key_value_heads: 2, head_dim: 8}
sft: {steps: 2, sequences_per_step: 8, rows: 4, row_len: 64, max_tokens: 128}
tasks:
  env: arithmetic
  group_size: 2
  sampling: {temperature: 1.0, head_k: 4, max_new_tokens: 6}
service: {listen: "127.0.0.1:0", buffer: {max_trajectories: 16}}
groups:
  - {name: bf16, recipe: bf16, capacity: 2}
  - {name: int8, recipe: int8, capacity: 2}
train: {prompts_per_step: 2, publish_every: 1, checkpoint_every: 3, eval_every: 0, eval_tasks: 0,
        rows: 4, row_len: 32, max_tokens: 64, support_k: 4, episode_tokens: 32, take_timeout_s: 240}
"""
