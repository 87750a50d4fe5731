"""The installed hf_moe version (the package root re-exports it)."""

__version__ = "0.1.0"
