"""Nobody but a job's own processes and its host agent can talk to the job's driver.

A victim job trains for real: its driver and two workers started by the real supervisor
(``run_driver`` / ``run_worker``, as a host agent does, under the owner's own account when the
test runs as root, as CI does), the end-to-end tests' model script, uploaded by its owner.
While it trains, another user's client (under that user's account when root) connects to
every TCP port the driver's processes listen on, found the way an attacker would on a shared
host, and sends every operation of the protocol: once without any secret, once answering the
challenge with a wrong secret, once with an empty one. Each connection must be closed with
nothing served; the victim must keep training and end FINISHED with its model saved. Beside
it: the handshake itself, the address the driver binds, and what a stop that the console
never asked for makes of a job.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from django.db import connection
from django.utils import timezone

from agent import driver_supervisor, supervisor, worker_supervisor
from agent.accounts import job_accounts
from agent.children import registry
from agent.keys import driver_secret
from jobs import states
from jobs.models import SlotAllocation, TrainingJob
from runtime import control, wire
from tests.e2e.harness import SCRIPT as POINTS_MODEL
from tests.e2e.harness import wait_until
from tests.support import enterable_roots, tar_gz

psutil = pytest.importorskip("psutil")

UID_BASE = 200_000  # a root agent's default: each user's jobs run as this + the user's id

# The attacker's client: the standard library only (it is nobody's job and has no torch),
# speaking the driver's framing by hand. It prints, per port, operation and way of asking,
# "refused" when all it got back was the driver's challenge and a closed connection.
ATTACKER = r"""
import hashlib, hmac, json, secrets, socket, struct, sys

targets, victim = json.loads(sys.argv[1]), sys.argv[2]
POISON = b"\x80\x04poisoned-state" * 64
OPS = {
    "stop": ({"op": "stop", "checkpoint": False}, b""),
    "status": ({"op": "status"}, b""),
    "fetch_state": ({"op": "fetch_state", "min_version": 0, "timeout": 1}, b""),
    "upload_state": ({"op": "upload_state", "kind": "final", "worker_id": victim}, POISON),
    "error": ({"op": "error", "worker_id": victim, "message": "pwned"}, b""),
    "leave": ({"op": "leave", "worker_id": victim, "wait": False}, b""),
    "link": ({"op": "link", "worker_id": victim}, b""),
    "join": ({"op": "join", "worker_id": "intruder", "timeout": 1}, b""),
    "sync": ({"op": "sync", "worker_id": victim, "generation": 1, "global_step": 0,
              "failed": True, "timeout": 1}, b""),
    "done": ({"op": "done", "worker_id": victim}, b""),
    "upload_onnx": ({"op": "upload_onnx", "worker_id": victim}, POISON),
    "store": ({"op": "store", "call": "num_keys"}, b""),
}


def frame(header, payload=b""):
    data = json.dumps(dict(header, payload_len=len(payload))).encode()
    return struct.pack(">I", len(data)) + data + payload


def read_frame(sock):
    def exact(n):
        buf = b""
        while len(buf) < n:
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise EOFError
            buf += chunk
        return buf
    (size,) = struct.unpack(">I", exact(4))
    header = json.loads(exact(size))
    exact(int(header.get("payload_len") or 0))
    return header


def attempt(host, port, op, how):
    header, payload = OPS[op]
    got = []
    with socket.create_connection((host, port), timeout=20) as sock:
        if how == "no secret":
            sock.sendall(frame(header, payload))
        else:
            challenge = read_frame(sock)
            got.append(challenge)
            key = b"" if how == "empty secret" else secrets.token_hex(32).encode()
            nonce = secrets.token_hex(32)
            message = "\0".join(("client", str(challenge.get("challenge")), nonce)).encode()
            mac = hmac.new(key, message, hashlib.sha256).hexdigest()
            sock.sendall(frame({"nonce": nonce, "mac": mac}) + frame(header, payload))
        try:
            while True:
                got.append(read_frame(sock))
        except (EOFError, ConnectionError):
            pass
    answers = [g for g in got if set(g) - {"challenge", "payload_len"}]
    return "refused" if not answers else answers


report = {}
for host, port in targets:
    for op in OPS:
        for how in ("no secret", "wrong secret", "empty secret"):
            report[f"{port} {op} ({how})"] = attempt(host, port, op, how)
print(json.dumps(report))
"""


# --- the handshake ------------------------------------------------------------------------------


def _serve_once(secret: str, outcome: dict) -> tuple[str, threading.Thread]:
    """A one-connection server doing the driver's side of the handshake, then echoing."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            sock, _ = listener.accept()
            with sock:
                try:
                    wire.accept(sock, secret, timeout=5)
                except wire.AuthenticationError as exc:
                    outcome["refused"] = str(exc)
                    return
                header, _ = wire.recv_msg(sock)
                wire.send_msg(sock, {"echo": header})
                outcome["served"] = header

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return f"127.0.0.1:{listener.getsockname()[1]}", thread


def test_the_handshake_accepts_the_jobs_secret_and_refuses_any_other() -> None:
    outcome: dict = {}
    addr, thread = _serve_once("s3cret", outcome)
    reply, _ = wire.call(addr, "s3cret", {"op": "status"})
    thread.join(10)
    assert reply["echo"]["op"] == "status" and outcome == {"served": {"op": "status"}}

    outcome = {}
    addr, thread = _serve_once("s3cret", outcome)
    with pytest.raises(wire.AuthenticationError, match="refused this job secret"):
        wire.call(addr, "guess", {"op": "stop"})
    thread.join(10)
    assert "without the job's secret" in outcome["refused"] and "served" not in outcome

    # Both ways: a client gives nothing to an endpoint that cannot prove it holds the secret
    # (someone who took a dead driver's port), and a secret is always required.
    outcome = {}
    addr, thread = _serve_once("impostor", outcome)
    with pytest.raises(wire.AuthenticationError):
        wire.call(addr, "s3cret", {"op": "upload_state"}, b"weights")
    thread.join(10)
    assert "served" not in outcome
    with pytest.raises(ValueError, match="EDT_JOB_SECRET"):
        wire.connect(addr, "")


def test_each_attempt_of_each_job_has_its_own_secret() -> None:
    secrets = {driver_secret(job, attempt) for job in (1, 2) for attempt in (1, 2)}
    assert len(secrets) == 4 and all(len(s) == 64 for s in secrets)
    assert driver_secret(1, 1) == driver_secret(1, 1)


def _own_addresses() -> list[str]:
    return [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family == socket.AF_INET]


@pytest.mark.django_db
def test_a_driver_binds_the_hosts_own_address_not_every_interface(cluster, settings) -> None:
    from resources.models import Host

    settings.EDT_DRIVER_HOST = ""
    assert driver_supervisor.driver_bind_host("host1") == "127.0.0.1"  # registered as 127.0.0.1
    own = next((ip for ip in _own_addresses() if not ip.startswith("127.")), None)
    cases = [("", "127.0.0.1"), ("localhost", "127.0.0.1"), ("127.0.1.1", "127.0.0.1"),
             # Not an address of this machine (another's, or one behind a NAT): loopback.
             ("198.51.100.7", "127.0.0.1")]
    if own:
        cases.append((own, own))
    for address, bind in cases:
        Host.objects.filter(name="host2").update(address=address)
        assert driver_supervisor.driver_bind_host("host2") == bind, address
    settings.EDT_DRIVER_HOST = "0.0.0.0"  # only when configured
    assert driver_supervisor.driver_bind_host("host2") == "0.0.0.0"


# --- a real job under attack -------------------------------------------------------------------


class Victim:
    """A job of the model owner's, trained by a driver and two workers under the supervisor,
    slowly until ``hurry()`` (so that there is time to attack it while it trains)."""

    def __init__(self, job: TrainingJob, hosts) -> None:
        self.job = job
        self.result = Path(job.result_dir)
        self.outcomes: dict[str, str] = {}
        self.threads: list[threading.Thread] = []
        self.allocs = [
            SlotAllocation.objects.create(job=job, host=hosts[0], slot=i,
                                          worker_id=f"host1-slot{i}-{job.pk}-{time.time_ns()}")
            for i in range(2)
        ]

    def _supervise(self, name: str, fn, *args) -> None:
        def run() -> None:
            try:
                self.outcomes[name] = fn(*args)
            finally:
                connection.close()

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self.threads.append(thread)

    def start(self) -> None:
        TrainingJob.objects.filter(pk=self.job.pk).update(
            state=states.RUNNING, attempt=1, heartbeat=timezone.now())
        self._supervise("driver", driver_supervisor.run_driver, self.job.pk, 1, "host1")
        for alloc in self.allocs:
            self._supervise(alloc.worker_id, worker_supervisor.run_worker, alloc.pk)

    def steps(self) -> list[dict]:
        path = self.result / "steps.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def driver_log(self) -> str:
        path = self.result / "log" / "driver" / "stdout"
        return path.read_text(errors="replace") if path.exists() else "(no driver log)"

    def hurry(self) -> None:
        (self.result / "fast").touch()

    def wait(self, timeout: float = 120) -> None:
        self.hurry()
        for thread in self.threads:
            thread.join(timeout)
        assert not any(t.is_alive() for t in self.threads), self.driver_log()

    def end(self) -> None:
        """Teardown: whatever still runs is ended."""
        self.hurry()
        supervisor.agent_stopping.set()
        try:
            for thread in self.threads:
                thread.join(30)
        finally:
            supervisor.agent_stopping.clear()


def _own_accounts(settings) -> bool:
    """Jobs under their owners' own accounts, as a root agent runs them by default, when this
    machine lets those accounts run the interpreter (the agent's start-up check, which opens
    the way when it can); else jobs run as the agent, and the attack is the same."""
    settings.EDT_RUN_AS_UID_BASE = UID_BASE if os.geteuid() == 0 else 0
    settings.EDT_RUN_AS_USER = ""
    settings.EDT_SERVICE_GID = ""
    settings.EDT_USER_PYTHON = sys.executable
    if not settings.EDT_RUN_AS_UID_BASE:
        return False
    if job_accounts.check().ok:
        return True
    settings.EDT_RUN_AS_UID_BASE = 0
    job_accounts.refusal = None
    return False


@pytest.fixture
def victim(owner, cluster, settings, own_events_stream):
    if connection.vendor == "sqlite" and "memory" in str(connection.settings_dict["NAME"]):
        pytest.skip("threads cannot share an in-memory SQLite test database")
    from datasets.services import dataset_create_from_archive
    from jobs.services import job_submit
    from models.services import model_create_from_archive

    root = enterable_roots(settings, "edt-driver-link-")
    settings.EDT_DRIVER_HOST = ""
    isolated = _own_accounts(settings)
    dataset = dataset_create_from_archive(owner=owner, name="victim-data", archive=tar_gz(
        {"vdata/train/x.txt": "x", "vdata/test/y.txt": "y"}))
    code = tar_gz({"vmodel/main.py": POINTS_MODEL.read_text()})
    model = model_create_from_archive(owner=owner, name="victim-model", dataset=dataset,
                                      archive=code)
    job = job_submit(user=owner, model=model, instance_group=cluster["instance_group"],
                     max_workers=2)
    result = Path(job.result_dir)
    TrainingJob.objects.filter(pk=job.pk).update(env_vars={
        "TEST_EPOCHS": "3", "TEST_SAMPLES": "256", "TEST_BATCH": "4", "TEST_ENGINES": "2",
        "EDT_MIN_WORKERS": "2", "TEST_DELAY_S": "0.05", "TEST_FAST_FILE": str(result / "fast"),
        "EDT_STEP_LOG": str(result / "steps.jsonl"), "EDT_PEER_TIMEOUT_S": "10",
    })
    job.refresh_from_db()
    v = Victim(job, cluster["hosts"])
    v.uid = UID_BASE + owner.pk if isolated else os.geteuid()
    try:
        yield v
    finally:
        v.end()
        job_accounts.refusal = None
        shutil.rmtree(root, ignore_errors=True)


def _listening(pid: int) -> list[tuple[str, int]]:
    """Every TCP address the process ``pid`` and its descendants listen on."""
    found = []
    root = psutil.Process(pid)
    for proc in [root, *root.children(recursive=True)]:
        for conn in proc.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                found.append((conn.laddr.ip, conn.laddr.port))
    return sorted(set(found))


def _attacker_account(uid: int) -> tuple[list[str], dict]:
    """How to run the attacker: as another account when we can switch to one (root), with an
    interpreter that account may run; else as ourselves (the secret, not the account, is what
    the driver checks)."""
    if os.geteuid() == 0:
        for python in ("/usr/bin/python3", "/usr/local/bin/python3", sys.executable):
            try:
                subprocess.run([python, "-c", "import hmac, json"], user=uid, group=uid,
                               extra_groups=[], check=True, capture_output=True, cwd="/")
                return [python], {"user": uid, "group": uid, "extra_groups": []}
            except (OSError, subprocess.CalledProcessError):
                continue
    return [sys.executable], {}


def _attack(targets: list[tuple[str, int]], victim_worker: str, uid: int) -> dict:
    python, account = _attacker_account(uid)
    proc = subprocess.run([*python, "-c", ATTACKER, json.dumps(targets), victim_worker],
                          capture_output=True, text=True, timeout=300, cwd="/",
                          env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, **account)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_another_users_client_cannot_drive_or_read_a_running_job(victim, other) -> None:
    victim.start()
    wait_until(lambda: len(victim.steps()) >= 3, "the victim to train", 90,
               on_fail=victim.driver_log)
    child = registry.get_child(f"driver:{victim.job.pk}:1")
    assert psutil.Process(child.proc.pid).uids().real == victim.uid
    targets = _listening(child.proc.pid)
    # One port: the control endpoint (the group's key-value store is served on it too), on
    # the host's own address rather than every interface.
    assert len(targets) == 1 and targets[0][0] == "127.0.0.1", targets

    report = _attack(targets, victim.allocs[0].worker_id, UID_BASE + other.pk)
    assert len(report) == 12 * 3
    assert {k: v for k, v in report.items() if v != "refused"} == {}

    # It kept training through the attack, and still does.
    after = victim.steps()[-1]["global_step"]
    wait_until(lambda: victim.steps()[-1]["global_step"] >= after + 3,
               "the victim to keep training", 60, on_fail=victim.driver_log)
    assert victim.outcomes == {}
    victim.wait()
    assert victim.outcomes["driver"] == states.FINISHED, victim.driver_log()
    job = TrainingJob.objects.get(pk=victim.job.pk)
    assert job.state == states.FINISHED and job.error == ""
    assert job.attempt == 1  # no restart either
    # Its result is its own: every epoch trained, the final model saved from its workers.
    steps = victim.steps()
    assert {s["epoch"] for s in steps} == {0, 1, 2} and {s["size"] for s in steps} == {2}
    import torch

    final = torch.load(victim.result / "model" / "train" / "model_epoch_final.pth",
                       weights_only=True)
    assert final and all(torch.isfinite(t).all() for t in final.values())
    # Each refused connection is in the victim's driver log once, with where it came from.
    refusals = [line for line in victim.driver_log().splitlines()
                if "refused a connection from 127.0.0.1:" in line]
    assert len(refusals) == len(report), refusals[:3]


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_stop_the_console_never_asked_for_fails_the_job_and_never_finishes_it(victim) -> None:
    victim.start()
    wait_until(lambda: len(victim.steps()) >= 3, "the victim to train", 90,
               on_fail=victim.driver_log)
    addr = supervisor.driver_addr(victim.job.pk, 1)
    # Only the job's own processes and its agent hold the secret: such a stop can come from
    # inside the job only (its own script), not from the console.
    control.request_stop(addr, driver_secret(victim.job.pk, 1))
    victim.wait()
    job = TrainingJob.objects.get(pk=victim.job.pk)
    assert victim.outcomes["driver"] == states.FAILED
    assert job.state == states.FAILED and job.error == driver_supervisor.STOPPED_UNASKED
    assert job.events.filter(type="job.failed", message=driver_supervisor.STOPPED_UNASKED).exists()


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_stop_from_the_console_kills_the_job(victim) -> None:
    victim.start()
    wait_until(lambda: len(victim.steps()) >= 3, "the victim to train", 90,
               on_fail=victim.driver_log)
    TrainingJob.objects.filter(pk=victim.job.pk).update(stop_requested_at=timezone.now())
    assert driver_supervisor.stop_job(victim.job.pk) == "stop requested"
    victim.wait()
    job = TrainingJob.objects.get(pk=victim.job.pk)
    assert victim.outcomes["driver"] == states.KILLED and job.state == states.KILLED
