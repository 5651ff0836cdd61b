"""The repository's nginx load balancer (deploy/nginx.conf), run on this machine in front of
`llmopt serve` replicas on loopback ports: no Docker, the same file.

    with ServerProcess([...]) as a, ServerProcess([...]) as b:
        with NginxProcess([a.url, b.url]) as lb:
            httpx.post(f"{lb.url}/v1/completions", json=...)    # answered by a or b

`render_nginx_conf` changes only what differs outside the compose network: the replicas'
addresses (compose: the `llmopt` service name; here: 127.0.0.1 ports), the port nginx listens
on, and where it writes its pid, logs and temporary files (a folder of its own, so that no
root-owned system path is needed). Every routing rule (least_conn, retries, timeouts,
unbuffered streaming) is the shipped one. Tests and lesson 11 use it with Debian's `nginx`.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from llmopt.package_data import DEPLOY_DIR, deploy_file
from llmopt.server.process import free_port

UPSTREAM_SERVER = re.compile(r"^(\s*)server llmopt:8000( [^;]*)?;", re.M)


def find_tool(name: str, also: tuple[str, ...] = ()) -> str | None:
    """A system tool the deployment lesson uses when it is there (nginx, promtool), or None.

    LLMOPT_<NAME> (LLMOPT_NGINX, LLMOPT_PROMTOOL) overrides the search: a path to the binary, or
    "none" to act as if it were not installed (what a learner on Colab or Binder meets, and how the
    tests run lesson 11 without its tools). Else PATH, then the `also` places (Debian's /usr/sbin)."""
    override = os.environ.get(f"LLMOPT_{name.upper()}", "").strip()
    if override.lower() == "none":
        return None
    if override:
        if not (Path(override).is_file() and os.access(override, os.X_OK)):
            raise FileNotFoundError(f"LLMOPT_{name.upper()}={override!r} is not an executable file; "
                                    "give the binary's path, or 'none' to run without it")
        return override
    return shutil.which(name) or next((p for p in also if Path(p).is_file()), None)


def find_nginx() -> str | None:
    """The nginx binary (LLMOPT_NGINX, PATH, or Debian's /usr/sbin/nginx), or None."""
    return find_tool("nginx", also=("/usr/sbin/nginx",))


def find_promtool() -> str | None:
    """Prometheus's promtool (LLMOPT_PROMTOOL or PATH), or None."""
    return find_tool("promtool")


def render_nginx_conf(replicas: list[str], port: int, workdir: str | Path, template: str | None = None) -> str:
    """deploy/nginx.conf for `replicas` ("127.0.0.1:8001" or "http://127.0.0.1:8001"), listening on
    127.0.0.1:`port`, with its pid, logs and temporary files under `workdir`."""
    if not replicas:
        raise ValueError("replicas is empty: give at least one host:port")
    text = template if template is not None else deploy_file("nginx.conf").read_text()
    workdir = Path(workdir)
    match = UPSTREAM_SERVER.search(text)
    if match is None:
        raise ValueError("the template has no 'server llmopt:8000 ...;' line in its upstream block")
    indent, params = match.group(1), match.group(2) or ""
    servers = "\n".join(f"{indent}server {r.removeprefix('http://').rstrip('/')}{params};" for r in replicas)
    text = UPSTREAM_SERVER.sub(lambda _: servers, text, count=1)
    subs = [(r"^pid [^;]*;", f"pid {workdir / 'nginx.pid'};"),
            (r"^error_log [^;]*;", f"error_log {workdir / 'error.log'} warn;"),
            (r"^(\s*)access_log [^ ;]+", rf"\g<1>access_log {workdir / 'access.log'}"),
            (r"^(\s*)listen 80;", rf"\g<1>listen 127.0.0.1:{port};")]
    for pattern, repl in subs:
        text, n = re.subn(pattern, repl, text, count=1, flags=re.M)
        if n != 1:
            raise ValueError(f"the template has no line matching {pattern!r}")
    temp = "".join(f"    {kind}_temp_path {workdir / kind};\n"
                   for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return text.replace("http {\n", "http {\n" + temp, 1)


class NginxProcess:
    """nginx with the rendered deploy/nginx.conf, in the foreground as a child process."""

    def __init__(self, replicas: list[str], port: int | None = None, binary: str | None = None):
        self.binary = binary or find_nginx()
        if self.binary is None:
            raise FileNotFoundError("nginx is not installed (Debian / Ubuntu: apt-get install nginx)")
        self.replicas, self.port = list(replicas), port or free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix="llmopt-nginx-"))
        self.workdir.chmod(0o755)  # started as root, nginx's workers run as nobody and use the temp folders
        self.conf_path = self.workdir / "nginx.conf"
        self.conf_path.write_text(render_nginx_conf(self.replicas, self.port, self.workdir))
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> NginxProcess:
        # -e: the startup error log (before the config's error_log applies) goes to our folder too
        cmd = [self.binary, "-p", str(self.workdir), "-c", str(self.conf_path), "-e", str(self.workdir / "error.log"),
               "-g", "daemon off;"]
        check = subprocess.run(cmd[:-2] + ["-t"], capture_output=True, text=True)
        if check.returncode != 0:
            raise RuntimeError(f"nginx -t rejected the rendered config:\n{check.stderr}")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.proc.returncode}:\n{self.error_log()}")
            try:  # any HTTP answer (even a 503 while replicas load) means nginx listens
                urllib.request.urlopen(f"{self.url}/health", timeout=2).close()
                return self
            except urllib.error.HTTPError:
                return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"nginx did not listen on {self.url} within {timeout} s:\n{self.error_log()}")

    def access_log(self) -> list[str]:
        path = self.workdir / "access.log"
        return path.read_text().splitlines() if path.is_file() else []

    def error_log(self) -> str:
        path = self.workdir / "error.log"
        return path.read_text() if path.is_file() else ""

    def stop(self) -> None:
        """SIGTERM: nginx's fast stop (open connections closed; SIGQUIT would wait for them)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> NginxProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
