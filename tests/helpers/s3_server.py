"""A real S3-compatible server on 127.0.0.1 for the object-store tests: moto's server mode in a thread
of the test process (or in its own process, for tests that must pause it), with fake credentials.

Nothing here reaches beyond the loopback interface: the endpoint is always http://127.0.0.1:<port>, and
the credentials are fake ones that moto accepts and no real service would.
"""
from __future__ import annotations

import contextlib
import socket
import uuid
from dataclasses import dataclass

FAKE_KEY, FAKE_SECRET, REGION = "recckpt-test-key", "recckpt-test-secret", "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def storage_options(endpoint: str, **extra) -> dict:
    """What a user passes as `storage_options` for this endpoint: s3fs keywords, no environment."""
    opts = {"key": FAKE_KEY, "secret": FAKE_SECRET, "endpoint_url": endpoint,
            "client_kwargs": {"region_name": REGION}}
    opts.update(extra)
    return opts


@dataclass
class S3Server:
    endpoint: str

    def options(self, **extra) -> dict:
        return storage_options(self.endpoint, **extra)

    def fs(self, **extra):
        """A fresh s3fs filesystem for this server (not fsspec's cached instance)."""
        import s3fs
        return s3fs.S3FileSystem(skip_instance_cache=True, **self.options(**extra))

    def new_bucket(self, prefix: str = "bkt") -> str:
        """Create a bucket with a unique name; returns its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:10]}"
        self.client().create_bucket(Bucket=name)
        return name

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=FAKE_KEY,
                            aws_secret_access_key=FAKE_SECRET, region_name=REGION)

    def request_counts(self) -> dict:
        return {}


@contextlib.contextmanager
def running_server():
    """moto's threaded server on a free loopback port, for the duration of the block."""
    from moto.server import ThreadedMotoServer
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        server.stop()


class LoopbackProxy:
    """A TCP proxy on 127.0.0.1 in front of a server: counts the bytes the server sends back (what a
    client fetched, headers included), and can be paused (connections stay open, nothing flows: a
    frozen endpoint) or stopped (connections refused: an endpoint that is down)."""

    def __init__(self, target_port: int):
        import threading
        self.target_port = target_port
        self.port = free_port()
        self.bytes_down = 0
        self.requests = 0
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self._closed = False
        self._srv = socket.socket()
        self._srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._srv.bind(("127.0.0.1", self.port))
        self._srv.listen(128)
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def reset(self):
        with self._lock:
            self.bytes_down = self.requests = 0

    def pause(self):
        self._running.clear()

    def resume(self):
        self._running.set()

    def stop(self):
        self._closed = True
        self._running.set()
        with contextlib.suppress(OSError):
            self._srv.close()
        for c in list(self._conns):
            with contextlib.suppress(OSError):
                c.close()

    def _accept(self):
        import threading
        while not self._closed:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self._conns += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, src, dst, down):
        try:
            while not self._closed:
                data = src.recv(1 << 16)
                if not data:
                    break
                self._running.wait()
                if self._closed:
                    break
                with self._lock:
                    if down:
                        self.bytes_down += len(data)
                    elif data[:4] in (b"GET ", b"PUT ", b"HEAD", b"POST", b"DELE"):
                        self.requests += 1
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)


@contextlib.contextmanager
def server_process(auth_after: int | None = None):
    """moto's server in its own process on a free loopback port (it can then be killed, or enforce
    credentials: with `auth_after`=N, requests after the first N must be signed by an IAM user it knows,
    which the fake credentials are not)."""
    import os
    import subprocess
    import sys
    import time
    port = free_port()
    env = dict(os.environ)
    if auth_after is not None:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(auth_after)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.1)
        yield S3Server(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(timeout=30)
