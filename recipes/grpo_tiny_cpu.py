"""GRPO on CPU: a tiny LM learns a counting task from rewards its rollouts earn with the weights they received.

    python recipes/grpo_tiny_cpu.py --config recipes/grpo_tiny_cpu.yaml [key=value ...]
    python recipes/grpo_tiny_cpu.py --config recipes/grpo_tiny_cpu.yaml trainer.send_mode=sharded

Starts `recipe.rollouts` rollout processes (each a `WeightReceiver` receiving every version into its own
model, generating and scoring groups of completions with it) and the Lightning GRPO trainer (FSDP2 over
gloo, `WeightSyncCallback` after every step); prints a line per step, writes `<output_dir>/*.jsonl` and
`<output_dir>/grpo.png`. Everything lives in `examples.grpo` (docs/quickstart.md).
"""

import sys
from pathlib import Path

CHECKOUT = str(Path(__file__).resolve().parents[1])  # examples/ is in the checkout, not in the wheel
if CHECKOUT not in sys.path:
    sys.path.insert(0, CHECKOUT)

from examples.grpo import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
