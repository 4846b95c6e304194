"""textgen.v1: the TextGeneration service (see generate.proto)."""
