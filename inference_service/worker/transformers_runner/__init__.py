"""The fallback runner: transformers' own attention, one transformers cache per request."""
