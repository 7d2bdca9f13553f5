"""The dlicmd client's own logic (the live-server flows are in tests/wmla/)."""

import json
import os
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from django.conf import settings

from config import tls
from console.cli import dlicmd


@pytest.mark.slow
def test_it_runs_without_django_installed():
    # Block the import of Django, as on a laptop that only has requests.
    code = (
        "import sys; sys.modules['django'] = None; sys.modules['rest_framework'] = None; "
        "from console.cli import dlicmd; sys.exit(dlicmd.main(['--help']))"
    )
    done = subprocess.run(  # noqa: S603
        [sys.executable, "-c", code], cwd=settings.BASE_DIR, capture_output=True, text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--exec-start edtPyTorch" in done.stdout


def test_the_submitted_args_drop_connection_options_and_shorten_the_model_dir():
    argv = [
        "--exec-start", "edtPyTorch", "--rest-host", "wmla.example.com", "--rest-port", "443",
        "--model-dir", "/home/me/models/resnet/", "--model-main", "main.py", "--jwt-token", "t",
        "--insecure", "-o", "json", "--cs-datastore-meta", "type=fs,data_path=cifar",
        "--", "--lr", "0.1", "two words",
    ]
    assert dlicmd.submitted_args(argv) == (
        "--exec-start edtPyTorch --model-dir resnet --model-main main.py "
        "--cs-datastore-meta type=fs,data_path=cifar -- --lr 0.1 'two words'"
    )


def test_it_reads_the_bare_token_file_wmla_dlicmd_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("DLICMD_TOKEN_FILE", str(tmp_path / "tok"))
    (tmp_path / "tok").write_text("abc.def.ghi")
    assert dlicmd.load_session() == {"token": "abc.def.ghi"}
    dlicmd.save_session({"token": "x", "base_url": "http://h:1"})
    assert dlicmd.load_session()["base_url"] == "http://h:1"
    assert (tmp_path / "tok").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--exec-get"], "expected one argument"),
        (["--exec-get-all"], "--rest-host is required"),
        (["--exec-priority", "1"], "expected 2 arguments"),
        (["--logon"], "--rest-host is required for --logon"),
    ],
)
def test_usage_errors_exit_1_with_a_message(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DLICMD_TOKEN_FILE", str(tmp_path / "none"))
    assert dlicmd.main(argv) == 1
    assert message in capsys.readouterr().err


def test_an_unknown_command_prints_the_help(capsys):
    assert dlicmd.main(["--frobnicate"]) == 1
    assert "Usage:" in capsys.readouterr().out


def test_the_server_offers_the_cli_for_download(client):
    response = client.get("/ui/tools/dlicmd.py")
    assert response.status_code == 200
    body = b"".join(response.streaming_content) if response.streaming else response.content
    assert body == (Path(settings.BASE_DIR) / "console" / "cli" / "dlicmd.py").read_bytes()


def test_the_watch_line_shows_slots_and_progress():
    line = dlicmd.watch_line(
        {
            "id": "alice-7", "state": "RUNNING", "workers": 3, "maxWorkers": 8,
            "targetWorkers": 4, "priority": 5000, "progress": {"epoch": 1, "epochs": 4,
                                                               "iteration": 120},
            "lastMetrics": {"loss": 0.123456}, "slots": [
                {"host": "h1", "slot": 0}, {"host": "h1", "slot": 1}, {"host": "h2", "slot": 0}],
        }
    )
    assert "workers 3/8 (target 4)" in line and "priority 5000" in line
    assert "[#####---------------] epoch 1/4" in line and "iter 120" in line
    assert "loss 0.1235" in line and "slots h1:0,h1:1,h2:0" in line


def test_the_command_is_the_first_word_that_names_one():
    assert dlicmd.command_of(["--rest-host", "h", "--exec-get=alice-1"]) == "--exec-get"
    assert dlicmd.command_of(["--exec-outlogs", "alice-1", "--exec-stop"]) == "--exec-outlogs"
    assert dlicmd.command_of(["--rest-host", "h"]) is None


def test_every_exec_command_needs_an_exec_id(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DLICMD_TOKEN_FILE", str(tmp_path / "tok"))
    dlicmd.save_session({"token": "t", "base_url": "http://127.0.0.1:9"})
    for command in dlicmd.EXEC_COMMANDS:
        assert dlicmd.main([command, ""]) == 1
        assert f"{command} needs an exec id" in capsys.readouterr().err


# --- connecting: the https probe and network errors -------------------------------------------


class FakeServer:
    """A real socket server on 127.0.0.1 that answers HTTP/1.1 with JSON from ``routes``.

    Plain (``tls=None``), a TLS hello gets no answer and the connection stays open, as some servers
    do. With an ``ssl.SSLContext`` it speaks https. ``silent`` takes connections and never
    answers anything."""

    def __init__(self, routes: dict | None = None, tls=None, silent: bool = False,
                 tls_hello_answer: bytes = b"") -> None:
        self.routes, self.tls, self.silent = routes or {}, tls, silent
        self.tls_hello_answer = tls_hello_answer
        self.tls_hellos = 0
        self.held: list[socket.socket] = []
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
                self.held.append(conn)
            data = conn.recv(65536)
            if self.silent or (self.tls is None and data[:1] == b"\x16"):
                self.tls_hellos += data[:1] == b"\x16"
                if self.tls_hello_answer:
                    conn.sendall(self.tls_hello_answer)
                    conn.close()
                return  # Else hold it open, unanswered.
            while b"\r\n\r\n" not in data and (more := conn.recv(65536)):
                data += more
            path = data.split(b" ")[1].decode().split("?")[0]
            found = path in self.routes
            body = json.dumps(self.routes.get(path, {"detail": "not found"})).encode()
            conn.sendall(
                f"HTTP/1.1 {'200 OK' if found else '404 Not Found'}\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
                .encode() + body
            )
        except (OSError, ssl.SSLError):
            pass  # The client gave up or refused our certificate.

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


LOGON = {"/auth/v1/logon": {"accessToken": "tok-1", "expiresAt": "2030-01-01T00:00:00Z"},
         "/platform/rest/deeplearning/v1/execs": []}


@pytest.fixture
def served():
    servers: list[FakeServer] = []

    def start(**kwargs) -> FakeServer:
        servers.append(FakeServer(**kwargs))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _dlicmd_process(args: list[str], home: Path) -> subprocess.CompletedProcess:
    # The timeout is the bound: the https probe of a plain-http server that never answers TLS
    # must give up within a couple of seconds (it used to wait 10 s and die with a traceback).
    return subprocess.run(  # noqa: S603
        [sys.executable, str(Path(settings.BASE_DIR) / "dlicmd.py"), *args],
        cwd=home, capture_output=True, text=True, timeout=8,
        env={**os.environ, "DLICMD_TOKEN_FILE": str(home / ".dlicmd"), "HOME": str(home)},
    )


@pytest.mark.slow
def test_a_bare_host_that_never_answers_tls_is_reached_over_http(served, tmp_path):
    server = served(routes=LOGON)
    where = ["--rest-host", "127.0.0.1", "--rest-port", str(server.port)]
    logon = _dlicmd_process(["--logon", *where, "--username", "a", "--password", "b"], tmp_path)
    assert logon.returncode == 0, logon.stderr
    assert f"Logged on to http://127.0.0.1:{server.port} as a" in logon.stdout
    assert server.tls_hellos == 1
    # The next command names the same server: it uses what the logon found, without a probe.
    listed = _dlicmd_process(["--exec-get-all", "-o", "json", *where], tmp_path)
    assert listed.returncode == 0 and json.loads(listed.stdout) == [], listed.stderr
    assert server.tls_hellos == 1


@pytest.mark.timeout(10)
def test_a_plain_http_answer_to_the_tls_hello_ends_the_probe_at_once(
        served, monkeypatch, capsys, tmp_path):
    # As Django's runserver or nginx do: a 400 in plain text. The probe must not wait for its
    # timeout (made far longer than this test's) to fall back to http.
    server = served(routes=LOGON, tls_hello_answer=b"HTTP/1.1 400 Bad Request\r\n"
                    b"Content-Length: 0\r\nConnection: close\r\n\r\n")
    monkeypatch.setenv("DLICMD_TOKEN_FILE", str(tmp_path / "tok"))
    monkeypatch.setattr(dlicmd, "PROBE_TIMEOUT_S", 60.0)
    assert dlicmd.main(["--logon", "--rest-host", "127.0.0.1", "--rest-port", str(server.port),
                        "--username", "a", "--password", "b"]) == 0
    assert f"Logged on to http://127.0.0.1:{server.port}" in capsys.readouterr().out
    assert server.tls_hellos == 1


@pytest.mark.slow
def test_nothing_listening_is_one_line_without_a_traceback(tmp_path):
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # Closed on leaving: nothing listens there.
    done = _dlicmd_process(["--logon", "--rest-host", "127.0.0.1", "--rest-port", str(port),
                            "--username", "a", "--password", "b"], tmp_path)
    assert done.returncode == 1
    assert done.stderr == (
        f"[Error]: Nothing answers at http://127.0.0.1:{port} (connection refused): start the "
        "console (./edt up) or check --rest-host and --rest-port.\n"
    )


def _main_error(argv: list[str], capsys) -> str:
    assert dlicmd.main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("[Error]: "), err
    return err


def test_an_unknown_host_name_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("DLICMD_TOKEN_FILE", str(tmp_path / "tok"))

    def no_such_name(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_name)
    err = _main_error(["--logon", "--rest-host", "console.example", "--username", "a",
                       "--password", "b"], capsys)
    assert "Cannot resolve the host name 'console.example': check --rest-host." in err


def test_a_server_that_never_answers_is_one_line(served, monkeypatch, capsys, tmp_path):
    server = served(silent=True)
    monkeypatch.setenv("DLICMD_TOKEN_FILE", str(tmp_path / "tok"))
    monkeypatch.setattr(dlicmd, "READ_TIMEOUT_S", 0.3)
    err = _main_error(["--exec-get-all", "--jwt-token", "t", "--rest-host",
                       f"http://127.0.0.1:{server.port}"], capsys)
    assert f"http://127.0.0.1:{server.port} accepted the connection but did not answer" in err


@pytest.fixture
def self_signed(tmp_path) -> ssl.SSLContext:
    made = tls.certificate(tmp_path / "var", env={})
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(made.cert, made.key)
    return context


def test_a_self_signed_https_server_needs_insecure_and_never_falls_back_to_http(
        served, self_signed, monkeypatch, capsys, tmp_path):
    server = served(routes=LOGON, tls=self_signed)
    monkeypatch.setenv("DLICMD_TOKEN_FILE", str(tmp_path / "tok"))
    where = ["--rest-host", "127.0.0.1", "--rest-port", str(server.port), "--username", "a",
             "--password", "b"]
    err = _main_error(["--logon", *where], capsys)
    assert "TLS certificate cannot be verified (self-signed?). Pass --insecure" in err
    assert dlicmd.main(["--logon", "--insecure", *where]) == 0
    assert f"Logged on to https://127.0.0.1:{server.port}" in capsys.readouterr().out
    # The commands after it trust the server as the logon did, as WMLA's dlicmd always does.
    assert dlicmd.main(["--exec-get-all", "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_the_saved_server_is_reused_only_for_the_same_host_and_port():
    assert dlicmd.same_server("http://h.example:8000", "h.example", 8000)
    assert dlicmd.same_server("https://h.example", "H.example", -1)
    assert not dlicmd.same_server("http://h.example:8000", "h.example", 8443)
    assert not dlicmd.same_server("http://h.example:8000", "other.example", 8000)
    assert not dlicmd.same_server(None, "h.example", 8000)
    assert dlicmd.same_server("http://h.example:8000", "http://h.example:8000/", -1)
