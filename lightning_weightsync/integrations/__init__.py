"""Adapters that let other frameworks drive the public API (each imported only by its framework)."""
