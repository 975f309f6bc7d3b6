"""Runnable examples; `tiny_lm` is the CPU demo model (trainer side and rollout module factory)."""
