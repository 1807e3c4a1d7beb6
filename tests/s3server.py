"""A real S3 API on 127.0.0.1 for the cloud tests: moto's server, started and stopped by the tests.

The client side is never mocked: ``s3fs`` (the pack's code, Lightning's CSVLogger) talks HTTP to this
server through ``AWS_ENDPOINT_URL``. Faults are the server's own answers, injected by a WSGI layer in
front of moto's application: :meth:`S3Server.fail` answers 503 to a run of requests (a store that is down
for a while), :meth:`S3Server.stall` holds an upload after reading half its body (the uploading process
can then be killed mid-write; moto never receives the object, as S3 never shows a cut upload). Every request
is logged: :meth:`S3Server.requests` counts what the clients really fetched (a chunk's GETs, say).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.helpers import free_port

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               # botocore's own retries off: each 503 reaches the pack's retry layer, which must report it
               "AWS_MAX_ATTEMPTS": "1"}
UNAVAILABLE = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>ServiceUnavailable</Code>'
               b"<Message>Service is unavailable, try again later</Message></Error>")

Match = Callable[[str, str], bool]  # (method, path) -> bool


class _Faults:
    """WSGI middleware: moto's app, with scripted 503s and stalls."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.fail_trigger: Match | None = None
        self.failures_left = 0
        self.failed: list[str] = []
        self.stall_when: Match | None = None
        self.stalled = threading.Event()
        self.frozen_until = 0.0  # time.monotonic() until which every request waits (a store that stopped answering)
        self.thawed = threading.Event()  # set by reset_faults: the requests a freeze holds are answered at once
        self.release = threading.Event()
        self.requests: list[str] = []  # "METHOD path" of every request, in arrival order (answered or not)

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        with self.lock:
            self.requests.append(f"{method} {path}")  # on arrival: one a freeze holds belongs to the test that froze
        frozen = self.frozen_until - time.monotonic()
        if frozen > 0:
            self.thawed.wait(frozen)  # (reset_faults ends the freeze for the requests held by it too)
        with self.lock:
            if self.fail_trigger is not None and self.fail_trigger(method, path):
                self.fail_trigger = None  # armed: this request and the next ones fail
            failing = self.fail_trigger is None and self.failures_left > 0
            if failing:
                self.failures_left -= 1
                self.failed.append(f"{method} {path}")
            stall = self.stall_when is not None and self.stall_when(method, path)
            if stall:
                self.stall_when = None
        if stall:
            length = int(environ.get("CONTENT_LENGTH") or 0)
            environ["wsgi.input"].read(length // 2)  # half the body is in: the upload is mid-write
            self.stalled.set()
            self.release.wait(600)
            start_response("500 Internal Server Error", [("Content-Type", "application/xml")])
            return [b""]
        if failing:
            start_response("503 Service Unavailable", [("Content-Type", "application/xml"),
                                                        ("Content-Length", str(len(UNAVAILABLE)))])
            return [UNAVAILABLE]
        return self.app(environ, start_response)


class S3Server:
    """moto's S3 on 127.0.0.1:<free port> in a thread of this process."""

    def __init__(self) -> None:
        from moto.moto_server.werkzeug_app import (
            DomainDispatcherApplication,
            MotoRequestHandler,
            create_backend_app,
        )
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.faults = _Faults(DomainDispatcherApplication(create_backend_app))
        self.port = free_port()
        self._server = make_server("127.0.0.1", self.port, self.faults, threaded=True,
                                   request_handler=MotoRequestHandler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    @property
    def env(self) -> dict[str, str]:
        """What a process needs to reach this server (as a pod's environment would carry it)."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def bucket(self, name: str) -> str:
        """Create the bucket ``name``; returns ``s3://name``."""
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(item["Key"] for page in pages for item in page.get("Contents", []))

    def buckets(self) -> list[str]:
        return sorted(b["Name"] for b in self.client().list_buckets()["Buckets"])

    @property
    def requests(self) -> list[str]:
        """Every request so far, ``"METHOD path"`` in arrival order (slice from ``len()`` taken earlier)."""
        return self.faults.requests

    def fail(self, count: int, after: Match | None = None) -> None:
        """Answer 503 to ``count`` requests: from the first one ``after`` matches (now if None)."""
        with self.faults.lock:
            self.faults.fail_trigger, self.faults.failures_left = after, count
            self.faults.failed = []

    def stall(self, when: Match) -> threading.Event:
        """Hold the first request ``when`` matches after half its body; the event is set once it is held."""
        with self.faults.lock:
            self.faults.stalled.clear()
            self.faults.release.clear()
            self.faults.stall_when = when
        return self.faults.stalled

    def freeze(self, seconds: float) -> None:
        """Answer no request for ``seconds`` from now, then all of them (as a SIGSTOPped, then SIGCONTed
        server would: connections open, nothing said)."""
        self.faults.thawed.clear()
        self.faults.frozen_until = time.monotonic() + seconds

    @contextlib.contextmanager
    def checking_credentials(self) -> Iterator[None]:
        """Every request authenticated while inside (moto's own switch, through its control API), so the
        tests' fake keys are refused; anonymous again after."""
        self._reset_auth("0")  # from the next request on
        try:
            yield
        finally:
            self._reset_auth("inf")

    def _reset_auth(self, after: str) -> None:
        import urllib.request

        request = urllib.request.Request(f"{self.endpoint}/moto-api/reset-auth", data=after.encode(), method="POST",
                                         headers={"Content-Type": "text/plain"})
        urllib.request.urlopen(request, timeout=30).read()

    def paths(self, method: str, prefix: str) -> list[str]:
        """The paths (``/bucket/key``) of the ``method`` requests under ``prefix`` so far, in arrival order."""
        with self.faults.lock:
            asked = [request.split(" ", 1) for request in self.faults.requests]
        return [path for m, path in asked if m == method and path.startswith(prefix)]

    def reset_faults(self) -> None:
        with self.faults.lock:
            self.faults.fail_trigger, self.faults.failures_left, self.faults.stall_when = None, 0, None
            self.faults.frozen_until = 0.0
        self.faults.thawed.set()
        self.faults.release.set()

    def stop(self) -> None:
        self.reset_faults()
        self._server.shutdown()
        self._thread.join(timeout=30)


def object_upload(method: str, path: str) -> bool:
    """A PUT of a checkpoint object (not a manifest, not a log)."""
    return method == "PUT" and "/checkpoints/objects/" in path


@pytest.fixture(scope="session")
def s3() -> Iterator[S3Server]:
    """The session's S3 server; this process's environment points s3fs at it while the session runs (one
    endpoint per session: fsspec caches its filesystem instances)."""
    pytest.importorskip("moto", reason="moto[server] is in the dev extra: pip install -e '.[dev]'")
    pytest.importorskip("s3fs", reason="s3fs is in the cloud extra: pip install -e '.[cloud]'")
    server = S3Server()
    with pytest.MonkeyPatch.context() as patch:
        for key, value in server.env.items():
            patch.setenv(key, value)
        yield server
    server.stop()
