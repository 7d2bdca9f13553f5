"""Building job environments on a host: an admin's environment (a *base*) and a model's
requirements on top of one (a *layer*). No Django here: the agent calls it with plain values.

A base is a virtual environment made from the product's own interpreter, its packages installed
by that environment's own pip, so that the host's pip configuration applies (mirrors,
find-links, constraints: a host may have torch's wheels on local disk, where uv would download
gigabytes). It is built by the agent's account into a folder every job reads and none writes.

A layer is a virtual environment whose site-packages adds the base's (a ``.pth`` file), so the
base's torch is importable and never installed twice. uv does not see packages reachable only
through a ``.pth`` or system site-packages (astral-sh/uv#2500, #7358): the requirements are
resolved with ``uv pip compile``, the base's installed versions given as constraints, and only
what the base lacks is installed, with ``--no-deps``. A requirement is code (an sdist's setup.py
runs while it installs), so everything a layer's build runs runs as the job owner's account,
never as root, with an environment made from nothing (no secret of the service reaches it), in
the owner's own folder; what root does there is read sizes through descriptors.

Both are built in a temporary sibling folder and renamed into place only once complete: a
half-built environment is never used. A failure raises ``BuildError`` with the installer's own
message (``No solution found when resolving dependencies: Because ...``), not a traceback.
"""

from __future__ import annotations

import collections
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, BinaryIO

# The folder holding ``runtime/``: a base's ``.pth`` puts it on its jobs' sys.path.
SOURCE_ROOT = Path(__file__).resolve().parents[1]
METADATA_FILE = "edt-environment.json"
PRODUCT_PTH = "edt-product.pth"
BASE_PTH = "edt-base.pth"
PROBE_TIMEOUT_S = 120.0
# How long removing a failed build's folder may take, after its own deadline passed.
CLEANUP_TIMEOUT_S = 300.0
LOG_TAIL_LINES = 80
MAX_MESSAGE = 2000
# The host's settings a base's pip reads (besides every PIP_* variable): its configuration
# files (HOME, XDG_*), proxies and certificates. Nothing else of the agent's environment.
_BASE_KEEP = ("PATH", "LANG", "LC_ALL", "HOME", "TMPDIR", "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS",
              "XDG_CACHE_HOME", "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE",
              "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "ALL_PROXY", "http_proxy",
              "https_proxy", "no_proxy", "all_proxy", "CUDA_HOME")
# The cluster's index for a layer's uv, as the admin set it in the agent's environment. uv's
# configuration files are ignored (UV_NO_CONFIG): the owner's own (~/.config/uv, in a folder
# their jobs write) or one planted in /tmp would point the installer elsewhere.
_LAYER_KEEP = ("UV_DEFAULT_INDEX", "UV_INDEX", "UV_INDEX_URL", "UV_EXTRA_INDEX_URL",
               "UV_FIND_LINKS", "UV_INDEX_STRATEGY", "UV_NATIVE_TLS", "UV_HTTP_TIMEOUT",
               "UV_OFFLINE", "SSL_CERT_FILE", "SSL_CERT_DIR", "HTTP_PROXY", "HTTPS_PROXY",
               "NO_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "no_proxy", "all_proxy")
_PATH = "/usr/local/bin:/usr/bin:/bin"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_DEPTH = 100
# A PEP 440 public version: only these can be handed to uv as a constraint.
_VERSION = re.compile(r"^\d+(\.\d+)*((a|b|rc)\d+)?(\.post\d+)?(\.dev\d+)?$", re.IGNORECASE)
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)$")
_PREFIX = re.compile(r"^\s*(error|cause|caused by|hint|ERROR)\s*:\s*", re.IGNORECASE)

# Lists what an interpreter holds: its distributions {normalised name: version}, the top-level
# modules they and its site folders provide (not the standard library's), its site-packages.
_PROBE = r"""
import importlib.metadata as md, json, os, pkgutil, re, site, sys, sysconfig
installed = {}
for d in md.distributions():
    name = d.metadata["Name"]
    if name:
        installed.setdefault(re.sub(r"[-_.]+", "-", name).lower(), d.version)
std = {sysconfig.get_path("stdlib"), sysconfig.get_path("platstdlib")}
std |= {os.path.join(p, "lib-dynload") for p in list(std)}
paths = [p for p in sys.path if p and p not in std and not p.endswith(".zip")
         and os.path.isdir(p)]
names = set(md.packages_distributions()) | {m.name for m in pkgutil.iter_modules(paths)}
modules = sorted(n for n in names if n.isidentifier() and not n.startswith("__"))
print(json.dumps({"installed": installed, "modules": modules, "site": site.getsitepackages(),
                  "purelib": sysconfig.get_path("purelib"),
                  "version": ".".join(map(str, sys.version_info[:3]))}))
"""

# The few changes to a layer's folder, run as its owner's account (root changes nothing by
# name in a folder the owner's jobs write): a new file, a removal, the rename into place
# (``swap``: replacing what was there; ``place``: unless a build of the same layer finished
# first, whose files are the same and may be in use), the leftovers of builds that were killed.
_OPS = r"""
import os, shutil, sys, time
op, args = sys.argv[1], sys.argv[2:]
def remove(p):
    if os.path.islink(p) or os.path.isfile(p):
        os.unlink(p)
    else:
        shutil.rmtree(p, ignore_errors=True)
if op == "write":
    with open(args[0], "x", encoding="utf-8") as f:
        f.write(args[1])
elif op == "remove":
    for p in args:
        if os.path.lexists(p):
            remove(p)
elif op == "swap":
    tmp, final, old = args
    if os.path.lexists(final):
        os.rename(final, old)
    os.rename(tmp, final)
    if os.path.lexists(old):
        remove(old)
elif op == "place":
    tmp, final = args
    try:
        os.rename(tmp, final)
    except OSError:
        if os.path.islink(final) or not os.path.isdir(final):
            raise
        remove(tmp)
elif op == "sweep":
    parent, prefix, age = args[0], args[1], float(args[2])
    for n in os.listdir(parent):
        p = os.path.join(parent, n)
        if n.startswith(prefix) and time.time() - os.lstat(p).st_mtime > age:
            remove(p)
"""


@dataclass
class Built:
    """A ready environment: its interpreter, what it holds, its size and build time."""

    python: str
    installed: dict[str, str]
    modules: list[str]
    size_bytes: int
    seconds: float


class BuildError(Exception):
    """A build that failed: the message says why in the installer's words (for the job's
    owner); ``log_tail`` is the end of the build's output (for the Environments page)."""

    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class BuildTimeout(BuildError):
    """A build that ran out of time (its processes were killed)."""


def layer_folder(root: Path, owner_key: str, key: str) -> Path:
    """Where an owner's layer of cache key ``key`` lives under a host's environments folder:
    the owner's own folder (``users/<owner_key>``), which their builds write and nobody
    else's jobs enter."""
    for part in (owner_key, key):
        if not re.fullmatch(r"[A-Za-z0-9_-]+", part or ""):
            raise ValueError(f"{part!r} cannot name a folder of layers")
    return Path(root) / "users" / owner_key / key[:16]


# --- the build's log, its deadline, its processes ----------------------------------------------


class _Log:
    """The build's output: written to the caller's log as it comes, its last lines kept."""

    def __init__(self, log: BinaryIO | IO[bytes] | Path | str) -> None:
        self._owned = isinstance(log, (str, os.PathLike))
        self._file = open(log, "ab") if self._owned else log  # closed by __exit__
        self._lock = threading.Lock()
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)

    def write(self, data: bytes) -> None:
        with self._lock:
            self._tail.extend(data.decode("utf-8", "replace").splitlines())
            try:
                self._file.write(data)
                self._file.flush()
            except (OSError, ValueError):
                pass  # a log that cannot be written must not fail the build

    def tail(self) -> str:
        with self._lock:
            return "\n".join(self._tail)

    def __enter__(self) -> _Log:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._owned:
            self._file.close()


@dataclass
class _Context:
    """How a build's processes run: as whom, with what environment, until when."""

    log: _Log
    timeout_s: float
    env: dict[str, str]
    account: tuple[int, int] | None
    cwd: str
    # The interpreter that runs ``_OPS`` (as the account).
    ops_python: str
    # No file a process writes may grow past this (RLIMIT_FSIZE): a layer's size limit.
    max_file_bytes: int = 0
    started: float = 0.0

    def __post_init__(self) -> None:
        self.started = self.started or time.monotonic()

    def left(self) -> float:
        """Seconds left to the build; BuildTimeout once none are."""
        left = self.started + self.timeout_s - time.monotonic()
        if left <= 0:
            raise self.timed_out()
        return left

    def timed_out(self) -> BuildTimeout:
        return BuildTimeout(f"the build took longer than {self.timeout_s:g} s", self.log.tail())


def _pump(stream: IO[bytes], log: _Log, keep: bytearray | collections.deque) -> None:
    for line in iter(stream.readline, b""):
        log.write(line)
        if isinstance(keep, bytearray):
            keep.extend(line)
        else:
            keep.append(line.decode("utf-8", "replace"))
    stream.close()


def _run(argv: list[str], ctx: _Context) -> bytes:
    """Run one step of the build; its standard output. Every line goes to the log. Runs in a
    process group of its own as the build's account, killed whole at the deadline; a step
    that fails raises BuildError with its own error lines."""
    # A program's or a file's text as an argument (``-c``) is not repeated in the log.
    shown = ["..." if "\n" in arg else arg for arg in argv]
    ctx.log.write(("$ " + " ".join(shown) + "\n").encode())
    user = ctx.account
    try:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=ctx.env, cwd=ctx.cwd, close_fds=True, process_group=0, umask=0o022,
            user=user[0] if user else None, group=user[1] if user else None,
            extra_groups=[] if user else None)
    except OSError as exc:
        raise BuildError(f"{argv[0]} cannot be started: {exc}", ctx.log.tail()) from None
    if ctx.max_file_bytes:
        _limit_files(proc.pid, ctx.max_file_bytes)
    out, err = bytearray(), collections.deque(maxlen=200)
    pumps = [threading.Thread(target=_pump, args=(proc.stdout, ctx.log, out), daemon=True),
             threading.Thread(target=_pump, args=(proc.stderr, ctx.log, err), daemon=True)]
    for pump in pumps:
        pump.start()
    try:
        rc = proc.wait(timeout=ctx.left())
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        _kill_group(proc)  # at the deadline, or stragglers a finished step left behind
        for pump in pumps:
            pump.join(5)
    if rc is None:
        raise ctx.timed_out()
    if rc:
        raise BuildError(_failure(argv, rc, list(err), ctx.max_file_bytes), ctx.log.tail())
    return bytes(out)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _limit_files(pid: int, limit: int) -> None:
    """No file of the step larger than the layer may be (a big wheel fails while it
    downloads, not after). Set at once after the start; what it starts inherits it."""
    import resource

    try:
        resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, limit))
        resource.prlimit(pid, resource.RLIMIT_CORE, (0, 0))  # no core of a killed installer
    except (OSError, ValueError):
        pass  # the step already ended, or this host refuses: the size check after install


def _failure(argv: list[str], rc: int, err: list[str], max_file_bytes: int) -> str:
    """The installer's own words for why a step failed: its error lines (uv: ``error: ...``
    then ``cause: ...``; pip: ``ERROR: ...``), else its last line."""
    what = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(argv[:3]))
    if rc == -signal.SIGXFSZ:
        return (f"{what} was stopped: it wrote a file larger than the environment's limit of "
                f"{format_bytes(max_file_bytes)}")
    if rc < 0:
        return f"{what} was killed by signal {-rc}"
    lines = [line.rstrip() for line in err if line.strip()]
    first = next((i for i, line in enumerate(lines) if re.match(r"^\s*error\s*:", line, re.I)),
                 None)
    parts: list[str] = []
    for line in lines[first:first + 12] if first is not None else lines[-1:]:
        text = _PREFIX.sub("", line).strip()
        if parts and not _PREFIX.match(line):
            parts[-1] += " " + text  # a line the installer wrapped
        else:
            parts.append(text.rstrip(":"))
    message = ": ".join(p for p in parts if p) or f"{what} failed with exit code {rc}"
    return message[:MAX_MESSAGE]


def format_bytes(size: int) -> str:
    """``2 GiB``, ``1.2 MiB``: a size in words."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.3g} {unit}"
    return f"{size} bytes"


def _op(ctx: _Context, op: str, *args: str) -> None:
    """One of ``_OPS`` on the build's folder, as the build's account; ``-I -S``: nothing of
    the environment it runs in or of the folder's own files runs."""
    _run([ctx.ops_python, "-I", "-S", "-c", _OPS, op, *map(str, args)], ctx)


def _clean_up(ctx: _Context, path: Path) -> None:
    """Remove a failed build's folder, on a deadline of its own (the build's may be over)."""
    cleanup = _Context(ctx.log, CLEANUP_TIMEOUT_S, ctx.env, ctx.account, ctx.cwd,
                       ctx.ops_python)
    try:
        _op(cleanup, "remove", str(path))
    except (BuildError, OSError) as exc:
        ctx.log.write(f"--- {path} not removed: {exc}\n".encode())


def _temp_sibling(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.building-{secrets.token_hex(6)}"


def _sweep(ctx: _Context, folder: Path) -> None:
    """Remove the half-built folders of builds of ``folder`` that were killed (the agent
    died): any older than a build may take. A build still running is younger."""
    _op(ctx, "sweep", str(folder.parent), f".{folder.name}.building-",
        str(ctx.timeout_s + 60))


def _tree_size(top: Path) -> int:
    """Bytes under ``top``, each file once. Folders are entered through their parent's
    descriptor, never through a link (``O_NOFOLLOW``), never anything but a folder
    (``O_DIRECTORY``: no FIFO to block on): the owner's jobs may swap what is measured."""
    seen: set[tuple[int, int]] = set()

    def walk(fd: int, depth: int) -> int:
        total = 0
        with os.scandir(fd) as entries:
            for entry in entries:
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
                if entry.is_dir(follow_symlinks=False) and depth < _MAX_DEPTH:
                    try:
                        sub = os.open(entry.name, _DIR, dir_fd=fd)
                    except OSError:
                        continue
                    try:
                        total += walk(sub, depth + 1)
                    finally:
                        os.close(sub)
        return total

    fd = os.open(top, _DIR)
    try:
        return walk(fd, 0)
    finally:
        os.close(fd)


# --- what an interpreter holds ----------------------------------------------------------------


def _inspect(python: str, ctx: _Context) -> dict:
    """What ``python`` holds (``_PROBE``), run as the build's account: importing a site
    folder runs its ``.pth`` files, which are code."""
    quiet = _Context(_Log(_Sink()), ctx.timeout_s, ctx.env, ctx.account, ctx.cwd,
                     ctx.ops_python, started=ctx.started)
    try:
        return json.loads(_run([python, "-I", "-c", _PROBE], quiet))
    except BuildTimeout:
        raise ctx.timed_out() from None
    except BuildError as exc:
        raise BuildError(f"{python} cannot list what it holds: {exc}", exc.log_tail) from None
    except ValueError as exc:
        raise BuildError(f"{python} listed what it holds unreadably: {exc}") from None


class _Sink:
    """A log that keeps nothing (a probe's JSON is its result, not the build's log)."""

    def write(self, data: bytes) -> int:
        return len(data)

    def flush(self) -> None:
        pass


def probe(python: str, account: tuple[int, int] | None = None,
          timeout_s: float = PROBE_TIMEOUT_S) -> tuple[dict[str, str], list[str]]:
    """The distributions ``python`` holds ({normalised name: version}) and the top-level
    modules it can import besides the standard library's: what a model's imports are
    checked against before submit. Runs it once, as ``account`` when given: a layer's
    interpreter only ever as its owner's (its site folders' ``.pth`` files are code its owner
    could change); ``build_layer`` returns the same lists, so a layer needs no probe."""
    env = {"PATH": _PATH, "LANG": "C.UTF-8", "HOME": "/"}
    ctx = _Context(_Log(_Sink()), timeout_s, env, account, "/", sys.executable)
    info = _inspect(python, ctx)
    return info["installed"], info["modules"]


def _metadata(kind: str, info: dict, **extra: object) -> str:
    return json.dumps({"kind": kind, "python": info.get("version", ""),
                       "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), **extra}, indent=1)


# --- an admin's environment ------------------------------------------------------------------


def _base_interpreter() -> str:
    """The interpreter the product's own virtual environment was made from: a base is a
    sibling of the product's venv, not tied to it (nor to what it holds)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def _base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k in _BASE_KEEP or k.startswith("PIP_")}
    env.setdefault("PATH", _PATH)
    env.setdefault("LANG", "C.UTF-8")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _retarget(bin_dir: Path, old: str, new: str) -> None:
    """pip writes its scripts' ``#!`` line (and venv its activate scripts) with the folder
    they were built in: point them at the folder they are renamed to."""
    for entry in bin_dir.iterdir():
        if entry.is_symlink() or not entry.is_file() or entry.stat().st_size > 1 << 20:
            continue
        data = entry.read_bytes()
        if old.encode() in data:
            entry.write_bytes(data.replace(old.encode(), new.encode()))


def build_base(packages: list[str], folder: Path, log: BinaryIO | Path,
               timeout_s: float) -> Built:
    """An admin's environment at ``folder``: a venv of the product's interpreter with
    ``packages`` installed by its own pip (the host's pip configuration applies), the
    product's source root on its path (jobs import ``runtime``), readable by every account
    and writable by none but the agent's. Replaces what was at ``folder`` once complete."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(folder)
    with _Log(log) as out:
        ctx = _Context(out, timeout_s, _base_env(), None, str(folder.parent), sys.executable)
        try:
            _sweep(ctx, folder)
            info = _base_steps(packages, tmp, folder, ctx)
            size = _tree_size(tmp)
            _op(ctx, "swap", str(tmp), str(folder), str(_temp_sibling(folder)))
        except BaseException as exc:
            _clean_up(ctx, tmp)
            if isinstance(exc, OSError):
                raise BuildError(f"the environment cannot be written: {exc}",
                                 out.tail()) from None
            raise
    return Built(str(folder / "bin" / "python"), info["installed"], info["modules"], size,
                 time.monotonic() - ctx.started)


def adopt_base(packages: list[str], folder: Path) -> Built | None:
    """The complete base already at ``folder`` when it was built of these same ``packages``
    (an agent started again on a fresh database, an image built ahead of time, another
    checkout's cache): its product path set to this product's source root, nothing
    installed. None when there is none, or it holds another set. The folder is the agent's
    own (a base): reading it by name is safe."""
    folder = Path(folder)
    try:
        recorded = json.loads((folder / METADATA_FILE).read_text())
    except (OSError, ValueError):
        return None
    python = folder / "bin" / "python"
    # The same set, whatever its order (the admin's lines are kept sorted; a caller's may not).
    if sorted(recorded.get("packages") or []) != sorted(packages) or not python.exists():
        return None
    started = time.monotonic()
    ctx = _Context(_Log(_Sink()), PROBE_TIMEOUT_S, _base_env(), None, str(folder.parent),
                   sys.executable)
    try:
        site = Path(_inspect(str(python), ctx)["purelib"])
        (site / PRODUCT_PTH).write_text(f"{SOURCE_ROOT}\n")
        info = _inspect(str(python), ctx)
    except (BuildError, OSError):
        return None  # broken: built again
    return Built(str(python), info["installed"], info["modules"], _tree_size(folder),
                 time.monotonic() - started)


def _base_steps(packages: list[str], tmp: Path, folder: Path, ctx: _Context) -> dict:
    """Make the base in ``tmp`` (to be renamed ``folder``); what it holds (``_PROBE``)."""
    _run([_base_interpreter(), "-m", "venv", str(tmp)], ctx)
    python = str(tmp / "bin" / "python")
    if packages:
        _run([python, "-m", "pip", "install", "--no-input", "--progress-bar", "off",
              *packages], ctx)
    site = Path(_inspect(python, ctx)["purelib"])
    (site / PRODUCT_PTH).write_text(f"{SOURCE_ROOT}\n")
    info = _inspect(python, ctx)
    _retarget(tmp / "bin", str(tmp), str(folder))
    (tmp / METADATA_FILE).write_text(_metadata("base", info, packages=list(packages)))
    # Every account reads it (jobs run as their owners), only the agent's writes it.
    os.chmod(tmp, 0o755)  # noqa: S103  # nosec B103 - every job account reads, none writes
    return info


# --- a model's requirements on a base --------------------------------------------------------


def _uv() -> str:
    """The product's uv (a dependency of the product: ``uv`` on PyPI)."""
    try:
        from uv import find_uv_bin

        return find_uv_bin()
    except (ImportError, FileNotFoundError):
        found = shutil.which("uv")
        if found is None:
            raise BuildError("uv is not installed on this host") from None
        return found


def _layer_env(home: Path, account: tuple[int, int] | None) -> dict[str, str]:
    """A layer build's environment, made from nothing: the owner's folder as HOME and uv's
    cache, the cluster's index settings, no secret of the service."""
    env = {k: os.environ[k] for k in _LAYER_KEEP if k in os.environ}
    env.update(PATH=_PATH, LANG="C.UTF-8", HOME=str(home), UV_CACHE_DIR=str(home / ".uv-cache"),
               XDG_CACHE_HOME=str(home / ".cache"), UV_NO_CONFIG="1",
               UV_PYTHON_DOWNLOADS="never", UV_NO_PROGRESS="1",
               # The layer holds its own files: the owner's cache can be cleaned.
               UV_LINK_MODE="copy")
    if account is not None:
        # A per-owner uid has no passwd entry; libraries ask who they run as (getpass).
        env["USER"] = env["LOGNAME"] = f"edt-uid-{account[0]}"
    return env


def _public(version: str) -> str | None:
    """``version`` without its local part (``2.13.0+cpu``: an index has ``2.13.0``), or None
    when it is no PEP 440 version uv would accept as a constraint."""
    public = version.split("+", 1)[0]
    return public if _VERSION.match(public) else None


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _same_version(installed: str, resolved: str) -> bool:
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return _public(installed) == _public(resolved)
    try:
        return Version(installed).public == Version(resolved).public
    except InvalidVersion:
        return installed == resolved


class _Inputs:
    """The requirement and constraint files uv reads: in a folder of the agent's own, which
    the build's account may read (its group) and not change; removed afterwards."""

    def __init__(self, requirements: list[str], constraints: list[str],
                 account: tuple[int, int] | None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="edt-layer-"))
        self.requirements = self.folder / "requirements.in"
        self.constraints = self.folder / "constraints.txt"
        self.requirements.write_text("\n".join(requirements) + "\n")
        self.constraints.write_text("\n".join(constraints) + "\n")
        if account is not None and os.geteuid() == 0:
            for path, mode in ((self.requirements, 0o640), (self.constraints, 0o640),
                               (self.folder, 0o750)):
                os.chown(path, 0, account[1])
                os.chmod(path, mode)

    def __enter__(self) -> _Inputs:
        return self

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def _resolve(uv: str, python: str, inputs: _Inputs, ctx: _Context) -> list[tuple[str, str]]:
    """The requirements resolved against the base's versions: (name, version) pins."""
    out = _run([uv, "pip", "compile", str(inputs.requirements), "-c", str(inputs.constraints),
                "--python", python, "--no-header", "--no-annotate"], ctx)
    pins = []
    for line in out.decode("utf-8", "replace").splitlines():
        line = line.split("#", 1)[0].strip()
        if (match := _PIN.match(line)) is not None:
            pins.append((_normal(match[1]), match[2]))
        elif line:
            ctx.log.write(f"--- ignored a line of the resolution: {line}\n".encode())
    return pins


def _constraints(base_installed: dict[str, str]) -> list[str]:
    """The base's versions, as constraints: a layer never replaces what the base holds."""
    found = ((name, _public(version)) for name, version in sorted(base_installed.items()))
    return [f"{name}=={version}" for name, version in found if version]


def _base_pth(sites: list[str]) -> str:
    """A ``.pth`` line that adds the base's site folders after the layer's own, processing
    their ``.pth`` files too (the base's own puts the product's source root on the path)."""
    return "import site; " + "; ".join(f"site.addsitedir({s!r})" for s in sites) + "\n"


def _layer_steps(base_python: str, base_installed: dict[str, str], tmp: Path,
                 inputs: _Inputs, ctx: _Context) -> list[str]:
    """Make the layer in ``tmp``: its venv, the base's site folders on its path, what the
    base lacks installed; the pins installed."""
    uv = _uv()
    _run([uv, "venv", "--relocatable", "--python", base_python, str(tmp)], ctx)
    python = str(tmp / "bin" / "python")
    sites = _inspect(base_python, ctx)["site"]
    _op(ctx, "write", str(Path(_inspect(python, ctx)["purelib"]) / BASE_PTH), _base_pth(sites))
    pins = _resolve(uv, python, inputs, ctx)
    new = [f"{name}=={version}" for name, version in pins
           if not (name in base_installed and _same_version(base_installed[name], version))]
    if new:
        _run([uv, "pip", "install", "--no-deps", "--python", python, *new], ctx)
    else:
        ctx.log.write(b"--- the base holds every requirement already: nothing to install\n")
    return new


def build_layer(base_python: str, base_installed: dict[str, str], requirements: list[str],
                folder: Path, log: BinaryIO | Path, timeout_s: float, max_bytes: int,
                account: tuple[int, int] | None) -> Built:
    """A model's ``requirements`` on the base of interpreter ``base_python`` (which holds
    ``base_installed``), at ``folder`` in its owner's folder (which exists, the owner's).
    Everything it runs runs as ``account`` (uid, gid) when given; at most ``timeout_s``
    seconds and ``max_bytes`` bytes. Kept at ``folder`` once complete, unless another build
    put it there first."""
    folder = Path(folder)
    home = folder.parent
    if not home.is_dir():
        raise BuildError(f"{home} is missing: the owner's folder of layers comes first")
    base = {_normal(name): version for name, version in base_installed.items()}
    tmp = _temp_sibling(folder)
    with _Log(log) as out, _Inputs(requirements, _constraints(base), account) as inputs:
        ctx = _Context(out, timeout_s, _layer_env(home, account), account, str(inputs.folder),
                       base_python, max_file_bytes=max_bytes)
        try:
            _sweep(ctx, folder)
            new = _layer_steps(base_python, base, tmp, inputs, ctx)
            size = _tree_size(tmp)
            if size > max_bytes:
                raise BuildError(f"the environment takes {format_bytes(size)}, more than its "
                                 f"limit of {format_bytes(max_bytes)}", out.tail())
            info = _inspect(str(tmp / "bin" / "python"), ctx)
            _op(ctx, "write", str(tmp / METADATA_FILE), _metadata(
                "layer", info, base=base_python, requirements=requirements, installed=new))
            # A layer's folder is named by its requirement set: one already there holds the
            # same, and a job of its owner may be running in it.
            _op(ctx, "place", str(tmp), str(folder))
        except BaseException:
            _clean_up(ctx, tmp)
            raise
    return Built(str(folder / "bin" / "python"), info["installed"], info["modules"], size,
                 time.monotonic() - ctx.started)
