"""The rollout engines (vLLM, SGLang): one folder each, one line each in `ROLLOUT_ENGINES` (`plugins.py`).

An engine is a server that generates and also receives our versions in its own workers. This layer sits
above both `trainer` and `rollout`: its folder `lightning_weightsync/rollout_engines/<name>/` holds both
halves of an engine, which run on different machines, and its config section:

- `config.py`: the `<name>` config section (a dataclass and its `Choice` enums), named by the table entry
  (`section=`) and collected by config while config itself is being imported, so it imports only
  `choice.py` (and `errors.py`);
- `client.py`: the trainer side. `clients(section) -> list[RolloutClient]` (`plugins.RolloutClient`), one per
  server in the section's `urls` (the typed `<name>` section, nothing else of the config), each driving the
  engine's own HTTP routes (pause, open an update, update while our sender broadcasts, close it with the
  version, resume). The trainer (`trainer/fleet.py`) loads it by path through the table and never imports
  this layer;
- `launch.py`: the rollout side. `launch(cfg) -> int` runs the engine's server configured to receive
  (`lightning-weightsync rollout rollout.engine=<name>`, the CLI reaches it through the table); the receiving
  code the server loads lives next to it, on the shared pieces beside the folders (`worker.py`, `launch.py`,
  `host_copy.py`, `adapter.py`), running `rollout/consume.py`.

Adding an engine: its folder (with its config section, documented in `configs/default.yaml`) and one
`register_rollout_engine` line in `plugins.py` (docs/concepts.md, "Adding a rollout engine").
"""
