"""A vLLM worker extension the vLLM backend starts servers with
(``--worker-extension-cls mixrl_vllm_worker.MixrlWorkerExtension``, this directory on the server's
``PYTHONPATH``): one worker method, called over the dev-mode ``POST /collective_rpc`` route, that
reloads a published export from a directory.

Why not vLLM's own ``reload_weights`` alone: on vLLM 0.32's CPU runner a tied ``lm_head``
shares the embedding parameter but keeps a packed copy of it (``dispatch_cpu_unquantized_gemm``);
``reload_weights`` refreshes the embedding and never re-packs the head (vLLM logs
"ParallelLMHead: Failed to load weights"), so the server would score new hidden states with the
old head. This method runs vLLM's in-place reload and then re-processes every layer whose
weights were loaded only through a tie. It imports nothing from mixrl: it runs in the server's
Python, which only has vLLM.
"""

from __future__ import annotations


class MixrlWorkerExtension:
    """Mixed into vLLM's worker class by ``--worker-extension-cls``."""

    def mixrl_reload_weights(self, weights_path: str) -> dict:
        """Reload the checkpoint in ``weights_path`` in place (vLLM's layerwise reload), then
        re-process tied heads; answers ``{"path", "reprocessed": [module names]}``."""
        self.reload_weights(weights_path=weights_path)
        model = self.model_runner.get_model()
        reprocessed = []
        embed = None
        for name, module in model.named_modules():
            if name.endswith("embed_tokens"):
                embed = module
        head = getattr(model, "lm_head", None)
        if (embed is not None and head is not None and head is not embed
                and getattr(head, "weight", None) is getattr(embed, "weight", None)):
            method = getattr(head, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(head)
                reprocessed.append("lm_head")
        return {"path": weights_path, "reprocessed": reprocessed}
