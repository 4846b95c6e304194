"""The continuous-batching engine: requests, scheduling, KV block accounting, text output."""
