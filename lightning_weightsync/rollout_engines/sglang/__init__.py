"""SGLang rollouts: `client.py` (trainer side, SGLang's HTTP routes), `loader.py` (the custom weight
loader every TP rank runs), `launch.py` (`lightning-weightsync rollout rollout.engine=sglang`)."""
