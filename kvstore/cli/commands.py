"""The ``kvstore`` command: ``demo``, ``server``, ``route``, ``stats``, ``config``,
``calibrate-prefill``, ``calibrate-tiers`` and ``bench``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvstore.version import __version__

__all__ = ["main"]


#: The least value of each count option (a demo of 0 sessions, a layout of 0 layers: a
#: mistake said in one line naming the option, before any work).
_AT_LEAST = {
    "sessions": 1,
    "turns": 1,
    "system_tokens": 0,
    "layers": 1,
    "kv_heads": 1,
    "head_dim": 1,
    "block_tokens": 1,
    "nodes": 1,
    "reps": 1,
}

#: The layout flags' values when none is given: Llama-3-8B.
_LAYOUT_DEFAULTS: dict[str, Any] = {
    "layers": 32,
    "kv_heads": 8,
    "head_dim": 128,
    "block_tokens": 256,
    "dtype": "bfloat16",
}


def _layout_args(parser: argparse.ArgumentParser, found_where: str) -> None:
    """The layout flags (left None, so that a command tells given from default), and
    ``--layout FINGERPRINT`` for a layout found ``found_where``."""
    d = _LAYOUT_DEFAULTS
    group = parser.add_argument_group(
        f"KV layout (a flag not given: Llama-3-8B's {d['layers']} layers x {d['kv_heads']} "
        f"KV heads x {d['head_dim']}, {d['block_tokens']} tokens, {d['dtype']})"
    )
    group.add_argument("--layers", type=int, help="attention layers")
    group.add_argument("--kv-heads", type=int, help="KV heads per rank")
    group.add_argument("--head-dim", type=int, help="head dimension")
    group.add_argument("--block-tokens", type=int, help="tokens per chunk")
    group.add_argument("--dtype", help="KV dtype")
    group.add_argument(
        "--layout",
        metavar="FINGERPRINT",
        help=f"a layout by its fingerprint (or a unique start of it), as found {found_where}",
    )


def _parser() -> argparse.ArgumentParser:
    from kvstore.runtime import OneLineParser

    parser = OneLineParser(prog="kvstore", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="run a multi-turn chat workload through the store")
    # Each help names its default ("(default: %(default)s)"); options without one say why.
    demo.add_argument(
        "--sessions", type=int, default=16, help="chat sessions (default: %(default)s)"
    )
    demo.add_argument(
        "--turns", type=int, default=4, help="turns per session (default: %(default)s)"
    )
    demo.add_argument(
        "--system-tokens",
        type=int,
        default=2048,
        help="tokens of the system prompt every session shares (default: %(default)s)",
    )
    demo.add_argument(
        "--layers",
        type=int,
        default=32,
        help="model layers; the KV of a chunk grows with them (default: %(default)s, "
        "Llama-3-8B's 32 MiB per 256-token chunk)",
    )
    demo.add_argument("--config", help="store config YAML (default: embedded defaults)")
    demo.add_argument(
        "--cache-dir",
        help="disk tier directory (default: a scratch directory removed at the end; "
        "name one to keep the cache and see a second run hit from disk)",
    )
    demo.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seed of the random prompts, replies and KV: the same seed replays the same "
        "workload (default: %(default)s)",
    )
    demo.add_argument("--json", action="store_true", help="print the report as JSON")

    stats = sub.add_parser(
        "stats",
        help="what the config's disk tiers hold (reads only), or a running server's figures",
        description="Every layout (and server namespace) the config's disk tiers hold, its "
        "blocks, and each tier's capacity in blocks; with layout flags, that layout too. "
        "Reads only: no store is opened, nothing is written. With --server: what a running "
        "kvstore-server says (each tier's live read speed, restore plans, tenants' figures).",
    )
    stats.add_argument("--config", help="store config YAML (default: $KVSTORE_CONFIG / embedded)")
    stats.add_argument("--json", action="store_true", help="print the report as JSON")
    stats.add_argument(
        "--server", metavar="ADDRESS", help="a running server's HOST:PORT or unix:/path"
    )
    stats.add_argument(
        "--namespace",
        help="with --server: a namespace the token must open (if not: exit 2, naming the "
        "ones it does); the report is what the token sees",
    )
    stats.add_argument(
        "--token-file", help="with --server: a file holding the token (the operator's: all)"
    )
    _layout_args(stats, "on disk (kvstore stats lists them)")

    cal = sub.add_parser(
        "calibrate-prefill",
        help="measure a model's prefill time with vLLM; print restore.prefill_table",
        description="Runs vLLM offline (no cache) on random prompts of each length, one at a "
        "time to their first token, and prints the restore section whose prefill_table the "
        "restore planner weighs loads against (docs/restore.md). Needs vLLM installed.",
    )
    cal.add_argument("--model", required=True, help="the model's path or Hugging Face id")
    cal.add_argument(
        "--lengths",
        default="1024,4096,16384",
        help="prompt lengths in tokens, comma-separated (default: %(default)s)",
    )
    cal.add_argument(
        "--reps", type=int, default=3, help="timed prompts per length (default: %(default)s)"
    )
    cal.add_argument(
        "--out", help="also write the restore section to this file (vLLM logs to stdout too)"
    )
    cal.add_argument(
        "--engine",
        default="{}",
        help="more vllm.LLM arguments as JSON, e.g. '{\"tensor_parallel_size\": 2}' "
        "(default: none)",
    )

    tiers = sub.add_parser(
        "calibrate-tiers",
        help="measure each tier's read speed; print restore.tier_speeds",
        description="Writes a scratch chunk of the layout to each tier of the store's config, "
        "reads it back a few times at a few sizes (one layer, a few, the whole chunk), keeps "
        "the fastest of each size, deletes it, and prints the restore section whose "
        "tier_speeds a store starts its estimates from (docs/restore.md).",
    )
    tiers.add_argument("--config", help="store config YAML (default: $KVSTORE_CONFIG, built-in)")
    tiers.add_argument(
        "--reads", type=int, default=3, help="reads of each size (default: %(default)s)"
    )
    tiers.add_argument("--out", help="also write the restore section to this file")
    _layout_args(tiers, "on disk (kvstore stats lists them)")

    config = sub.add_parser("config", help="print the resolved configuration (secrets hidden)")
    config.add_argument("--config", help="store config YAML to check")

    route = sub.add_parser(
        "route", help="rank a cluster's nodes for a prompt (cache-aware routing)"
    )
    route.add_argument("--config", help="config YAML with a cluster: section")
    route.add_argument("--namespace", help="server namespace (default: cluster.namespace)")
    what = route.add_mutually_exclusive_group(required=True)
    what.add_argument("--keys", help="file of chunk keys, one hex key per line ('-': stdin)")
    what.add_argument("--tokens", help="file of token ids (whitespace-separated; '-': stdin)")
    route.add_argument("--model", help="with --tokens: the model id the engines hash under")
    route.add_argument("--json", action="store_true", help="print the ranking as JSON")
    _layout_args(route, "in the cluster's index (left out: the one layout it holds)")

    from kvstore.server import add_arguments

    server = sub.add_parser("server", help="run kvstore-server in the foreground")
    add_arguments(server)

    local = sub.add_parser(
        "local-cluster",
        help="start Redis, an S3 endpoint and kvstore-server nodes on this machine, "
        "to try a cluster (Ctrl-C stops all)",
    )
    local.add_argument("--nodes", type=int, default=2, help="kvstore-server nodes (default: 2)")

    # main() hands its arguments to benchmarks/run_all.py as they are: --quick, --only, --out.
    bench_help = "run every benchmark, results into ./kvstore-bench/ (source checkout only; --help)"
    sub.add_parser("bench", add_help=False, help=bench_help)
    return parser


def _print_demo(report: dict[str, Any]) -> None:
    lines = [
        "",
        f"kvstore demo: {report['sessions']} sessions x {report['turns']} turns, "
        f"{report['requests']} requests, KV {report['block_mib']:.0f} MiB per "
        f"{report['model_layout']['block_tokens']}-token chunk",
        f"  prefill tokens saved : {report['prefill_tokens_saved']:,} of "
        f"{report['prompt_tokens']:,} prompt tokens ({report['prefill_saved_fraction']:.1%})",
        f"  chunk hit rate       : {report['chunk_hit_rate']:.1%}  by turn: "
        + ", ".join(f"{t}: {h:.1f}" for t, h in report["hit_chunks_per_request_by_turn"].items())
        + " chunks/request",
        f"  verified bit-exact   : {report['chunks_loaded_and_verified']:,} chunks loaded",
        f"  stored               : {report['chunks_stored']:,} chunks; "
        f"evictions: {report['evictions']:,}",
        f"  throughput           : put {report['put_gbps']:.1f} GB/s, "
        f"get {report['get_gbps']:.1f} GB/s",
        *_demo_storage_lines(report),
    ]
    print("\n".join(lines))


def _demo_storage_lines(report: dict[str, Any]) -> list[str]:
    """The demo report's lines on where the chunks are: the tiers (their counts added up),
    close(), the restart, the disk tier."""
    from kvstore.cli.demo import copies_summary, disk_summary
    from kvstore.config import format_size

    lines = [f"  held at the end      : {copies_summary(report)}"]
    for tier in report["tiers"]:
        lines.append(
            f"  tier {tier['kind']:<7}: {tier['blocks']:>5} blocks, "
            f"{format_size(tier['bytes'])} of {format_size(tier['capacity_bytes'])}, "
            f"{tier['evictions']} evicted, {tier['demotions']} demoted, "
            f"{tier['writebacks']} written back ahead of eviction"
        )
    lines.append(f"  serving wall time    : {report['seconds']:.1f} s")
    left = report["close_flush_left_bytes"]
    lines.append(
        f"  close()              : {report['close_seconds']:.1f} s, of which writing "
        f"{format_size(report['close_flush_bytes'])} only memory held to disk "
        f"{report['close_flush_seconds']:.1f} s ({report['close_flush_gbps']:.2f} GB/s)"
        + (f"; {format_size(left)} did not fit" if left else "")
    )
    restart = report["after_restart"]
    lines.append(
        f"  after a restart      : store reopened in {restart['open_seconds']:.2f} s with "
        f"{restart['blocks_on_disk']} blocks on disk; each session's last prompt finds "
        f"{restart['last_prompt_chunks_found']} of {restart['last_prompt_chunks']} chunks; "
        f"{restart['sessions_verified_from_disk']} sessions verified from disk"
    )
    if report["disk_path"]:
        lines.append(f"  disk tier            : {disk_summary(report)}")
    return lines


def _cmd_demo(args: argparse.Namespace) -> int:
    """The demo and its report; 1 when the disk tier could not keep the cache (it says what
    did not fit and why)."""
    from kvstore.cli.demo import DemoSettings, ProgressBar, run_demo
    from kvstore.config import format_size

    # What close() waits for is logged at INFO when stderr is not a terminal (a bar otherwise).
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    logging.getLogger("kvstore.close").setLevel(logging.INFO)

    settings = DemoSettings(
        sessions=args.sessions,
        turns=args.turns,
        system_tokens=args.system_tokens,
        num_layers=args.layers,
        seed=args.seed,
        config=args.config,
        cache_dir=args.cache_dir,
    )
    report = run_demo(settings, progress=lambda n: ProgressBar(n, "requests"))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_demo(report)
    short = report["disk_shortfall"]
    if short is None:
        return 0
    print(
        f"kvstore: error: the disk tier ({report['disk_path']}) could not keep the cache: "
        f"{short['chunks_missing']} of the {short['chunks_held']} chunks did not fit, it kept "
        f"{format_size(short['bytes_on_disk'])} ({short['why']}), and the sessions' last "
        f"prompts miss {short['last_prompt_chunks_missing']} chunks after a restart; give it "
        f"{format_size(short['bytes_needed'])} of room (--cache-dir DIR on a disk with that free)",
        file=sys.stderr,
    )
    return 1


def _cmd_stats(args: argparse.Namespace) -> int:
    """Report what the disk tiers hold without opening a store (kvstore/cli/survey.py):
    opening one would create directories, sweep files and join a cluster. With
    ``--server``, a running server's own figures (kvstore/cli/live_report.py)."""
    if args.server:
        return _server_stats(args)
    from kvstore.cli.survey import format_survey, survey
    from kvstore.config import StoreConfig

    config = StoreConfig.load(args.config)
    _check_disk_paths(config)
    report = survey(config, _given_layout(args), args.layout)
    print(json.dumps(report, indent=2) if args.json else format_survey(report))
    # Each disk tier once: every store in it shares the directory's state.
    disks = {t["root"]: t for s in report["stores"] for t in s["tiers"] if t["kind"] == "disk"}
    return _tier_troubles(list(disks.values()))


def _cmd_calibrate_prefill(args: argparse.Namespace) -> int:
    from kvstore.connectors import Calibration, calibrate_prefill, format_table, parse_lengths
    from kvstore.errors import ConfigError

    try:
        engine = json.loads(args.engine)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"--engine: not JSON: {exc}") from None
    if not isinstance(engine, dict):
        raise ConfigError(f"--engine: a JSON object of vllm.LLM arguments, got {args.engine!r}")
    cal = Calibration(args.model, parse_lengths(args.lengths), args.reps, engine=engine)
    text = format_table(calibrate_prefill(cal), cal)
    print(text)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        except OSError as exc:
            raise ConfigError(f"--out: {exc}") from None
    return 0


def _cmd_calibrate_tiers(args: argparse.Namespace) -> int:
    from kvstore.config import StoreConfig
    from kvstore.connectors import calibrate_tiers, format_tier_speeds
    from kvstore.errors import ConfigError

    if args.reads < 1:
        raise ConfigError(f"--reads: at least 1, got {args.reads}")
    speeds = calibrate_tiers(StoreConfig.load(args.config), _layout(args), args.reads)
    text = format_tier_speeds(speeds, args.reads)
    print(text)
    if args.out:
        try:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        except OSError as exc:
            raise ConfigError(f"--out: {exc}") from None
    return 0 if any(not isinstance(v, str) for v in speeds.values()) else 1


def _server_stats(args: argparse.Namespace) -> int:
    from kvstore.cli.live_report import format_server_stats
    from kvstore.client import AdminClient, ClientOptions
    from kvstore.errors import ConfigError

    token = None
    if args.token_file:
        try:
            with open(args.token_file) as f:
                token = f.read().strip().encode()
        except OSError as exc:
            raise ConfigError(f"--token-file: {exc}") from None
    options = ClientOptions(args.server, args.namespace or "default", token)
    stats = AdminClient(options).stats(args.namespace)
    print(json.dumps(stats, indent=2) if args.json else format_server_stats(stats, args.server))
    return 0


def _check_disk_paths(config: Any) -> None:
    """A disk path no store could ever use is the ConfigError a store's open raises
    (the same line), found by reading only."""
    from kvstore.config import DiskTierConfig
    from kvstore.errors import ConfigError
    from kvstore.tiers import unusable_path

    for tier in config.tiers:
        problem = unusable_path(tier.path) if isinstance(tier, DiskTierConfig) else None
        if problem is not None:
            raise ConfigError(problem)


def _tier_troubles(tiers: list[dict[str, Any]]) -> int:
    """One ``kvstore: error:`` line per disk tier that cannot be written; 1 if any, else 0
    (their lines are marked ``[READ-ONLY]``)."""
    status = 0
    for tier in tiers:
        if tier.get("writable") is False:
            print(
                f"kvstore: error: tier {tier['kind']} ({tier.get('path')}) is read-only "
                f"({tier.get('write_error')}): it serves the blocks it holds and stores none; "
                "fix the mount or permissions, or set its path to a writable directory",
                file=sys.stderr,
            )
            status = 1
    return status


def _cmd_config(args: argparse.Namespace) -> int:
    import yaml

    from kvstore.config import StoreConfig
    from kvstore.runtime import mask_config

    # Tokens, and passwords in URLs (redis_url, a tier's url), as ***.
    data = mask_config(StoreConfig.load(args.config).to_dict())
    print(yaml.safe_dump(data, sort_keys=False), end="")
    return 0


def _read_text(path: str, option: str) -> str:
    """The text of ``path`` (``-``: standard input); InvalidInputError, naming
    ``option``, for a file that cannot be read or is not UTF-8 text."""
    from kvstore.errors import InvalidInputError

    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise InvalidInputError(f"{option} {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise InvalidInputError(f"{option} {path}: not UTF-8 text") from None


def _cmd_route(args: argparse.Namespace) -> int:
    from kvstore.config import StoreConfig
    from kvstore.errors import ConfigError

    config = StoreConfig.load(args.config)
    if not config.cluster.enabled:
        raise ConfigError("cluster.redis_url: not set; `kvstore route` needs a cluster config")
    keys, tokens = _route_input(args)
    # Only now torch and Redis: a mistake above is said before seconds of imports.
    from kvstore.cluster import ClusterIndex, Router
    from kvstore.keys import Namespace

    namespace = args.namespace or config.cluster.namespace
    index = ClusterIndex(config.cluster)
    with contextlib.closing(index):
        layout = _route_layout(args, index, namespace)
        with Router(config.cluster, layout, namespace, index) as router:
            if keys is not None:
                ranked = router.rank(keys)
            else:
                ranked = router.rank_tokens(tokens, Namespace(model=args.model, layout=layout))
    if args.json:
        print(json.dumps([dataclasses.asdict(r) for r in ranked], indent=2))
        return 0
    print(
        f"{'node':<20} {'merit':>8} {'prefix chunks':>13} {'memory':>7} {'disk':>6} "
        f"{'s3':>6} {'restore ms':>10} {'ready ms':>10} {'load':>8}  address"
    )
    for r in ranked:
        restore = "-" if r.restore_ms is None else f"{r.restore_ms:.1f}"
        ready = "-" if r.ready_ms is None else f"{r.ready_ms:.1f}"
        print(
            f"{r.node_id:<20} {r.merit:>8.1f} {r.prefix_blocks:>13} {r.memory_blocks:>7} "
            f"{r.disk_blocks:>6} {r.shared_blocks:>6} {restore:>10} {ready:>10} "
            f"{r.load:>8.1f}  {r.advertise or '-'}"
        )
    return 0


def _layout(args: argparse.Namespace) -> Any:
    """The layout the flags name (Llama-3-8B's values for those not given); it must be
    ``--layout``'s when both are given."""
    from kvstore.errors import InvalidInputError
    from kvstore.layout import KVLayout

    v = {
        k: d if getattr(args, k) is None else getattr(args, k) for k, d in _LAYOUT_DEFAULTS.items()
    }
    try:
        layout = KVLayout(v["layers"], v["kv_heads"], v["head_dim"], v["block_tokens"], v["dtype"])
    except InvalidInputError as exc:  # say it was the flags (e.g. --dtype float13)
        raise InvalidInputError(f"the layout flags: {exc}") from None
    if args.layout is not None and not layout.fingerprint_hex.startswith(args.layout.lower()):
        raise InvalidInputError(
            f"--layout {args.layout}: the layout flags name layout {layout.fingerprint_hex}; "
            "give the flags or --layout"
        )
    return layout


def _route_input(args: argparse.Namespace) -> tuple[Any, list[int]]:
    """``(keys, [])`` read from ``--keys``, or ``(None, token ids)`` from ``--tokens``."""
    from kvstore.errors import InvalidInputError

    if args.keys is not None:
        lines = [x.strip() for x in _read_text(args.keys, "--keys").split() if x.strip()]
        try:
            raw = [bytes.fromhex(x) for x in lines]
            from kvstore.keys import check_keys  # torch: after the hex, which needs none

            return check_keys(raw), []
        except ValueError:
            raise InvalidInputError("--keys: expected one hex key per line") from None
    if not args.model:
        raise InvalidInputError("--tokens needs --model (the id the engines hash under)")
    try:
        return None, [int(x) for x in _read_text(args.tokens, "--tokens").split()]
    except ValueError:
        raise InvalidInputError("--tokens: expected integer token ids") from None


def _route_layout(args: argparse.Namespace, index: Any, namespace: str) -> Any:
    """The layout to rank in: the flags', else the one the index holds in ``namespace``
    (kvstore/cluster/catalog.py); says on stderr when the index holds none of it."""
    from kvstore.cluster import route_layout

    fallback = _layout(argparse.Namespace(**{**vars(args), "layout": None}))
    layout, notes = route_layout(index, namespace, _given_layout(args), args.layout, fallback)
    for note in notes:
        print(f"kvstore: note: {note}", file=sys.stderr)
    return layout


def _given_layout(args: argparse.Namespace) -> Any:
    """The flags' layout when any layout flag is given, else None."""
    return _layout(args) if any(getattr(args, k) is not None for k in _LAYOUT_DEFAULTS) else None


def _cmd_local_cluster(args: argparse.Namespace) -> int:
    from kvstore.cli.local_cluster import LocalClusterSettings, run

    return run(LocalClusterSettings(nodes=args.nodes))


def _cmd_server(args: argparse.Namespace) -> int:
    from kvstore.server import run

    return run(args)


def _run_all_script() -> Path:
    """``benchmarks/run_all.py`` of the source checkout this package was imported from."""
    return Path(__file__).resolve().parents[2] / "benchmarks" / "run_all.py"


def _cmd_bench(argv: Sequence[str]) -> int:
    """Run ``benchmarks/run_all.py`` with ``argv``, in this interpreter; its exit status."""
    script = _run_all_script()
    if not script.is_file():
        print(
            f"kvstore: error: `kvstore bench` needs the source tree: the benchmarks ship with "
            f"it, not with the installed package ({script} does not exist). Clone the "
            f"repository, install it (`pip install -e .`) and run `kvstore bench` there.",
            file=sys.stderr,
        )
        return 2
    # In the caller's directory (a relative --out is theirs), under this command's name:
    # an argument, not a KVSTORE_* variable, which the scripts' stores would read as a setting.
    return subprocess.call([sys.executable, str(script), "--prog", "kvstore bench", *argv])


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvstore`` console script."""
    from kvstore.errors import KVStoreError
    from kvstore.runtime import check_counts

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        return _cmd_bench(argv[1:])
    args = _parser().parse_args(argv)
    handlers = {
        "demo": _cmd_demo,
        "stats": _cmd_stats,
        "config": _cmd_config,
        "server": _cmd_server,
        "route": _cmd_route,
        "local-cluster": _cmd_local_cluster,
        "calibrate-prefill": _cmd_calibrate_prefill,
        "calibrate-tiers": _cmd_calibrate_tiers,
    }
    try:
        check_counts(args, _AT_LEAST)
        return handlers[args.command](args)
    except KVStoreError as exc:
        print(f"kvstore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C: one line (what was cleaned up), not a traceback
        print(f"\nkvstore: {exc or 'interrupted (Ctrl-C)'}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
