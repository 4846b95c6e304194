"""Batched sampling: per-request parameters applied as per-row tensors (see `sampler`)."""

from inference_service.sample.sampler import Sampler, SamplerOutput, SamplingState

__all__ = ["Sampler", "SamplerOutput", "SamplingState"]
