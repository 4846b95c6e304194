"""All of GGUF: converting a file to a transformers folder, decoding its quantized blocks, installing them."""
