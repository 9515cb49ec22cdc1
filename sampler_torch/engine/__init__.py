"""The PyTorch sampler engine: ``Engine(model_dir, recipe).generate(prompts, SamplingParams)``."""

from sampler_torch.engine.engine import Engine
from sampler_torch.engine.params import Completion, SamplingParams
from sampler_torch.engine.requests import GenerateStats
from sampler_torch.engine.sampling import StepRecords, logit_noise, perturb_logits, sample_step, uniforms

__all__ = ["Completion", "Engine", "GenerateStats", "SamplingParams", "StepRecords", "logit_noise",
           "perturb_logits", "sample_step", "uniforms"]
