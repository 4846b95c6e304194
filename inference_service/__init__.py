"""A gRPC-first text-generation inference server: continuous batching over a paged KV cache."""

from inference_service.openmp_wait import bound_spinning

bound_spinning()  # before torch loads libgomp (openmp_wait.py)

__version__ = "0.1.0"
