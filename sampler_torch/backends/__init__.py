"""External inference servers as sampler backends (same ``generate``/``load_weights`` API as the
torch engine)."""

from sampler_torch.backends.sglang import SGLangBackend, SGLangError, server_args, sglang_available

__all__ = ["SGLangBackend", "SGLangError", "server_args", "sglang_available"]
