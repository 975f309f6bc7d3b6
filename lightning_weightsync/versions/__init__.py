"""Layer 3, versions of weights: `WeightSender` and `WeightReceiver` drive one backend identically through a
version's steps (prepare, plan, buckets, acks). Knows nothing of Lightning, Accelerate or sinks."""
