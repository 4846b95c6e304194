"""The paged runner: one step of the model over the paged KV cache, and its decode-only plan."""
