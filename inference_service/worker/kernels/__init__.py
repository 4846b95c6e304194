"""Native CPU kernels: the C++ sources, their ctypes bindings, and the weight layouts they read."""
