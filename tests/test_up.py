"""The README's first command, as a newcomer runs it: migrate, bootstrap, then `manage.py up`
on embedded defaults (SQLite, the embedded Redis, CPU slots) in a fresh folder."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from django.core.management import CommandError, call_command

from config import tls
from console.management.commands import up
from console.management.commands.up import Child, _stop_children, port_free, web_argv
from tests.support import free_port, wait_for_http

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::urllib3.exceptions.InsecureRequestWarning")
def test_up_starts_everything_on_embedded_defaults_and_stops_cleanly(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")}
    https_port = free_port()
    env.update(EDT_VAR_DIR=str(tmp_path / "var"), EDT_EMBEDDED_REDIS_PORT=str(free_port()),
               EDT_ADMIN_PASSWORD="newcomer-pass-1", PYTHONUNBUFFERED="1",
               EDT_HTTPS_PORT=str(https_port))
    env.pop("DJANGO_SETTINGS_MODULE", None)
    manage = [sys.executable, "manage.py"]
    for step in (["migrate", "--noinput"], ["bootstrap", "--demo"]):
        done = subprocess.run([*manage, *step], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=180)
        assert done.returncode == 0, done.stdout + done.stderr
    assert "Admin user: admin  password: newcomer-pass-1" in done.stdout

    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as sink:
        up = subprocess.Popen([*manage, "up", "--port", str(port), "--cpu-slots", "2"], cwd=ROOT,
                              env=env, stdout=sink, stderr=subprocess.STDOUT)

    def output() -> str:
        return log.read_text(errors="replace")

    try:
        deadline = time.monotonic() + 120
        while "Log in as admin / newcomer-pass-1" not in output():
            assert up.poll() is None, "up exited early:\n" + output()
            assert time.monotonic() < deadline, "no URL printed in 120 s:\n" + output()
            time.sleep(0.2)
        assert f"http://127.0.0.1:{port}/" in output()

        base = f"http://127.0.0.1:{port}"
        token = _wait_for_the_host(base, output)
        assert requests.get(f"{base}/login/", timeout=5).status_code == 200
        _logon_over_https_as_ibm_dlicmd_does(https_port, tmp_path / "var", output)
        _our_dlicmd_logs_on_to_either_port(port, https_port, tmp_path)
        _train_the_demo(base, token, tmp_path / "var", output)
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0, output()
    # No child outlives the supervisor.
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", leftovers.stdout
    for name in ("redis", "web", "scheduler", "events", "agent"):
        assert re.search(rf"^starting {name}$", output(), re.MULTILINE), output()
    # Every service stopped while Redis still answered: none lost its last events or died
    # of the connection closing under it.
    assert "Traceback" not in output(), output()[-8000:]
    assert "could not publish" not in output(), output()[-8000:]


class _Process:
    """A child's process as ``up`` stops it: it records what it is told and, when
    ``hangs``, does not exit on SIGTERM."""

    def __init__(self, name: str, events: list[str], hangs: bool = False) -> None:
        self.name, self.events, self.hangs, self.returncode = name, events, hangs, None

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.events.append(f"terminate {self.name}")

    def kill(self) -> None:
        self.events.append(f"kill {self.name}")
        self.hangs = False

    def wait(self, timeout: float | None = None) -> int:
        if self.hangs:
            raise subprocess.TimeoutExpired(self.name, timeout)
        self.events.append(f"exited {self.name}")
        self.returncode = 0
        return 0


def test_up_stops_redis_only_once_every_service_has_exited():
    events: list[str] = []
    names = ("redis", "web", "scheduler", "events", "agent")
    children = [Child(n, [], proc=_Process(n, events, hangs=n == "agent")) for n in names]
    _stop_children(children)
    # The services in reverse start order (the agent first); the hung one is killed.
    assert events[:4] == [f"terminate {n}" for n in reversed(names[1:])], events
    assert "kill agent" in events
    redis_told = events.index("terminate redis")
    assert all(events.index(f"exited {n}") < redis_told for n in names[1:]), events
    assert events[-1] == "exited redis", events


def test_up_stops_the_redis_it_started_when_redis_never_answers(monkeypatch, settings,
                                                                tmp_path):
    events: list[str] = []

    def never_answers(url: str) -> None:
        raise CommandError("Redis at redis://127.0.0.1:6390/0 did not answer within 15 s")

    monkeypatch.setattr(up.Command, "_start",
                        lambda self, child, env: setattr(child, "proc",
                                                         _Process(child.name, events)))
    monkeypatch.setattr(up, "_wait_for_redis", never_answers)
    monkeypatch.setattr(up.signal, "signal", lambda *args: None)  # keep pytest's Ctrl-C
    monkeypatch.delenv("REDIS_URL", raising=False)  # the embedded Redis, then
    settings.VAR_DIR = tmp_path
    with pytest.raises(CommandError, match="did not answer"):
        call_command("up", "--https-port", "0", "--no-agent")
    # Nothing else was started, and the Redis that was is not left behind.
    assert events == ["terminate redis", "exited redis"]


def _wait_for_the_host(base: str, output) -> str:
    """The web server answers, the API takes the printed credentials, and the host agent
    registers this machine with its CPU slots: the admin's API token."""
    deadline = time.monotonic() + 90
    hosts: list = []
    while not hosts:
        assert time.monotonic() < deadline, "no host registered in 90 s:\n" + output()
        try:
            token = requests.post(f"{base}/api/v1/auth/token/", timeout=15, data={
                "username": "admin", "password": "newcomer-pass-1"}).json()["token"]
            hosts = requests.get(f"{base}/api/v1/hosts/", timeout=15, headers={
                "Authorization": f"Token {token}"}).json()["results"]
        except (requests.ConnectionError, requests.Timeout, KeyError):
            # Not up yet, or slow to answer on a loaded machine (the password's hash takes a
            # CPU second): tried again until the deadline.
            pass
        if not hosts:
            time.sleep(0.5)
    assert hosts[0]["state"] == "UP" and hosts[0]["cpu_slots"] == 2
    return token


def _logon_over_https_as_ibm_dlicmd_does(https_port: int, var: Path, output) -> None:
    """``up`` serves https beside http with the certificate it made: IBM's dlicmd.py logs on
    over https only (``verify=False``), and the certificate verifies when named."""
    assert f"https://127.0.0.1:{https_port}/ (self-signed certificate " in output()
    cert = var / "tls" / tls.CERT_NAME
    assert cert.stat().st_mode & 0o777 == 0o600
    url = f"https://127.0.0.1:{https_port}"
    assert requests.get(f"{url}/login/", timeout=10, verify=str(cert)).status_code == 200
    logon = requests.get(f"{url}/auth/v1/logon", timeout=10, verify=False,  # noqa: S501
                         auth=("admin", "newcomer-pass-1"), headers={"Accept": "application/json"})
    assert logon.status_code == 200 and logon.json()["accessToken"], logon.text


def _our_dlicmd_logs_on_to_either_port(port: int, https_port: int, tmp_path: Path) -> None:
    """Given only host and port, our dlicmd finds http on the server's http port (whose answer
    to a TLS hello must not hold it up: the timeout bounds the probe) and https on the other."""
    env = {**os.environ, "DLICMD_TOKEN_FILE": str(tmp_path / ".dlicmd")}
    for where, extra, scheme in ((port, [], "http"), (https_port, ["--insecure"], "https")):
        done = subprocess.run(  # noqa: S603
            [sys.executable, "dlicmd.py", "--logon", "--rest-host", "127.0.0.1", "--rest-port",
             str(where), "--username", "admin", "--password", "newcomer-pass-1", *extra],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=8,
        )
        assert done.returncode == 0, done.stderr
        assert f"Logged on to {scheme}://127.0.0.1:{where} as admin" in done.stdout


def _train_the_demo(base: str, token: str, var: Path, output) -> None:
    """Train the demo model as a newcomer would, on the defaults: as root (CI), the job runs
    under its owner's own account, with the project's own interpreter."""
    auth = {"Authorization": f"Token {token}"}

    def get(path: str):
        return requests.get(f"{base}/api/v1/{path}", timeout=10, headers=auth).json()

    model = next(m for m in get("models/")["results"] if m["name"] == "edt-demo")
    group = next(g for g in get("instance-groups/")["results"] if g["name"] == "default")
    sent = requests.post(f"{base}/api/v1/jobs/", timeout=10, headers=auth, json={
        "model": model["id"], "instance_group": group["id"], "max_workers": 2})
    assert sent.status_code == 201, sent.text
    job = sent.json()
    deadline = time.monotonic() + 240
    while (job := get(f"jobs/{job['id']}/"))["state"] not in ("FINISHED", "FAILED", "KILLED"):
        assert time.monotonic() < deadline, f"the demo job did not end in 240 s: {job}"
        time.sleep(1)
    assert job["state"] == "FINISHED", (job, output()[-5000:])
    if os.geteuid() == 0:
        owner = get("me/")["id"]
        assert (var / "results" / f"job-{job['id']}").stat().st_uid == 200_000 + owner


# --- https: the certificate and the web server's command line -------------------------


def test_the_self_signed_certificate_is_made_once_private_and_reused(tmp_path):
    made = tls.certificate(tmp_path / "var", env={}, host="0.0.0.0")  # noqa: S104
    assert made.self_signed and made.cert.parent == tmp_path / "var" / "tls"
    assert made.cert.parent.stat().st_mode & 0o777 == 0o700
    for path in (made.cert, made.key):
        assert path.stat().st_mode & 0o777 == 0o600
    first = (made.cert.read_bytes(), made.key.read_bytes())
    again = tls.certificate(tmp_path / "var", env={})
    assert again == made and (again.cert.read_bytes(), again.key.read_bytes()) == first
    # An expired (or unreadable) certificate is replaced.
    made.cert.write_text("not a certificate")
    assert tls.certificate(tmp_path / "var", env={}).cert.read_bytes() != first[0]


def test_the_admins_certificate_is_used_as_named(tmp_path):
    ours = tls.certificate(tmp_path / "var", env={})
    named = tls.certificate(tmp_path / "other", env={
        "EDT_TLS_CERT": str(ours.cert), "EDT_TLS_KEY": str(ours.key)})
    assert (named.cert, named.key, named.self_signed) == (ours.cert, ours.key, False)
    assert not (tmp_path / "other" / "tls").exists()
    with pytest.raises(tls.TlsError, match="both EDT_TLS_CERT and EDT_TLS_KEY"):
        tls.certificate(tmp_path / "var", env={"EDT_TLS_CERT": str(ours.cert)})
    with pytest.raises(tls.TlsError, match="is not a readable file"):
        tls.certificate(tmp_path / "var", env={"EDT_TLS_CERT": str(ours.cert),
                                               "EDT_TLS_KEY": str(tmp_path / "missing.pem")})


@pytest.mark.slow
def test_the_web_server_serves_https_beside_http_with_that_certificate(tmp_path):
    var = tmp_path / "va:r=x y"  # a path with characters a command line could trip on
    made = tls.certificate(var, env={})
    port, https_port = free_port(), free_port()
    argv = web_argv("127.0.0.1", port, https_port, made)
    assert argv[1:3] == ["-m", "config.web_server"] and str(made.cert) in argv
    env = {k: v for k, v in os.environ.items() if k != "DJANGO_SETTINGS_MODULE"}
    env.update(EDT_VAR_DIR=str(var), DATABASE_URL=f"sqlite:///{var / 'db.sqlite3'}")
    log = tmp_path / "web.log"
    with log.open("w") as sink:
        web = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=sink,  # noqa: S603
                               stderr=subprocess.STDOUT)
    try:
        answer = wait_for_http(f"https://127.0.0.1:{https_port}/login/", web, log, 60,
                               verify=str(made.cert))
        assert answer.status_code == 200
        assert requests.get(f"http://127.0.0.1:{port}/login/", timeout=5).status_code == 200
    finally:
        web.terminate()
        web.wait(timeout=20)


def test_a_busy_https_port_is_seen_before_the_web_server_starts():
    with socket.create_server(("127.0.0.1", 0)) as busy:
        assert not port_free("127.0.0.1", busy.getsockname()[1])
    assert port_free("127.0.0.1", free_port())
