"""What several test modules share: multi-process helpers, engine set-ups, tiny models."""
