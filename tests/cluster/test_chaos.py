"""The chaos soak (:mod:`kvharness.chaos.run`), short form, and the fault it relies on
that the other tests do not use: S3 bodies damaged in flight.

Three kvstore-server processes (host -> disk -> S3, written through), an in-process
member, a Redis of the soak's own (it is killed and started empty) and moto behind a
fault proxy; a mixed workload from three threads while nodes are SIGKILLed and
restarted, Redis restarted, and S3 fails, stalls and returns damaged bodies. Every block
returned as found is compared byte by byte with what was written; at the end, every
block that reached the bucket must still be there and readable through some node.
``benchmarks/bench_cluster.py --soak MINUTES`` runs the long form.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvharness.chaos.run import FAULT_KINDS, SoakConfig, SoakReport, run_soak
from kvharness.proxies.fault import FaultProxy, flip_bytes
from kvstore.cli.servers import DUMMY_AWS_ENV, S3Server

#: The short form: about 40 s of workload, 75-90 s in all on a 2-core machine.
SHORT = SoakConfig(seconds=40.0, seed=7, fault_interval_s=3.0)
#: Operations the short form does at least, even on a loaded machine (~20/s measured).
MIN_OPS = 200


@pytest.fixture
def proxy(s3_server: S3Server) -> Iterator[FaultProxy]:
    with FaultProxy(s3_server.port) as p:
        yield p


def _client(url: str) -> Any:
    """boto3 on ``url`` with moto's dummy credentials, no checksums of its own (so that
    what arrives is exactly what the proxy relayed)."""
    import boto3
    import botocore.config

    config = botocore.config.Config(
        s3={"addressing_style": "path"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
        retries={"max_attempts": 1},
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=url,
        region_name=DUMMY_AWS_ENV["AWS_DEFAULT_REGION"],
        aws_access_key_id=DUMMY_AWS_ENV["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=DUMMY_AWS_ENV["AWS_SECRET_ACCESS_KEY"],
        config=config,
    )


def test_the_proxy_damages_the_next_object_bodies_and_nothing_else(
    s3_server: S3Server, proxy: FaultProxy
) -> None:
    body = bytes(range(256)) * 40  # 10 KiB: damaged in three places
    bucket, key = s3_server.bucket, "chaos/obj"
    via = _client(proxy.url)
    try:
        via.put_object(Bucket=bucket, Key=key, Body=body)

        def get() -> bytes:
            return bytes(via.get_object(Bucket=bucket, Key=key)["Body"].read())

        proxy.corrupt_next(1)
        assert via.head_object(Bucket=bucket, Key=key)["ContentLength"] == len(body)
        damaged = get()  # the HEAD had no body: this GET is the one damaged
        assert len(damaged) == len(body) and damaged == flip_bytes(body) != body
        assert sum(a != b for a, b in zip(damaged, body, strict=True)) == 3
        assert get() == body  # the budget is spent
        proxy.corrupt_next(5)
        listing = via.list_objects_v2(Bucket=bucket, Prefix="chaos/")
        assert [o["Key"] for o in listing["Contents"]] == [key]  # a listing is no object
        proxy.corrupt_next(0)  # ends the mode
        assert get() == body
        via.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": key}]})
    finally:
        via.close()
    assert proxy.corrupted == 1 and proxy.faults == 1
    assert proxy.by_kind == {"PUT": 1, "HEAD": 1, "GET": 4, "DELETE": 1}


def _raw_put(proxy: FaultProxy, path: str, head: str, body: bytes, whole: bool) -> None:
    """A PUT of ``path`` through the proxy: headers ``head``, then ``body``. A ``whole``
    request waits for its answer; one cut short hangs up at once, as a node SIGKILLed
    mid-upload does."""
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{head}\r\n".encode() + body)
        if whole:
            sock.recv(4096)


def test_a_put_whose_sender_dies_mid_body_stores_nothing(
    s3_server: S3Server, proxy: FaultProxy
) -> None:
    """S3 stores nothing of a PUT whose body ends early; the proxy relayed the part that
    came as a whole object, which planted truncated objects in the soak's bucket: a
    block "in the bucket" that no node could read (issue 32's lost block)."""
    bucket = s3_server.bucket
    chunked = "Transfer-Encoding: chunked\r\n"
    _raw_put(proxy, f"/{bucket}/cut/length", "Content-Length: 1000\r\n", b"x" * 500, False)
    _raw_put(proxy, f"/{bucket}/cut/chunked", chunked, b"3e8\r\n" + b"y" * 200, False)
    _raw_put(proxy, f"/{bucket}/cut/whole", "Content-Length: 500\r\n", b"z" * 500, True)
    _raw_put(
        proxy, f"/{bucket}/cut/chunks", chunked, b"c8\r\n" + b"w" * 200 + b"\r\n0\r\n\r\n", True
    )
    proxy.stop()  # joins its handler threads: whatever it would relay, it has
    direct = _client(s3_server.url)
    try:

        def stored(key: str) -> int | None:
            try:
                return int(direct.head_object(Bucket=bucket, Key=key)["ContentLength"])
            except direct.exceptions.ClientError:
                return None

        assert stored("cut/whole") == 500 and stored("cut/chunks") == 200  # whole: relayed
        assert stored("cut/length") is None and stored("cut/chunked") is None
    finally:
        direct.close()
    assert proxy.cut_short == 2 and proxy.by_kind == {"PUT": 2}


def test_soak_config_rejects_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="nodes"):
        SoakConfig(nodes=1)
    with pytest.raises(ValueError, match="one weight per fault kind"):
        SoakConfig(fault_kinds=("node_kill",))
    with pytest.raises(ValueError, match="unknown fault kinds"):
        SoakConfig(fault_kinds=("meteor",), fault_weights=(1.0,))
    assert SoakConfig.minutes(2).seconds == 120.0


def test_a_report_reads_as_json_a_table_and_a_verdict() -> None:
    report = SoakReport(
        ops=10,
        faults=2,
        wrong_bytes=0,
        lost_blocks=0,
        s3_deleted=0,
        unexpected=0,
        ops_by_kind={"put": 6, "node_get": 4},
        faults_by_kind={"node_kill": 1, "s3_corrupt": 1},
        misses_by_kind={"node_get": 1},
        errors_by_kind={},
        blocks_put=12,
        blocks_stored=11,
        blocks_reached_s3=9,
        proxy={"requests": 40},
        node_counters={"cluster.hot": 3},
        driver={},
        diagnosis={},
        run_s=1.0,
        wall_s=5.0,
        seed=3,
        phases_s={"run": 1.0},
    )
    assert report.ok
    doc = report.to_json()
    assert doc["soak_ops"] == 10 and doc["soak_faults_by_kind"] == {"node_kill": 1, "s3_corrupt": 1}
    assert json.loads(json.dumps(doc)) == doc
    rows = report.rows()
    assert rows[0] == ["figure", "value"] and ["soak_lost_blocks", 0] in rows
    assert ["faults node_kill", 1] in rows and ["ops put", 6] in rows
    assert not dataclasses.replace(report, s3_deleted=1).ok
    assert "lost blocks 0" in report.summary()


@pytest.mark.slow
def test_a_short_chaos_soak_serves_no_wrong_byte_and_loses_no_block(
    tmp_path: Path, aws_env: None
) -> None:
    """Its own Redis (killed and restarted) and its own moto process (not the session's
    in-thread one: a soak must not share this process's GIL with S3)."""
    pytest.importorskip("moto")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed; run scripts/install-servers.sh")
    report = run_soak(SHORT, tmp_path)
    summary = report.summary()
    assert report.wrong_bytes == 0, summary
    assert report.lost_blocks == 0, summary
    assert report.s3_deleted == 0, summary  # nothing in the soak deletes a block
    assert report.unexpected == 0, summary  # failures are KVStoreErrors (misses)
    assert report.ops >= MIN_OPS, summary
    assert set(report.faults_by_kind) == set(FAULT_KINDS), summary
    assert report.faults == sum(report.faults_by_kind.values())
    assert report.proxy["corrupted"] > 0, summary  # the damage really reached a node
    assert report.blocks_reached_s3 > 0 and report.ops_by_kind["node_get"] > 0, summary
    assert report.node_counters.get("cluster.hot", 0) > 0, summary  # replicas were due
    assert report.to_json()["soak_wrong_bytes"] == 0
    # each node's KV-event view (restarted during the run) equals its snapshot after it
    assert report.events_diverged == 0, summary
    assert report.events["blocks"] > 0 and report.events["view_restarts"] > 0, summary
