"""vLLM integration on the rollout side."""
