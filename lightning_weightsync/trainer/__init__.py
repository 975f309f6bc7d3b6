"""Layer 4, the trainer side: gather full tensors from (FSDP-)sharded models (`gather`), name them as the
rollout expects, decide when a sync runs (`driver`), and the Lightning / Accelerate integrations."""
