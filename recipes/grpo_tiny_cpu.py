"""GRPO on CPU: a tiny LM learns a counting task from rewards its rollouts earn with the weights they received.

    python recipes/grpo_tiny_cpu.py --config recipes/grpo_tiny_cpu.yaml [key=value ...]
    python recipes/grpo_tiny_cpu.py --config recipes/grpo_tiny_cpu.yaml trainer.send_mode=sharded

Starts `recipe.rollouts` rollout processes (each a `WeightReceiver` receiving every version into its own
model, generating and scoring groups of completions with it) and the Lightning GRPO trainer (FSDP2 over
gloo, `WeightSyncCallback` after every step); prints a line per step, writes `<output_dir>/*.jsonl` and
`<output_dir>/grpo.png`. Everything lives in `lightning_weightsync.examples.grpo` (docs/quickstart.md).
"""

from lightning_weightsync.examples.grpo import main

if __name__ == "__main__":
    raise SystemExit(main())
