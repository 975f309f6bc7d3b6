"""`lightning-weightsync demo` and what it runs: the tiny LM (`tiny_lm`: the trainer side and the rollout's module
factory) and the recipes' one `main()` (`recipe`)."""
