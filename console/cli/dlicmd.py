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
import getpass
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import requests

DLI_REST = "/platform/rest/deeplearning/v1"
ACTIVE_STATES = {"SUBMITTED", "PENDING_CRD_SCHEDULER", "LAUNCHING", "RUNNING", "RECOVERING"}
TERMINAL_STATES = {"FINISHED", "KILLED", "ERROR"}
MODEL_DIR_SUFFIX = ".modelDir.tar"

COMMANDS = (
    "--logon", "--logoff", "--status", "--dl-frameworks", "--exec-start", "--exec-get",
    "--exec-get-all", "--exec-stop", "--exec-delete", "--exec-outlogs", "--exec-errlogs",
    "--exec-trainlogs", "--exec-trainoutlogs", "--exec-trainerrlogs", "--exec-trainresult",
    "--exec-priority", "--exec-watch",
)
LOG_TYPES = {
    "--exec-outlogs": "outlog",
    "--exec-errlogs": "errlog",
    "--exec-trainlogs": "outerrlog",
    "--exec-trainoutlogs": "outlog",
    "--exec-trainerrlogs": "errlog",
}
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
                 "--exec-watch", *LOG_TYPES):
        p.add_argument(flag, dest="exec_id")
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
   dlicmd --exec-outlogs | --exec-errlogs | --exec-trainlogs | --exec-trainresult <exec-id>
   dlicmd --exec-priority <exec-id> <1..10000>

Connection options:
   --rest-host    Server host name; or a URL (http://host:8000). https is tried first.
   --rest-port    Server port (default: none, as for an OpenShift route).
   --jwt-token    Use this token instead of the one saved by --logon.
   --insecure     Do not verify the TLS certificate.
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
        try:
            timeout = kwargs.pop("timeout", 60)
            return requests.request(
                method, url, headers=headers, verify=self.verify, timeout=timeout, **kwargs
            )
        except requests.exceptions.RequestException as exc:
            raise CliError(f"Cannot reach {url}: {exc}") from exc


def _disable_tls_warnings() -> None:
    try:
        import urllib3

        urllib3.disable_warnings(urllib3.exceptions.InsecureRequestWarning)
    except Exception:  # noqa: BLE001, S110 - only a warning filter
        pass


def resolve_base_url(host: str, port: int, verify: bool) -> str:
    """``host[:port]`` -> a base URL. A URL is used as given; a bare host is tried with https
    first and http second, as WMLA's dlicmd does."""
    if host.startswith(("http://", "https://")):
        return host.rstrip("/")
    suffix = f":{port}" if port and port > 0 else ""
    https = f"https://{host}{suffix}"
    try:
        requests.get(https + "/", timeout=10, verify=verify, allow_redirects=False)
        return https
    except requests.exceptions.SSLError as exc:
        if "CERTIFICATE_VERIFY_FAILED" in str(exc):
            # It speaks TLS with a certificate we cannot check: never fall back to plain http.
            raise CliError(
                f"{https}: the TLS certificate cannot be verified ({exc}). Install the CA "
                "certificate (REQUESTS_CA_BUNDLE=...) or pass --insecure."
            ) from exc
        return f"http://{host}{suffix}"
    except requests.exceptions.ConnectionError:
        # Nothing speaks TLS there (or nothing at all); http gives the clearer error if so.
        return f"http://{host}{suffix}"


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
         "expires_at": body.get("expiresAt")}
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


def cmd_exec_start(client: Client, flags, argv: list[str]) -> int:
    if flags.framework is None:
        raise CliError("--exec-start needs a framework name (see --dl-frameworks)")
    if not flags.model_dir and not flags.model_main:
        raise CliError("--model-main (and usually --model-dir) is required")
    temp = None
    try:
        if flags.model_dir:
            folder = Path(flags.model_dir.rstrip("/\\"))
            if not folder.is_dir():
                raise CliError(f"--model-dir {flags.model_dir} is not a folder")
            if flags.model_main and not (folder / flags.model_main).is_file():
                raise CliError(f"--model-main {flags.model_main} is not a file in {folder}")
            fd, temp = tempfile.mkstemp(MODEL_DIR_SUFFIX)
            os.close(fd)
            print("Copying files and directories ...", file=sys.stderr)
            with tarfile.open(temp, "w:gz") as tar:
                tar.add(str(folder), arcname=folder.resolve().name)
            upload = temp
        else:
            upload = flags.model_main
            if not Path(upload).is_file():
                raise CliError(f"--model-main {upload} is not a file")
        print(f"Content size: {os.path.getsize(upload)} bytes", file=sys.stderr)
        data = None
        if flags.data_source:
            try:
                data = {"data": json.dumps({"dataSource": json.loads(flags.data_source)})}
            except ValueError as exc:
                raise CliError(f"--data-source is not valid JSON: {exc}") from exc
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
    pprint_json({"execId": body["id"], "appId": body["appId"]})
    return 0


def cmd_exec_get_all(client: Client, flags) -> int:
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


def cmd_frameworks(client: Client, flags) -> int:
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


def cmd_exec_result(client: Client, exec_id: str) -> int:
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
    slots = ",".join(f"{s['host']}:{s['slot']}" for s in e.get("slots") or [])
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
    return "  ".join(parts)


def cmd_exec_watch(client: Client, exec_id: str, interval: float, timeout: float) -> int:
    """Poll the exec and show its state, slots and progress until it ends. On a terminal one
    line is redrawn in place and kept whenever the state or the slot count changes."""
    tty = sys.stdout.isatty()
    deadline = time.monotonic() + timeout if timeout > 0 else None
    last_key = last_progress = None
    while True:
        resp = client.request("GET", f"{client.dli}/execs/{exec_id}")
        if not resp.ok:
            return fail_response(resp, f"Watch exec {exec_id}")
        e = resp.json()
        line = watch_line(e)
        key = (e.get("state"), e.get("workers"), e.get("targetWorkers"), e.get("priority"))
        if tty:
            width = shutil.get_terminal_size((120, 24)).columns
            end = "\n" if key != last_key and last_key is not None else ""
            sys.stdout.write(end + "\r" + line[:width].ljust(min(width, 200)))
            sys.stdout.flush()
        elif key != last_key or e.get("progress") != last_progress:
            print(line, flush=True)
        last_key, last_progress = key, e.get("progress")
        state = e.get("state")
        if state in TERMINAL_STATES:
            if tty:
                print()
            error = f" ({e['error']})" if e.get("error") else ""
            print(f"Exec {e.get('id')} ended: {state}{error}")
            return 0 if state == "FINISHED" else 1
        if deadline is not None and time.monotonic() >= deadline:
            if tty:
                print()
            print(f"Stopped watching exec {e.get('id')} after {timeout:g} s; it is {state}.")
            return 2
        time.sleep(max(interval, 0.1))


def run(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print_help()
        return 0 if argv else 1
    command = next((a for a in argv if a.split("=", 1)[0] in COMMANDS), None)
    if command is None:
        print_help()
        return 1
    command = command.split("=", 1)[0]
    own, user_args = split_user_args(argv)
    flags, _unknown = build_parser().parse_known_args(own)
    verify = not flags.insecure
    if not verify:
        _disable_tls_warnings()
    if command == "--logon":
        return cmd_logon(flags, verify)

    session = load_session()
    token = flags.jwt_token or session.get("token")
    if flags.rest_host:
        base = resolve_base_url(flags.rest_host, flags.rest_port, verify)
    elif session.get("base_url"):
        base = session["base_url"]
    else:
        raise CliError("--rest-host is required (or run dlicmd --logon --rest-host ... first)")
    client = Client(base, token, verify)
    if command == "--logoff":
        return cmd_logoff(client)
    if not token:
        raise CliError("Unable to find a token. Please log on first: dlicmd --logon ...")

    if command == "--status":
        resp = client.request("GET", client.dli + "/status")
        if not resp.ok:
            return fail_response(resp, "Status")
        pprint_json(resp.json())
        return 0
    if command == "--dl-frameworks":
        return cmd_frameworks(client, flags)
    if command == "--exec-start":
        return cmd_exec_start(client, flags, argv)
    if command == "--exec-get-all":
        return cmd_exec_get_all(client, flags)
    if command == "--exec-priority":
        exec_id, priority = flags.exec_priority
        resp = client.request("POST", f"{client.dli}/execs/{exec_id}/priority",
                              json={"priority": priority})
        if not resp.ok:
            return fail_response(resp, f"Set priority of exec {exec_id}")
        print(f"Priority of exec {resp.json()['id']} is now {resp.json()['priority']}.")
        return 0
    exec_id = flags.exec_id
    if not exec_id:
        raise CliError(f"{command} needs an exec id")
    if command == "--exec-get":
        resp = client.request("GET", f"{client.dli}/execs/{exec_id}")
        if not resp.ok:
            return fail_response(resp, f"Get exec {exec_id}")
        pprint_json(resp.json())
        return 0
    if command == "--exec-stop":
        resp = client.request("POST", f"{client.dli}/execs/{exec_id}/stop")
        if not resp.ok:
            return fail_response(resp, f"Stop exec {exec_id}")
        state = resp.json()["state"]
        print(f"Stop exec {exec_id} succeed. HTTP:{resp.status_code} state {state}")
        return 0
    if command == "--exec-delete":
        resp = client.request("DELETE", f"{client.dli}/execs/{exec_id}")
        if not resp.ok:
            return fail_response(resp, f"Delete exec {exec_id}")
        print(f"Delete exec {exec_id} succeed. HTTP:{resp.status_code}")
        return 0
    if command in LOG_TYPES:
        resp = client.request("GET", f"{client.dli}/execs/{exec_id}/log",
                              params={"logType": LOG_TYPES[command]}, accept="text/plain")
        if not resp.ok:
            return fail_response(resp, f"Get logs of exec {exec_id}")
        text = resp.text
        sys.stdout.write(text if not text or text.endswith("\n") else text + "\n")
        return 0
    if command == "--exec-trainresult":
        return cmd_exec_result(client, exec_id)
    if command == "--exec-watch":
        return cmd_exec_watch(client, exec_id, flags.interval, flags.watch_timeout)
    print_help()
    return 1


def main(argv: list[str] | None = None) -> int:
    try:
        return run(list(sys.argv[1:] if argv is None else argv))
    except CliError as exc:
        print(f"[Error]: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("Interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
