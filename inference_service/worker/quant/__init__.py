"""Quantized weights: one canonical packed layout, the converters into it, and the linear that runs it."""
