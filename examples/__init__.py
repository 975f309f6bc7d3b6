"""Examples that run from a source checkout (the recipes in recipes/ call them): the GRPO loop (`grpo`) and the
Qwen3 trainer pieces (`qwen3`); and the integrations' (docs/integrations.md): TRL's AsyncGRPOTrainer with our sync
(`trl_async_grpo`, its configs `sync.yaml` and `sync_vllm.yaml`) and verl's checkpoint-engine keys
(`verl_checkpoint_engine.yaml`). They import the library; the library never imports them. The demo's tiny LM and
the recipes' one `main()` ship with the package (`lightning_weightsync.demo`)."""
