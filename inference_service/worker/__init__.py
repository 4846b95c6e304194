"""The model side of a step: both runners, paged attention, native kernels, runtime linears, weight formats."""
