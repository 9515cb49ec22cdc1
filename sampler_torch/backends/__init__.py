"""External inference servers as sampler backends (same ``generate``/``load_weights`` API as the
torch engine): SGLang and vLLM over their HTTP servers."""

from sampler_torch.backends.http_server import ServerError
from sampler_torch.backends.sglang import SGLangBackend, SGLangError, server_args, sglang_available
from sampler_torch.backends.vllm import VLLMBackend, VLLMError, vllm_available
from sampler_torch.backends.vllm import server_args as vllm_server_args

__all__ = ["SGLangBackend", "SGLangError", "ServerError", "VLLMBackend", "VLLMError",
           "server_args", "sglang_available", "vllm_available", "vllm_server_args"]
