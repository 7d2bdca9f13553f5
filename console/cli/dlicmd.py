#!/usr/bin/env python3
"""dlicmd: the command line of IBM Watson Machine Learning Accelerator, for this console.

Scripts written for WMLA's ``dlicmd.py`` run unchanged against this server: the same flags, the
same REST calls, the same outputs (``--exec-start`` prints ``{"execId": ..., "appId": ...}``,
``--exec-get`` prints the exec as JSON, ``--exec-trainresult`` saves the zip). Two commands WMLA
lacks: ``--exec-priority <id> <N>`` and ``--exec-watch <id>`` (live slots and progress).

This file is self-contained: it needs Python 3.9+ and ``requests``, never Django, so it can be
copied alone to a laptop (the server also offers it at ``/ui/tools/dlicmd.py``).

The token from ``--logon`` is kept in ``~/.dlicmd`` (mode 0600), or in the file named by the
environment variable ``DLICMD_TOKEN_FILE``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import getpass
import json
import os
import shutil
import socket
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import requests

DLI_REST = "/platform/rest/deeplearning/v1"
# Seconds: the https probe of a bare host, connecting, and waiting for an answer.
PROBE_TIMEOUT_S = 2.0
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
TERMINAL_STATES = {"FINISHED", "KILLED", "ERROR"}
MODEL_DIR_SUFFIX = ".modelDir.tar"

LOG_TYPES = {
    "--exec-outlogs": "outlog",
    "--exec-errlogs": "errlog",
    "--exec-trainlogs": "outerrlog",
    "--exec-trainoutlogs": "outlog",
    "--exec-trainerrlogs": "errlog",
}
# As WMLA's dlicmd: --exec-outlogs / --exec-errlogs print each process's own output (driver, then
# every executor), read through the scheduler view; the --exec-train* flags print the training
# log (ELog lines) of /execs/{id}/log.
PROCESS_LOGS = {"--exec-outlogs": "stdout", "--exec-errlogs": "stderr",
                "--exec-launcherlogs": "launcherlog"}
# Options that tell dlicmd where and how to connect: never part of the submitted args string.
CONNECTION_OPTIONS_WITH_VALUE = (
    "--rest-host", "--master-host", "--rest-port", "--dli-rest-port", "--username",
    "--password", "--jwt-token", "--query-args", "--data-source", "-o", "--output",
    "--interval", "--watch-timeout",
)
CONNECTION_FLAGS = ("--insecure",)


class CliError(Exception):
    """A failure to report on stderr with exit status 1."""


def token_file() -> Path:
    return Path(os.environ.get("DLICMD_TOKEN_FILE") or Path.home() / ".dlicmd")


def load_session() -> dict:
    """The cached logon: a JSON object, or the bare token WMLA's dlicmd writes."""
    path = token_file()
    if not path.is_file():
        return {}
    text = path.read_text().strip()
    try:
        data = json.loads(text)
    except ValueError:
        return {"token": text} if text else {}
    return data if isinstance(data, dict) else {}


def save_session(data: dict) -> None:
    path = token_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump(data, handle)
    os.chmod(path, 0o600)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise CliError(message)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="dlicmd", add_help=False, allow_abbrev=False)
    p.add_argument("--logon", action="store_true")
    p.add_argument("--logoff", action="store_true")
    p.add_argument("--status", action="store_true")
    p.add_argument("--dl-frameworks", action="store_true")
    p.add_argument("--exec-start", dest="framework")
    p.add_argument("--exec-get-all", action="store_true")
    for flag in ("--exec-get", "--exec-stop", "--exec-delete", "--exec-trainresult",
                 "--exec-watch", *dict.fromkeys([*LOG_TYPES, *PROCESS_LOGS])):
        p.add_argument(flag, dest="exec_id")
    p.add_argument("--exec-delete-all", action="store_true")
    p.add_argument("--hpo-start", dest="hpo_file")
    p.add_argument("--hpo-get-all", "--hpo-list", action="store_true")
    p.add_argument("--hpo-delete-all", action="store_true")
    for flag in ("--hpo-get", "--hpo-stop", "--hpo-delete"):
        p.add_argument(flag, dest="hpo_name")
    p.add_argument("--exec-priority", nargs=2, metavar=("EXEC_ID", "PRIORITY"))
    p.add_argument("-o", "--output", dest="output_format")
    p.add_argument("--rest-host", "--master-host", dest="rest_host")
    p.add_argument("--rest-port", "--dli-rest-port", dest="rest_port", type=int, default=-1)
    p.add_argument("--username")
    p.add_argument("--password")
    p.add_argument("--jwt-token")
    p.add_argument("--insecure", action="store_true",
                   help="Do not verify the server's TLS certificate (WMLA's dlicmd never does).")
    p.add_argument("--ig", dest="instance_group")
    p.add_argument("--model-main")
    p.add_argument("--model-dir")
    p.add_argument("--data-source")
    p.add_argument("--query-args")
    p.add_argument("--interval", type=float, default=2.0)
    p.add_argument("--watch-timeout", type=float, default=0.0)
    return p


def print_help() -> None:
    print(
        """Usage:
   dlicmd --logon --rest-host <host> [--rest-port <port>] --username <user> [--password <pw>]
   dlicmd --logoff
   dlicmd --dl-frameworks | --exec-get-all [--query-args "limit=10&state=RUNNING"] | --status
   dlicmd --exec-start edtPyTorch --ig <instance group> --model-dir <folder>
          --model-main <main.py> [--cs-datastore-meta type=fs,data_path=<dataset>]
          [--numWorker N | --edt-options maxWorkers=N] [--workerDeviceNum N]
          [--msd-env NAME=value ...] [--msd-priority N] [--appName NAME] [-- script args]
   dlicmd --exec-get | --exec-stop | --exec-delete | --exec-watch <exec-id>
   dlicmd --exec-outlogs | --exec-errlogs | --exec-launcherlogs | --exec-trainlogs
          | --exec-trainresult <exec-id>
   dlicmd --exec-delete-all          (your ended execs; active ones stay)
   dlicmd --exec-priority <exec-id> <1..10000>
   dlicmd --hpo-start <search.json> --exec-start edtPyTorch --ig <instance group>
          --model-dir <folder> --model-main <main.py> [the --exec-start flags of each trial]
          (search.json: WMLA's {"algoDef": {...}, "hyperParams": [...]})
   dlicmd --hpo-get-all | --hpo-get <name> | --hpo-stop <name> | --hpo-delete <name>
          | --hpo-delete-all

Connection options:
   --rest-host    Server host name; or a URL (http://host:8000). https is tried first (for
                  2 s at most), then http.
   --rest-port    Server port (default: none, as for an OpenShift route).
   --jwt-token    Use this token instead of the one saved by --logon.
   --insecure     Do not verify the TLS certificate (e.g. the console's self-signed one);
                  given at --logon, it holds for the commands that use that logon.
Other options:
   -o json        JSON output for --exec-get-all and --dl-frameworks.
   --interval S   Seconds between refreshes of --exec-watch (default 2).
   --watch-timeout S   Stop watching after S seconds (default: until the exec ends).

The logon token is saved in ~/.dlicmd (or $DLICMD_TOKEN_FILE); it expires after 8 hours."""
    )


def split_user_args(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def submitted_args(argv: list[str]) -> str:
    """The args string sent with ``--exec-start``, built as WMLA's dlicmd builds it: the whole
    command line without connection options, ``--model-dir`` reduced to the folder's name."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        name = word.split("=", 1)[0]
        if word == "--":
            out.extend(argv[i:])
            break
        if name == "--model-dir":
            if "=" in word:
                value = word.split("=", 1)[1]
            else:
                value = argv[i + 1] if i + 1 < len(argv) else ""
            out.extend(["--model-dir", Path(value.rstrip("/\\")).name])
            i += 1 if "=" in word else 2
            continue
        if name in CONNECTION_OPTIONS_WITH_VALUE:
            i += 1 if "=" in word else 2
            continue
        if name in CONNECTION_FLAGS:
            i += 1
            continue
        out.append(word)
        i += 1
    return " ".join(_quote(t) for t in out)


def _quote(token: str) -> str:
    # The server splits the string like a shell; quote only what needs it.
    if token and all(c.isalnum() or c in "-_=.,:/@+%" for c in token):
        return token
    return "'" + token.replace("'", "'\"'\"'") + "'"


class Client:
    def __init__(self, base_url: str, token: str | None, verify: bool) -> None:
        self.base_url = base_url.rstrip("/")
        self.token = token
        self.verify = verify

    @property
    def dli(self) -> str:
        return self.base_url + DLI_REST

    def request(self, method: str, url: str, accept: str = "application/json", **kwargs):
        headers = {"Accept": accept, **kwargs.pop("headers", {})}
        if self.token and "auth" not in kwargs:
            headers["Authorization"] = "Bearer " + self.token
        read_timeout = kwargs.pop("timeout", READ_TIMEOUT_S)
        try:
            return requests.request(
                method, url, headers=headers, verify=self.verify,
                timeout=(CONNECT_TIMEOUT_S, read_timeout), **kwargs,
            )
        except requests.exceptions.RequestException as exc:
            raise network_error(exc, url) from None


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: urllib3's reason, then each cause or context."""
    found: list[BaseException] = []
    todo: list[object] = [exc]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or any(item is s for s in found) or len(found) > 20:
            continue
        found.append(item)
        todo += [item.__cause__, item.__context__, getattr(item, "reason", None), *item.args]
    return found


def _server(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.netloc else url


def _deepest_reason(exc: BaseException) -> str:
    text = str(_causes(exc)[-1]) or type(exc).__name__
    return text.splitlines()[0][:200]


def network_error(exc: BaseException, url: str | None = None) -> CliError:
    """One line for a request that got no HTTP answer: which server, what went wrong, what to
    do. Never a traceback."""
    if url is None:
        url = getattr(getattr(exc, "request", None), "url", None) or "the server"
    where = _server(url)
    causes = _causes(exc)
    hint = "check --rest-host and --rest-port"
    if "CERTIFICATE_VERIFY_FAILED" in str(exc):
        return CliError(f"{where}: the server's TLS certificate cannot be verified (self-signed?). "
                        "Pass --insecure, or name its CA with REQUESTS_CA_BUNDLE=<file>.")
    if isinstance(exc, requests.exceptions.SSLError):
        return CliError(f"{where}: the TLS handshake failed ({_deepest_reason(exc)}); {hint}, "
                        "or name the scheme: --rest-host http://<host>:<port>.")
    if any(isinstance(c, socket.gaierror) for c in causes):
        host = urlsplit(url).hostname or url
        return CliError(f"Cannot resolve the host name {host!r}: check --rest-host.")
    if isinstance(exc, requests.exceptions.ConnectTimeout):
        return CliError(f"{where} did not accept a connection within {CONNECT_TIMEOUT_S:g} s: "
                        f"{hint}, and that no firewall blocks the port.")
    if isinstance(exc, requests.exceptions.Timeout):
        return CliError(f"{where} accepted the connection but did not answer in time: is the "
                        f"console running there? {hint[0].upper()}{hint[1:]}.")
    if any(isinstance(c, ConnectionRefusedError) for c in causes):
        return CliError(f"Nothing answers at {where} (connection refused): start the console "
                        f"(./edt up) or {hint}.")
    return CliError(f"Cannot reach {where}: {_deepest_reason(exc)}; {hint}.")


def _disable_tls_warnings() -> None:
    try:
        import urllib3

        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    except Exception:  # noqa: BLE001, S110 - only a warning filter
        pass


def resolve_base_url(host: str, port: int, verify: bool) -> str:
    """``host[:port]`` -> a base URL. A URL is used as given; a bare host is tried with https
    first and http second, as WMLA's dlicmd does. The https probe waits ``PROBE_TIMEOUT_S`` at
    most: a plain-http server either answers the TLS hello with an error at once, or (some servers)
    keeps the connection open without a word."""
    if host.startswith(("http://", "https://")):
        return host.rstrip("/")
    suffix = f":{port}" if port and port > 0 else ""
    https, http = f"https://{host}{suffix}", f"http://{host}{suffix}"
    try:
        requests.get(https + "/", timeout=PROBE_TIMEOUT_S, verify=verify,
                     allow_redirects=False, stream=True).close()
        return https
    except requests.exceptions.SSLError as exc:
        if "CERTIFICATE_VERIFY_FAILED" in str(exc):
            # It speaks TLS with a certificate we cannot check: never fall back to plain http.
            raise network_error(exc, https) from None
        return http  # Something answered the TLS hello in plain text.
    except requests.exceptions.ConnectTimeout as exc:
        if suffix:  # http would wait on the same silent port.
            raise network_error(exc, http) from None
        return http
    except requests.exceptions.Timeout:
        return http  # It took the connection but never spoke TLS: a plain-http server.
    except requests.exceptions.ConnectionError as exc:
        if suffix or any(isinstance(c, socket.gaierror) for c in _causes(exc)):
            raise network_error(exc, http) from None
        return http  # Nothing on 443; port 80 may answer.


def fail_response(resp, action: str) -> int:
    try:
        body = json.dumps(resp.json(), indent=2)
    except ValueError:
        body = resp.text
    if resp.status_code == 401:
        print("Authentication error. The request was denied. Run dlicmd --logon again.",
              file=sys.stderr)
    print(f"{action} failed. HTTP:{resp.status_code} {body}", file=sys.stderr)
    return 1


def pprint_json(data) -> None:
    print(json.dumps(data, indent=2))


def print_table(columns: list[str], rows: list[dict]) -> None:
    widths = {c: max([len(c), *(len(str(r.get(c, ""))) for r in rows)]) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns))


def age(create_time: str | None) -> str:
    if not create_time:
        return ""
    started = datetime.datetime.strptime(create_time, "%Y-%m-%dT%H:%M:%SZ")
    now = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)  # noqa: UP017 (3.9)
    seconds = int((now - started).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


# --- commands ---------------------------------------------------------------------------------


def cmd_logon(flags, verify: bool) -> int:
    if not flags.rest_host:
        raise CliError("--rest-host is required for --logon")
    username = flags.username or input("Username: ")
    password = flags.password or getpass.getpass("Password: ")
    base = resolve_base_url(flags.rest_host, flags.rest_port, verify)
    client = Client(base, None, verify)
    resp = client.request("GET", base + "/auth/v1/logon", auth=(username, password))
    if not resp.ok:
        token_file().unlink(missing_ok=True)
        return fail_response(resp, "Logon")
    body = resp.json()
    token = body.get("accessToken")
    if not token:
        raise CliError("Logon failed: the server sent no accessToken.")
    save_session(
        {"token": token, "base_url": base, "username": username,
         "expires_at": body.get("expiresAt"), "insecure": not verify}
    )
    print(f"Logged on to {base} as {username}; the token is valid until "
          f"{body.get('expiresAt', '?')} and saved in {token_file()}.")
    return 0


def cmd_logoff(client: Client) -> int:
    token_file().unlink(missing_ok=True)
    if not client.token:
        print("Not logged on.")
        return 0
    resp = client.request("POST", client.base_url + "/auth/v1/logoff")
    if not resp.ok:
        return fail_response(resp, "Logoff")
    print("Logged off.")
    return 0


def _model_upload(flags) -> tuple[str, str | None]:
    """The file to upload, and the temporary file to remove afterwards: the model folder as a
    tar.gz (as WMLA's dlicmd sends it), or the lone main file as itself."""
    if not flags.model_dir:
        if not Path(flags.model_main).is_file():
            raise CliError(f"--model-main {flags.model_main} is not a file")
        return flags.model_main, None
    folder = Path(flags.model_dir.rstrip("/\\"))
    if not folder.is_dir():
        raise CliError(f"--model-dir {flags.model_dir} is not a folder")
    if flags.model_main and not (folder / flags.model_main).is_file():
        raise CliError(f"--model-main {flags.model_main} is not a file in {folder}")
    temp = _pack_folder(folder)
    return temp, temp


def _pack_folder(folder: Path) -> str:
    fd, temp = tempfile.mkstemp(MODEL_DIR_SUFFIX)
    os.close(fd)
    print("Copying files and directories ...", file=sys.stderr)
    try:
        with tarfile.open(temp, "w:gz") as tar:
            tar.add(str(folder), arcname=folder.resolve().name)
    except BaseException:
        os.remove(temp)
        raise
    return temp


def _data_form(flags) -> dict | None:
    if not flags.data_source:
        return None
    try:
        return {"data": json.dumps({"dataSource": json.loads(flags.data_source)})}
    except ValueError as exc:
        raise CliError(f"--data-source is not valid JSON: {exc}") from exc


def cmd_exec_start(client: Client, flags, argv: list[str]) -> int:
    if flags.framework is None:
        raise CliError("--exec-start needs a framework name (see --dl-frameworks)")
    if not flags.model_dir and not flags.model_main:
        raise CliError("--model-main (and usually --model-dir) is required")
    temp = None
    try:
        upload, temp = _model_upload(flags)
        print(f"Content size: {os.path.getsize(upload)} bytes", file=sys.stderr)
        data = _data_form(flags)
        params = {"args": submitted_args(argv)}
        with open(upload, "rb") as handle:
            resp = client.request(
                "POST", client.dli + "/execs", params=params, data=data,
                files=[("file", (Path(upload).name, handle))], timeout=600,
            )
    finally:
        if temp:
            os.remove(temp)
    if not resp.ok:
        return fail_response(resp, "Submit")
    body = resp.json()
    # The console's check before submit (not WMLA's): said, never fatal; stdout stays the JSON.
    for warning in body.get("warnings") or []:
        print(f"warning: {warning}", file=sys.stderr)
    pprint_json({"execId": body["id"], "appId": body["appId"]})
    return 0


def cmd_exec_get_all(client: Client, flags, argv: list[str]) -> int:
    url = client.dli + "/execs" + (f"?{flags.query_args}" if flags.query_args else "")
    resp = client.request("GET", url)
    if not resp.ok:
        return fail_response(resp, "List")
    execs = resp.json()
    if flags.output_format == "json":
        pprint_json(execs)
        return 0
    rows = [
        {
            "id": e.get("id"), "submit_user": e.get("creator"), "name": e.get("appName"),
            "framework": e.get("framework"), "type": "ELASTIC" if e.get("elastic") else "PARALLEL",
            "state": e.get("state"), "num": e.get("numWorker"), "workers": e.get("workers"),
            "priority": e.get("priority"), "submit_time": e.get("createTime"),
            "age": age(e.get("createTime")),
        }
        for e in execs
    ]
    print_table(
        ["id", "submit_user", "name", "framework", "type", "state", "num", "workers", "priority",
         "submit_time", "age"],
        rows,
    )
    return 0


def cmd_frameworks(client: Client, flags, argv: list[str]) -> int:
    resp = client.request("GET", client.dli + "/execs/frameworks")
    if not resp.ok:
        return fail_response(resp, "List frameworks")
    frameworks = resp.json()
    if flags.output_format == "json":
        pprint_json(frameworks)
        return 0
    for fw in frameworks:
        print(f"Name: {fw.get('name', '')}")
        print(f"Version: {fw.get('frameworkVersion', '')}")
        for i, line in enumerate(fw.get("desc") or []):
            print(("Desc: " if i == 0 else "      ") + line)
        print("")
    return 0


def cmd_exec_result(client: Client, flags, exec_id: str) -> int:
    resp = client.request("GET", f"{client.dli}/execs/{exec_id}/result", accept="text/plain",
                          stream=True, timeout=600)
    if not resp.ok:
        return fail_response(resp, f"Get result of exec {exec_id}")
    filename = "train_result.zip"
    for item in resp.headers.get("Content-Disposition", "").split(";"):
        item = item.strip()
        if item.startswith("filename="):
            filename = Path(item[len("filename="):].strip('"')).name or filename
    with open(filename, "wb") as handle:
        for chunk in resp.iter_content(chunk_size=1 << 16):
            handle.write(chunk)
    print(f"Train result is saved to {filename}")
    return 0


def watch_line(e: dict) -> str:
    progress = e.get("progress") or {}
    epoch, epochs = progress.get("epoch", 0), progress.get("epochs", 0)
    bar = ""
    if epochs:
        filled = int(20 * min(epoch, epochs) / epochs)
        bar = "[" + "#" * filled + "-" * (20 - filled) + f"] epoch {epoch}/{epochs}"
    else:
        bar = f"epoch {epoch}"
    held = e.get("slots") or {}
    # A mapping "<host>:<slot>" -> slot; a server before that change answered a list.
    held = held.values() if isinstance(held, dict) else held
    slots = ",".join(f"{s['host']}:{s['slot']}" for s in held)
    metrics = e.get("lastMetrics") or {}
    loss = metrics.get("loss", metrics.get("Loss"))
    parts = [
        datetime.datetime.now().strftime("%H:%M:%S"),
        e.get("id", ""),
        f"{e.get('state', ''):<21}",
        f"workers {e.get('workers', 0)}/{e.get('maxWorkers', e.get('numWorker', 0))}"
        f" (target {e.get('targetWorkers', 0)})",
        f"priority {e.get('priority', '')}",
        bar,
        f"iter {progress.get('iteration', 0)}",
    ]
    if loss is not None:
        parts.append(f"loss {loss:.4g}" if isinstance(loss, (int, float)) else f"loss {loss}")
    if slots:
        parts.append(f"slots {slots}")
    if e.get("allocationReason"):
        parts.append(f"why: {e['allocationReason']}")
    return "  ".join(parts)


class WatchView:
    """Shows each poll of ``--exec-watch``. On a terminal one line is redrawn in place and kept
    whenever the state or the slot count changes; elsewhere a line is printed per change."""

    def __init__(self, tty: bool) -> None:
        self.tty = tty
        self.last_key: tuple | None = None
        self.last_progress = None

    def show(self, e: dict) -> None:
        line = watch_line(e)
        key = (e.get("state"), e.get("workers"), e.get("targetWorkers"), e.get("priority"),
               e.get("allocationReason"))
        if self.tty:
            width = shutil.get_terminal_size((120, 24)).columns
            end = "\n" if key != self.last_key and self.last_key is not None else ""
            sys.stdout.write(end + "\r" + line[:width].ljust(min(width, 200)))
            sys.stdout.flush()
        elif key != self.last_key or e.get("progress") != self.last_progress:
            print(line, flush=True)
        self.last_key, self.last_progress = key, e.get("progress")

    def close(self) -> None:
        if self.tty:
            print()


def cmd_exec_watch(client: Client, flags, exec_id: str) -> int:
    """Poll the exec and show its state, slots and progress until it ends (or until
    ``--watch-timeout``): 0 when it finished, 1 when it failed or was killed, 2 on timeout."""
    view = WatchView(sys.stdout.isatty())
    timeout = flags.watch_timeout
    deadline = time.monotonic() + timeout if timeout > 0 else None
    while True:
        resp = client.request("GET", f"{client.dli}/execs/{exec_id}")
        if not resp.ok:
            return fail_response(resp, f"Watch exec {exec_id}")
        e = resp.json()
        view.show(e)
        state = e.get("state")
        if state in TERMINAL_STATES:
            view.close()
            error = f" ({e['error']})" if e.get("error") else ""
            print(f"Exec {e.get('id')} ended: {state}{error}")
            return 0 if state == "FINISHED" else 1
        if deadline is not None and time.monotonic() >= deadline:
            view.close()
            print(f"Stopped watching exec {e.get('id')} after {timeout:g} s; it is {state}.")
            return 2
        time.sleep(max(flags.interval, 0.1))


def cmd_status(client: Client, flags, argv: list[str]) -> int:
    resp = client.request("GET", client.dli + "/status")
    if not resp.ok:
        return fail_response(resp, "Status")
    pprint_json(resp.json())
    return 0


def cmd_exec_priority(client: Client, flags, argv: list[str]) -> int:
    exec_id, priority = flags.exec_priority
    resp = client.request("POST", f"{client.dli}/execs/{exec_id}/priority",
                          json={"priority": priority})
    if not resp.ok:
        return fail_response(resp, f"Set priority of exec {exec_id}")
    print(f"Priority of exec {resp.json()['id']} is now {resp.json()['priority']}.")
    return 0


def cmd_exec_get(client: Client, flags, exec_id: str) -> int:
    return _one_call(client, "GET", f"/execs/{exec_id}", f"Get exec {exec_id}", _as_json)


def _one_call(client: Client, method: str, path: str, action: str, said) -> int:
    """One request; on success ``said(response)`` is printed, else WMLA's error line."""
    resp = client.request(method, client.dli + path)
    if not resp.ok:
        return fail_response(resp, action)
    print(said(resp))
    return 0


def _as_json(resp) -> str:
    return json.dumps(resp.json(), indent=2)


def _all_deleted(kind: str, left: str):
    return lambda r: (f"Deleted {len(r.json().get('deleted', []))} {kind}; "
                      f"{r.json().get('kept', 0)} still {left} were kept. HTTP:{r.status_code}")


def cmd_exec_stop(client: Client, flags, exec_id: str) -> int:
    return _one_call(client, "POST", f"/execs/{exec_id}/stop", f"Stop exec {exec_id}",
                     lambda r: f"Stop exec {exec_id} succeed. HTTP:{r.status_code} state "
                               f"{r.json()['state']}")


def cmd_exec_delete(client: Client, flags, exec_id: str) -> int:
    return _one_call(client, "DELETE", f"/execs/{exec_id}", f"Delete exec {exec_id}",
                     lambda r: f"Delete exec {exec_id} succeed. HTTP:{r.status_code}")


def cmd_exec_delete_all(client: Client, flags, argv: list[str]) -> int:
    """Delete every ended exec of yours; active ones stay."""
    return _one_call(client, "DELETE", "/execs", "Delete all execs",
                     _all_deleted("execs", "active"))


def cmd_process_logs(client: Client, flags, exec_id: str, stream: str) -> int:
    """The driver's and each executor's ``stream`` (stdout or stderr), one after the other."""
    resp = client.request("GET", f"{client.dli}/execs/{exec_id}")
    if not resp.ok:
        return fail_response(resp, f"Get logs of exec {exec_id}")
    app = resp.json()["appId"]
    resp = client.request("GET", f"{client.dli}/scheduler/applications",
                          params={"applicationid": app})
    if not resp.ok or not resp.json():
        return fail_response(resp, f"Get logs of exec {exec_id}")
    executors = resp.json()[0].get("task12n") or []
    paths = [("driver", f"{app}/driver/logs/{stream}")] + [
        (f"executor {n}", f"{app}/executor/{n}/logs/{stream}")
        for n in range(1, len(executors) + 1)
    ]
    for name, path in paths:
        resp = client.request("GET", f"{client.dli}/scheduler/applications/{path}",
                              accept="text/plain")
        if not resp.ok:
            return fail_response(resp, f"Get the {name}'s {stream} of exec {exec_id}")
        print(f"==== {name} {stream} ====")
        _print_text(resp.text)
    return 0


def cmd_exec_logs(client: Client, flags, exec_id: str, log_type: str) -> int:
    resp = client.request("GET", f"{client.dli}/execs/{exec_id}/log",
                          params={"logType": log_type}, accept="text/plain")
    if not resp.ok:
        return fail_response(resp, f"Get logs of exec {exec_id}")
    _print_text(resp.text)
    return 0


def _print_text(text: str) -> None:
    """A log as the server sent it, ending with exactly the newline it may lack."""
    sys.stdout.write(text if not text or text.endswith("\n") else text + "\n")


def _without(argv: list[str], flag: str) -> list[str]:
    """``argv`` without ``flag`` and its value (``--flag V`` or ``--flag=V``)."""
    out, skip = [], False
    for word in argv:
        if skip:
            skip = False
        elif word == flag:
            skip = True
        elif not word.startswith(flag + "="):
            out.append(word)
    return out


def _search_file(path: str) -> dict:
    try:
        search = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CliError(f"--hpo-start {path}: {exc}") from exc
    if not isinstance(search, dict) or "algoDef" not in search or "hyperParams" not in search:
        raise CliError(f"--hpo-start {path}: expected a JSON object with algoDef and "
                       "hyperParams (WMLA's /hypersearch body)")
    return search


def cmd_hpo_start(client: Client, flags, argv: list[str]) -> int:
    """A hyper-parameter search: each trial is submitted as --exec-start would submit it."""
    search = _search_file(flags.hpo_file)
    if flags.framework is None or not (flags.model_dir or flags.model_main):
        raise CliError("--hpo-start also needs the flags of each trial: --exec-start "
                       "edtPyTorch --model-dir <folder> --model-main <main.py>")
    search["modelSpec"] = {**(search.get("modelSpec") or {}),
                           "args": submitted_args(_without(argv, "--hpo-start")),
                           "sigName": flags.instance_group or ""}
    temp = None
    try:
        upload, temp = _model_upload(flags)
        with open(upload, "rb") as handle:
            resp = client.request("POST", client.dli + "/hypersearch",
                                  data={"data": json.dumps(search)},
                                  files=[("file", (Path(upload).name, handle))], timeout=600)
    finally:
        if temp:
            os.remove(temp)
    if not resp.ok:
        return fail_response(resp, "Start the search")
    pprint_json({"hpoName": resp.json()})
    return 0


def cmd_hpo_get_all(client: Client, flags, argv: list[str]) -> int:
    resp = client.request("GET", client.dli + "/hypersearch")
    if not resp.ok:
        return fail_response(resp, "List searches")
    if flags.output_format == "json":
        pprint_json(resp.json())
        return 0
    print_table(["hpoName", "state", "progress", "algorithm", "objective", "creator",
                 "createtime"],
                [{**t, "objective": f"{t.get('objective')} {t.get('objectiveMetric')}"}
                 for t in resp.json()])
    return 0


def cmd_hpo_get(client: Client, flags, name: str) -> int:
    return _one_call(client, "GET", f"/hypersearch/{name}", f"Get search {name}", _as_json)


def cmd_hpo_stop(client: Client, flags, name: str) -> int:
    return _one_call(client, "PUT", f"/hypersearch/{name}", f"Stop search {name}",
                     lambda r: f"Stop search {name} succeed. HTTP:{r.status_code} state "
                               f"{r.json()['state']}")


def cmd_hpo_delete(client: Client, flags, name: str) -> int:
    return _one_call(client, "DELETE", f"/hypersearch/{name}", f"Delete search {name}",
                     lambda r: f"Delete search {name} succeed. HTTP:{r.status_code}")


def cmd_hpo_delete_all(client: Client, flags, argv: list[str]) -> int:
    return _one_call(client, "DELETE", "/hypersearch", "Delete all searches",
                     _all_deleted("searches", "running"))


# The commands that act on the server, called with (client, flags, argv), and those that act on
# one exec, called with (client, flags, exec id). --logon and --logoff come before a token.
SERVER_COMMANDS = {
    "--status": cmd_status,
    "--dl-frameworks": cmd_frameworks,
    "--exec-start": cmd_exec_start,
    "--exec-get-all": cmd_exec_get_all,
    "--exec-priority": cmd_exec_priority,
    "--exec-delete-all": cmd_exec_delete_all,
    "--hpo-start": cmd_hpo_start,
    "--hpo-get-all": cmd_hpo_get_all,
    "--hpo-list": cmd_hpo_get_all,
    "--hpo-delete-all": cmd_hpo_delete_all,
}
EXEC_COMMANDS = {
    "--exec-get": cmd_exec_get,
    "--exec-stop": cmd_exec_stop,
    "--exec-delete": cmd_exec_delete,
    "--exec-trainresult": cmd_exec_result,
    "--exec-watch": cmd_exec_watch,
    **{flag: functools.partial(cmd_exec_logs, log_type=kind) for flag, kind in LOG_TYPES.items()},
    **{flag: functools.partial(cmd_process_logs, stream=s) for flag, s in PROCESS_LOGS.items()},
}
# The commands that act on one search, called with (client, flags, search name).
HPO_COMMANDS = {"--hpo-get": cmd_hpo_get, "--hpo-stop": cmd_hpo_stop,
                "--hpo-delete": cmd_hpo_delete}
COMMANDS = ("--logon", "--logoff", *SERVER_COMMANDS, *EXEC_COMMANDS, *HPO_COMMANDS)


def command_of(argv: list[str]) -> str | None:
    """The first word of ``argv`` that names a command (``--exec-get=ID`` names --exec-get);
    ``--hpo-start`` wins wherever it is, since it comes with the flags of ``--exec-start``."""
    if any(w.split("=", 1)[0] == "--hpo-start" for w in argv):
        return "--hpo-start"
    for word in argv:
        name = word.split("=", 1)[0]
        if name in COMMANDS:
            return name
    return None


def same_server(base_url: str | None, host: str, port: int) -> bool:
    """Whether ``--rest-host host --rest-port port`` names the server of ``base_url``."""
    if not base_url or host.startswith(("http://", "https://")):
        return bool(base_url) and base_url == host.rstrip("/")
    parts = urlsplit(base_url)
    try:
        saved_port = parts.port
    except ValueError:
        return False
    wanted = port if port and port > 0 else None
    return parts.hostname == host.strip("[]").lower() and saved_port == wanted


def connect(flags, verify: bool) -> Client:
    """A client for the server named by ``--rest-host``, else the one of the last logon, with
    ``--jwt-token`` or the saved token. The server of the last logon is trusted as it was then
    (``--insecure`` at logon holds for the commands after it)."""
    session = load_session()
    token = flags.jwt_token or session.get("token")
    if flags.rest_host and not same_server(session.get("base_url"), flags.rest_host,
                                           flags.rest_port):
        return Client(resolve_base_url(flags.rest_host, flags.rest_port, verify), token, verify)
    if not session.get("base_url"):
        raise CliError("--rest-host is required (or run dlicmd --logon --rest-host ... first)")
    # Probed at logon: no second probe for each command.
    if session.get("insecure") and verify:
        verify = False
        _disable_tls_warnings()
    return Client(session["base_url"], token, verify)


def run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print_help()
        return 0 if argv else 1
    command = command_of(argv)
    if command is None:
        print_help()
        return 1
    own, _user_args = split_user_args(argv)
    flags, _unknown = build_parser().parse_known_args(own)
    verify = not flags.insecure
    if not verify:
        _disable_tls_warnings()
    if command == "--logon":
        return cmd_logon(flags, verify)
    client = connect(flags, verify)
    if command == "--logoff":
        return cmd_logoff(client)
    if not client.token:
        raise CliError("Unable to find a token. Please log on first: dlicmd --logon ...")
    if command in EXEC_COMMANDS:
        if not flags.exec_id:
            raise CliError(f"{command} needs an exec id")
        return EXEC_COMMANDS[command](client, flags, flags.exec_id)
    if command in HPO_COMMANDS:
        if not flags.hpo_name:
            raise CliError(f"{command} needs a search's name (see --hpo-get-all)")
        return HPO_COMMANDS[command](client, flags, flags.hpo_name)
    return SERVER_COMMANDS[command](client, flags, argv)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except CliError as exc:
        print(f"[Error]: {exc}", file=sys.stderr)
        return 1
    except requests.exceptions.RequestException as exc:  # e.g. cut off during a download
        print(f"[Error]: {network_error(exc)}", file=sys.stderr)
        return 1
    except OSError as exc:  # a file that cannot be read or written
        print(f"[Error]: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
