"""``synflux-serve`` as a process on loopback, for the tests and the benchmarks: start it, wait until it is
healthy, connect websockets to it as a robot would, stop it with SIGINT."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from ..runtimes import wire


PORT_ATTEMPTS = 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``python -m synflux_ros.serve.cli --config CONFIG --port <free> ARGS...``, its output in ``log``."""

    def __init__(self, config: str, args: list[str], log: str, key: str = "", timeout: float = 120.0,
                 ca_file: str = "", env: dict | None = None):
        """``ca_file``: the certificate to trust when the server runs TLS (``--tls-cert``); ``env``: the
        environment of the process (default this one's)."""
        self.log, self.key, self.config = log, key, config
        self.ssl = None
        if ca_file:
            import ssl
            self.ssl = ssl.create_default_context(cafile=ca_file)
        # The free port is released before Ray's proxy binds it, seconds later; meanwhile the kernel can give it
        # to an outgoing connection (Ray's own make many) and the proxy fails to bind: then start on another.
        for attempt in range(PORT_ATTEMPTS):
            self.port = free_port()
            cmd = [sys.executable, "-m", "synflux_ros.serve.cli", "--config", config, "--port", str(self.port), *args]
            with open(log, "w") as out:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                             env=env)
            if self._wait_healthy(timeout, last=attempt == PORT_ATTEMPTS - 1):
                return

    def _wait_healthy(self, timeout: float, last: bool) -> bool:
        """True once healthy; False when the process exited because its port was taken (and another try is
        left); RuntimeError otherwise."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None:
                if not last and f"Failed to bind to address '127.0.0.1:{self.port}'" in self.output():
                    return False
                raise RuntimeError(f"synflux-serve exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"synflux-serve not healthy after {timeout:.0f} s:\n{self.output()}")
            time.sleep(0.5)
        return True

    def url(self, path: str = "", scheme: str = "http") -> str:
        return f"{scheme}{'s' if self.ssl else ''}://127.0.0.1:{self.port}{path}"

    def healthy(self) -> bool:
        try:
            return urllib.request.urlopen(self.url("/healthz"), timeout=2, context=self.ssl).read() == b"OK\n"
        except OSError:
            return False

    def output(self) -> str:
        return Path(self.log).read_text(errors="replace")[-4000:]

    def connect(self, key: str | None = None):
        """A websocket as openpi's client opens it (``key`` None: the server's key); returns it and the
        metadata frame."""
        from websockets.sync.client import connect
        key = self.key if key is None else key
        headers = {"Authorization": f"Api-Key {key}"} if key else None
        ws = connect(self.url("/", "ws"), compression=None, max_size=None, additional_headers=headers,
                     open_timeout=30, ssl=self.ssl)
        return ws, wire.unpack(ws.recv(timeout=30), 1 << 20)

    def stop(self, timeout: float = 90.0) -> int:
        """SIGINT, then the exit status (killed, and -9, when it outlives ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
                return -9
        return self.proc.returncode
