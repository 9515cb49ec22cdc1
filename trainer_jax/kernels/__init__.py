"""Fused kernels for the trainer."""
