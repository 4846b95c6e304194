"""Paged attention: the KV cache tensors, and the attention function transformers calls to read and write them."""
