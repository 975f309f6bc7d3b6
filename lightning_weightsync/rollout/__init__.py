"""Layer 4, the rollout side: the daemon loop, its sinks and the vLLM integration. Meets the trainer side
only through the versions layer and the wire, never by import."""
