"""The runtime linear layers: modules that replace a model's nn.Linear and compute through the native kernels."""
