"""Model resolution and loading: `loader` (local folder, hub, GGUF, demo), `gguf`, `demo`."""
