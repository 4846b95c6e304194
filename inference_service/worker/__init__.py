"""The model side of a step: KV cache tensors, the paged attention function, the model runner."""
