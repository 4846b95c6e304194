"""The client's version (kept here, not read from package metadata, so import stays fast)."""

__version__ = "0.1.0"
