"""LoRA adapters at run time: their float weights per projection, the step's rows grouped by
adapter, and the linears that add each group's low-rank update to the base projection."""
