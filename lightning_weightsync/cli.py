"""`lightning-weightsync`: the rollout daemon, config inspection, the demo and the benchmarks.

    lightning-weightsync rollout --config recipe.yaml key=value ...
    lightning-weightsync config show [--config recipe.yaml] [key=value ...]
    lightning-weightsync demo
    lightning-weightsync bench [--json] [--size small|default] [--only NAME]

Config and connection problems end the command with one line saying what is wrong and one saying
how to fix it (exit code 2), never a traceback: they are the user's to fix, not bugs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from .errors import BackendUnavailable, ConfigError, PeerError, SinkError, WeightSyncTimeout

PROG = "lightning-weightsync"
EXIT_USAGE = 2

FIX_CONFIG = f"fix the value in --config or as key=value; `{PROG} config show` prints the resolved config"
FIX_BACKEND = "install the extra named above, or pick another transport.backend / rollout.sink.type / rollout.engine"
FIX_CONNECTION = (
    "check that the trainer is running and that transport.host / transport.port (and transport.auth_token) "
    "match on both sides"
)


class UserError(Exception):
    """A problem the user fixes (bad config, missing extra, unreachable peer): printed, not traced."""

    def __init__(self, message: str, fix: str) -> None:
        super().__init__(message)
        self.fix = fix


def _fail(message: str, fix: str) -> int:
    first = message.strip().splitlines()[0] if message.strip() else "unknown error"
    print(f"{PROG}: error: {first}", file=sys.stderr)
    print(f"  fix: {fix}", file=sys.stderr)
    return EXIT_USAGE


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


# --- commands ------------------------------------------------------------------------------------


def cmd_rollout(args: argparse.Namespace) -> int:
    from .config import load_config
    from .plugins import rollout_engine
    from .rollout.daemon import run_daemon

    cfg = load_config(args.config, args.overrides)
    _setup_logging(args.log_level)
    if str(cfg.rollout.engine) != "none":  # an engine's server that generates and receives (rollout_engines/<engine>/)
        return rollout_engine(cfg.rollout.engine).launch(cfg)
    run_daemon(cfg, stats_path=args.stats_jsonl, dump_path=args.dump_on_exit)
    _exit_past_stuck_groups()
    return 0


def _exit_past_stuck_groups() -> None:
    """The daemon stopped mid-version: its group's receives wait for bytes that will not come until
    `transport.timeout_s`, and a normal interpreter exit beside them aborts (exit 134). Everything of ours
    is closed and flushed by now (sink, files, sockets), so leave at once, with the exit code of a clean stop."""
    from .transport.backends import groups_draining

    if groups_draining():
        logging.getLogger(__name__).info("exiting without waiting for the abandoned data-plane group's transfers")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def cmd_config_show(args: argparse.Namespace) -> int:
    from .config import load_config, to_yaml

    cfg = load_config(args.config, args.overrides)
    print(f"# resolved and validated{f' from {args.config}' if args.config else ''}{_recipe_checked(cfg)}")
    print(to_yaml(cfg), end="")
    return 0


def _recipe_checked(cfg: Any) -> str:
    """Validate the `recipe:` section against the schema it names (`recipe._schema_`), and say what was done:
    a recipe section that names none is the script's to check, which `config show` must not call validated."""
    from .demo.recipe import SCHEMA_KEY, recipe_schema, validate_recipe

    if not cfg.recipe:
        return ""
    _import_from_cwd()  # a schema in ./examples or ./recipes, as for rollout.sink.factory
    schema = recipe_schema(cfg.recipe)
    if schema is None:
        return f" (recipe: not checked here: name its dataclass in recipe.{SCHEMA_KEY}; its script checks it)"
    validate_recipe(cfg.recipe, schema)
    return f" (recipe: against {cfg.recipe[SCHEMA_KEY]})"


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo.demo import run_demo

    return run_demo(steps=args.steps, workdir=args.workdir, timeout_s=args.timeout_s)


# modules of lightning_weightsync/bench/
BENCHMARKS = ("bucketcost", "chunking", "delta", "latency", "lora", "nixl", "stall", "throughput")
SINK_HELP = f"""sinks (rollout.sink.type=...; docs/configuration.md has every knob):
  module       (the default) load each version into a torch module built by your function:
               rollout.sink.factory=package.module:function [rollout.sink.options={{...}}]
  safetensors  write <dir>/step_<version>.safetensors (or checkpoint directories):
               rollout.sink.dir=DIR [rollout.sink.keep_last=3] [rollout.sink.template_dir=HF_DIR]
  callable     hand each version to your function: rollout.sink.target=package.module:function
rollout engines (rollout.engine=...; instead of the daemon, a server whose workers receive themselves):
  vllm         exec `vllm serve` that receives every version: vllm.model=MODEL [vllm.serve_args=[...]]
  sglang       exec SGLang's launch_server with our weight loader: sglang.model=MODEL [sglang.serve_args=[...]]

example: {PROG} rollout --config recipe.yaml rollout.sink.type=safetensors rollout.sink.dir=/tmp/versions
"""  # the names in plugins.SINKS and ROLLOUT_ENGINES, each with what it needs (a test keeps them in step)
BENCH_SIZES = ("small", "default")  # bench.BENCH_SIZES (not imported here: `--help` stays instant)


def _find_benchmark(name: str) -> ModuleType | None:
    """`lightning_weightsync.bench.<name>`: shipped with the package, so it runs where it is installed."""
    try:
        return importlib.import_module(f".bench.{name}", __package__)
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.bench.{name}":
            raise
    return None


def cmd_bench(args: argparse.Namespace) -> int:
    """Run each benchmark's `run(json_out, **SIZES[size])`; with --json, print one JSON object keyed by
    benchmark. What runs, for about how long, goes to stderr first (the throughput benchmark alone takes
    minutes at the default size)."""
    from .bench import duration

    names = args.only or list(BENCHMARKS)
    missing: list[str] = []
    results: dict[str, object] = {}
    for name in names:
        module = _find_benchmark(name)
        if module is None or not callable(getattr(module, "run", None)):
            what = "has no run(json_out)" if module is not None else "was not found"
            message = f"benchmark {name!r} {what} (lightning_weightsync/bench/{name}.py)"
            print(f"{PROG}: {message}", file=sys.stderr if args.json else sys.stdout)
            missing.append(name)
            continue
        kwargs = getattr(module, "SIZES", {}).get(args.size, {})
        estimate = getattr(module, "ESTIMATE_S", {}).get(args.size)
        about = f", about {duration(estimate)} on a 2-core machine" if estimate else ""
        print(f"== {name} (--size {args.size}{about})", file=sys.stderr, flush=True)
        if args.json:  # the benchmarks' own tables go nowhere; their returned results become one document
            with contextlib.redirect_stdout(io.StringIO()):
                results[name] = module.run(json_out=False, **kwargs)
        else:
            module.run(json_out=False, **kwargs)
    if args.json:
        print(json.dumps({"results": results, "missing": missing}, indent=2, default=str))
    return 1 if missing else 0


# --- parser ----------------------------------------------------------------------------------------


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="FILE.yaml", help="YAML config merged onto the defaults")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="overrides, e.g. transport.port=29600")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Stream trainer weights to RL rollout processes.")
    parser.add_argument("--version", action="version", version=f"{PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{rollout,config,demo,bench}")

    p = sub.add_parser(
        "rollout",
        help="run the rollout daemon: receive every version into the configured sink",
        description="Receive every version the trainer sends into the configured sink, until SIGTERM / SIGINT.",
        epilog=SINK_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_config_args(p)
    p.add_argument("--stats-jsonl", metavar="FILE", help="append one JSON line per version outcome")
    p.add_argument("--dump-on-exit", metavar="FILE.safetensors", help="module sink: write what it holds on exit")
    p.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    p.set_defaults(func=cmd_rollout)

    p = sub.add_parser("config", help="inspect configuration")
    config_sub = p.add_subparsers(dest="config_command", required=True, metavar="{show}")
    show = config_sub.add_parser("show", help="print the resolved, validated config")
    _add_config_args(show)
    show.set_defaults(func=cmd_config_show)

    p = sub.add_parser("demo", help="CPU demo: FSDP training over gloo syncing into a rollout daemon, verified")
    p.add_argument("--steps", type=int, default=4, help="training steps (one version each, plus version 0)")
    p.add_argument("--workdir", metavar="DIR", help="keep the demo's files here (default: a temp dir)")
    p.add_argument("--timeout-s", type=float, default=240.0, help="give up after this long (default 240)")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="run the benchmarks and print their ratios to same-run baselines")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--only", action="append", choices=BENCHMARKS, help="run only this benchmark (repeatable)")
    p.add_argument(
        "--size",
        choices=BENCH_SIZES,
        default="default",
        help="small: every benchmark scaled down (about a minute or two in all, noisier ratios); default: the "
        "documented figures (the throughput benchmark alone takes minutes)",
    )
    p.set_defaults(func=cmd_bench)
    return parser


def _version() -> str:
    """The installed distribution's version (the package root is not imported from here: layers)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lightning_weightsync")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _import_from_cwd() -> None:
    """Let `rollout.sink.factory=my_models:build` find `./my_models.py`: the console script's sys.path
    starts with its own bin/ directory, not the current directory. The directory goes *last*, so a stray
    file there (a `secrets.py`, a `zmq.py`) can never shadow the standard library or an installed
    package that the daemon imports later."""
    cwd = os.getcwd()
    if "" not in sys.path and cwd not in sys.path:
        sys.path.append(cwd)


def _warn_token_on_the_command_line(overrides: Sequence[str]) -> None:
    """A token given as `transport.auth_token=...` is in this process's argv: every user on the host reads
    it with `ps`. Said once, on stderr, never echoing it."""
    if any(o.split("=", 1)[0].strip() == "transport.auth_token" for o in overrides):
        print(
            f"{PROG}: warning: transport.auth_token on the command line is visible to every user of this host "
            "(ps); pass it with transport.auth_token_file=<file, chmod 600> or $LIGHTNING_WEIGHTSYNC_AUTH_TOKEN",
            file=sys.stderr,
        )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _import_from_cwd()
    _warn_token_on_the_command_line(getattr(args, "overrides", None) or [])
    try:
        return int(args.func(args))
    except ConfigError as exc:
        return _fail(str(exc), FIX_CONFIG)
    except BackendUnavailable as exc:
        return _fail(str(exc), FIX_BACKEND)
    except SinkError as exc:
        return _fail(str(exc), FIX_CONFIG)
    except (WeightSyncTimeout, PeerError) as exc:
        return _fail(str(exc), FIX_CONNECTION)
    except UserError as exc:
        return _fail(str(exc), exc.fix)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
