"""The compose file's S3 server: moto's, with the cluster's bucket made before it is
healthy (what ``kvstore local-cluster`` starts in its own process). Runs in moto's image
(``motoserver/moto``), which has moto's server and boto3."""

import os
import signal
import sys

import boto3
from moto.server import ThreadedMotoServer

HOST = os.environ.get("S3_HOST", "0.0.0.0")
PORT = int(os.environ.get("S3_PORT", "5000"))
BUCKET = os.environ.get("BUCKET", "kvstore-local")

server = ThreadedMotoServer(ip_address=HOST, port=PORT)
server.start()
boto3.client(
    "s3",
    endpoint_url=f"http://127.0.0.1:{PORT}",
    region_name="us-east-1",
    aws_access_key_id="testing",
    aws_secret_access_key="testing",
).create_bucket(Bucket=BUCKET)
print(f"S3 (moto) on port {PORT} with bucket {BUCKET}", flush=True)


def stop(signum: int, frame: object) -> None:
    server.stop()
    sys.exit(0)


# As PID 1 a signal without a handler is ignored: stop at once, not after the grace period.
signal.signal(signal.SIGTERM, stop)
signal.signal(signal.SIGINT, stop)
while True:
    signal.pause()
