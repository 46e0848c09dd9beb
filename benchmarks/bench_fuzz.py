"""The wire fuzzer against a live kvstore-server: frames built from the protocol's own
description, mutated, every answer judged (:mod:`kvharness.fuzz.run`).

One run starts a ``kvstore-server`` process (an admin token and a restricted one; per
store 4 MiB of host memory over 64 MiB of disk, at most 3 stores; 1 MiB frames, 64-block
batches, 0.5 s I/O timeout), stores 16 reference blocks through the real client, then
sends ``--frames`` frames (default 100,000; ``--quick`` 2,000) over connection after
connection: well-behaved clients, mutated fields, bad headers (version, magic, op,
flags, status, oversized lengths), frames out of the handshake's order, missing, wrong
and replayed tokens and a token's forbidden namespace, truncated frames, lying lengths,
noise, and beside them slow (slow-loris) and idle connections. Every ``--batch`` frames
the server must serve the reference blocks byte for byte to a fresh client, and its RSS
is sampled.

Fields: ``frames``, ``crashes`` (the server died or stopped answering a valid client),
``wrong_answers`` (an answer the protocol does not allow: another status, a malformed
reply, bytes other than those stored, a connection kept after a fatal refusal),
``refusals_missed`` (a success where the protocol demands a refusal), ``rss_growth``
(the server's RSS, last sample / first after the first 20% of frames - 1),
``frames_per_s``, ``mix`` (frames per mutation kind), ``bad_connections`` and
``log_lines`` (the server must log exactly one ``closed connection`` line for each
connection it cut off: ``log_lines_wrong`` counts the ports where it did not).
Exit status 1 when any of crashes, wrong_answers, refusals_missed or log_lines_wrong is
non-zero.

Run: ``python benchmarks/bench_fuzz.py [--json] [--quick] [--frames N] [--seed S]``.
"""

from __future__ import annotations

import sys
import tempfile

from _common import base_parser, emit, environment, log

from kvharness import FuzzSettings, run_fuzz


def main() -> int:
    parser = base_parser("The wire fuzzer against a live kvstore-server.")
    parser.add_argument("--frames", type=int, default=None, help="frames to send (100000)")
    parser.add_argument("--seed", type=int, default=0, help="the fuzzer's random seed")
    parser.add_argument("--batch", type=int, default=None, help="frames between checks")
    args = parser.parse_args()
    frames = args.frames or (2_000 if args.quick else 100_000)
    batch = args.batch or max(500, min(5_000, frames // 20))
    settings = FuzzSettings(frames=frames, seed=args.seed, batch=batch)
    log(f"fuzzing a kvstore-server with {frames} frames (seed {args.seed})")
    with tempfile.TemporaryDirectory(prefix="kvs-fuzz-", dir="/tmp") as work:
        report = run_fuzz(settings, work)
    result = {**report.as_dict(), "environment": environment()}
    for problem in report.problems[:20]:
        log(f"  {problem}")
    rows = [
        ["field", "value"],
        *[
            [name, result[name]]
            for name in (
                "frames",
                "crashes",
                "wrong_answers",
                "refusals_missed",
                "rss_growth",
                "frames_per_s",
                "bad_connections",
                "log_lines",
                "log_lines_wrong",
            )
        ],
    ]
    emit(result, args.json, rows)
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
