"""A gRPC-first text-generation inference server: continuous batching over a paged KV cache."""

__version__ = "0.1.0"
