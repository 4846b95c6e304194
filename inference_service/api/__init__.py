"""The public gRPC API: server (health, reflection, shutdown), servicer, conversions, status codes."""
