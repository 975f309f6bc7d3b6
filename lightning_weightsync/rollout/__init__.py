"""Layer 4, the rollout side: the daemon loop, its sinks and the vLLM integration. Meets the trainer side
only through the engine and the wire, never by import."""
