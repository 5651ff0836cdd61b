"""`llmopt serve` as a child process: start it, wait until it answers, stop it with a signal.

    with ServerProcess(["--model", "tiny", "--threads", "1"]) as server:
        print(server.url)                  # http://127.0.0.1:<free port>
    print(server.returncode)               # 0: it shut down cleanly on SIGINT

Tests, the load benchmark and lesson 08 all run the real server this way: a separate
process, reached only over HTTP, as any client would reach it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def thread_env(threads: int) -> dict[str, str]:
    """The environment that gives a child process `threads` threads: OpenMP's count, and MKL's, which
    torch's matmuls follow instead where it is set (a parent's MKL_NUM_THREADS=2 gave a one-thread
    server two threads in its matmuls)."""
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


class ServerProcess:
    def __init__(self, args: list[str] | None = None, host: str = "127.0.0.1", port: int | None = None,
                 threads: int | None = 1, env: dict[str, str] | None = None):
        self.host, self.port = host, port or free_port(host)
        self.args = list(args or [])
        if threads is not None and "--threads" not in self.args:
            self.args += ["--threads", str(threads)]
        self.env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
                    **(thread_env(threads) if threads else {}), **(env or {})}
        self.proc: subprocess.Popen | None = None
        self.log_path: str | None = None
        self.returncode: int | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "llmopt", "serve", "--host", self.host, "--port", str(self.port), *self.args]

    def start(self, timeout: float = 180.0) -> ServerProcess:
        """Start the server and wait until /health answers 200 (the model is loaded)."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> ServerProcess:
        """Start the process and return at once (see wait_ready, start_all)."""
        log = tempfile.NamedTemporaryFile("w", prefix="llmopt-serve-", suffix=".log", delete=False)
        self.log_path = log.name
        self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        log.close()
        return self

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        """Poll /health until it answers 200; `health_seen` keeps each state it reported on the
        way ("no answer" while the port is closed, then "loading", then "ok")."""
        if self.proc is None:
            raise RuntimeError("the server was never launched")
        self.health_seen: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llmopt serve exited with {self.proc.returncode} while starting:\n{self.log()}")
            state = self._health()
            if not self.health_seen or self.health_seen[-1] != state:
                self.health_seen.append(state)
            if state == "ok":
                return self
            time.sleep(0.2)
        self.stop(signal.SIGKILL)
        raise RuntimeError(f"llmopt serve did not answer /health within {timeout} s:\n{self.log()}")

    def _health(self) -> str:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return json.loads(r.read()).get("status", "?")
        except urllib.error.HTTPError as e:  # 503 while loading, draining or failed
            try:
                return json.loads(e.read()).get("status", "?")
            except ValueError:
                return f"HTTP {e.code}"
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return "no answer"

    def log(self) -> str:
        if self.log_path is None:
            return ""
        with open(self.log_path) as f:
            return f.read()

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        """Send `sig` and wait for the exit status (killed if it is not gone within `timeout`)."""
        if self.proc is None:
            raise RuntimeError("the server was never started")
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.returncode = self.proc.returncode
        return self.returncode

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        if self.stop() == 0 and self.log_path is not None:
            os.unlink(self.log_path)  # kept for a look when the exit was not clean


class RouterProcess(ServerProcess):
    """`llmopt router` (llmopt/server/disagg_router.py) in front of a prefill and a decode server, as a
    child process; ready when both servers are."""

    def __init__(self, prefill_url: str, decode_url: str, host: str = "127.0.0.1", port: int | None = None):
        super().__init__(["--prefill", prefill_url, "--decode", decode_url], host, port, threads=None)

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "llmopt", "router", "--host", self.host, "--port", str(self.port), *self.args]


def start_all(servers: list[ServerProcess], timeout: float = 180.0) -> list[ServerProcess]:
    """Launch every server, then wait for each: they load their models at the same time.
    If one fails to start, the others are stopped before the error is raised."""
    try:
        for s in servers:
            s.launch()
        for s in servers:
            s.wait_ready(timeout)
    except BaseException:
        for s in servers:
            if s.proc is not None:
                s.stop(signal.SIGKILL)
        raise
    return servers
