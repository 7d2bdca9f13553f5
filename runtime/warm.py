"""A warm process: an interpreter that has already imported torch and the runtime, and forks a
job's driver or worker on the host agent's request instead of starting a new interpreter.
One of kind "tensorflow" (``python -m runtime.warm FD tensorflow``) has imported TensorFlow
too, for TensorFlow jobs' processes.

Starting a job's process from nothing costs seconds (the interpreter, then ``import torch``),
and a job growing into a freed slot waits for all of it. Here that cost is paid once, when the
agent starts: each request costs a ``fork``, and the new process goes straight to the user's
main file.

What a forked process becomes is what ``python main.py args`` started by the agent would be:

- its account: supplementary groups dropped, then the job's gid and uid (the warm process runs
  as the agent's account, root on a shared cluster, and holds nothing secret: it is started with
  an environment built from nothing, opens no connection, and reads no file of the service);
- its environment, working folder, umask and ``sys.path`` (the main file's folder, then
  ``PYTHONPATH``), exactly those of the request;
- its standard output and error: the log file the agent opened; its events pipe on fd 3;
  nothing else of the warm process stays open in it, so a job cannot send requests here;
- its control group and resource limits: it writes its own pid into the ``cgroup.procs`` files
  the request names (as root, before it takes the job's account) and lowers the ``rlimits`` it
  names, so none of the job's code runs outside them; one that cannot join exits at once (71);
- its own process group, killed with the warm process (``PR_SET_PDEATHSIG``), which itself
  ends when the agent's end of the socket closes;
- its exit code: what the interpreter would exit with (1 after a traceback, 2 when the main
  file cannot be opened), sent back to the agent when the process is reaped.

The agent talks to it over a ``SOCK_SEQPACKET`` socket pair that it made (``agent.warm``):
one JSON object per message, the log and events descriptors passed with ``SCM_RIGHTS``.
Nothing outside the agent can reach that socket: it has no name.

    agent -> {"id": 7, "argv": [python, main, *args], "cwd": ..., "env": {...},
              "uid": 200001, "gid": 200001, "umask": 7,
              "cgroup": [".../edt/job-7/slot-12/cgroup.procs"],
              "rlimits": {"RLIMIT_NPROC": 8192}}   + fds [log, events]
    warm  -> {"id": 7, "pid": 4242}  or  {"id": 7, "error": "..."}
    warm  -> {"exited": 4242, "returncode": 0}            (later, once per process)

This module never imports Django: it runs the user's code.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import selectors
import signal
import socket
import sys
import traceback
from typing import Any

# What every job imports anyway, paid once here. Never CUDA: a forked child could not use it.
# torch._dynamo is imported by the first optimizer a script makes: 1.3 s of a join otherwise.
PRELOAD = ("torch", "torch.nn", "torch.optim", "torch.distributed", "torch.utils.data",
           "torch._dynamo", "runtime.fabric_model", "runtime.driver", "runtime.worker",
           "runtime.wmla")
MAX_MESSAGE = 1 << 20
EVENTS_FD = 3
_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4


class _Become(BaseException):
    """Raised in a newly forked child to leave the server's frames and run the job's code at the
    top of the stack, so that the interpreter exits exactly as it would after ``python main.py``."""

    def __init__(self, request: dict[str, Any], fds: list[int]) -> None:
        super().__init__()
        self.request, self.fds = request, fds


# A TensorFlow job's processes import TensorFlow too (2-3 s of a worker's start); its warm
# process (kind "tensorflow") imports it, and never runs an op: TensorFlow starts its thread
# pools and looks for GPUs when its first op runs, which must happen in the forked process.
PRELOAD_TENSORFLOW = ("tensorflow", "runtime.keras_model", "runtime.keras_trainer")
KINDS = ("torch", "tensorflow")

# What TensorFlow and Keras read once, when imported: a TensorFlow warm process imports them
# with its own values of these, so only a process whose variables have the same values may be
# forked from it (``agent.warm``); any other starts cold, where its own values take effect.
TENSORFLOW_IMPORT_VARS = ("TF_USE_LEGACY_KERAS", "KERAS_BACKEND", "TF_ENABLE_ONEDNN_OPTS",
                          "TF_CPP_MIN_LOG_LEVEL", "TF_CPP_MAX_VLOG_LEVEL", "TF_CPP_VMODULE")
# Keras also reads its configuration file (``$KERAS_HOME/keras.json``, else ``~/.keras``) when
# imported, and writes a default one if there is none. The warm process imports it with this
# as its KERAS_HOME, a folder that cannot exist (so a root process reads and writes nothing);
# each forked process then reads its own job's file, as its account (``_take_keras_config``).
NO_KERAS_HOME = "/proc/edt-no-keras-home"


def preload(kind: str = "torch") -> None:
    import importlib

    if kind not in KINDS:
        raise ValueError(f"unknown kind of warm process {kind!r}; expected one of {KINDS}")
    for name in PRELOAD + (PRELOAD_TENSORFLOW if kind == "tensorflow" else ()):
        importlib.import_module(name)
    import torch

    if torch.cuda.is_initialized():  # a fork would inherit a context it cannot use
        raise RuntimeError("CUDA was initialised while preloading; refusing to fork from it")
    if kind == "tensorflow":
        _check_tensorflow_idle()


def _check_tensorflow_idle() -> None:
    """TensorFlow's runtime (its eager context: thread pools, devices) must not exist yet."""
    import tensorflow as tf
    from tensorflow.python.eager import context

    tf.keras  # noqa: B018 - resolves the lazily loaded Keras (tf_keras when legacy) now
    if context.context_safe() is not None:
        raise RuntimeError("TensorFlow's runtime was started while preloading; refusing to "
                           "fork from it")


class Server:
    """Forks on request and reports each child's exit, until the agent's socket closes."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.children: set[int] = set()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(sock, selectors.EVENT_READ)
        self.selector.register(self.wake_r, selectors.EVENT_READ)

    def send(self, message: dict[str, Any]) -> None:
        self.sock.send(json.dumps(message).encode())

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select():
                if key.fileobj is self.sock and not self._request():
                    return self._stop_children()
                if key.fd == self.wake_r:
                    os.read(self.wake_r, 4096)
            self._reap()

    def _request(self) -> bool:
        data, fds, _, _ = socket.recv_fds(self.sock, MAX_MESSAGE, 4)
        if not data:
            return False  # the agent is gone
        request = json.loads(data)
        try:
            pid = os.fork()
        except OSError as exc:
            _close(fds)
            self.send({"id": request["id"], "error": f"fork failed: {exc}"})
            return True
        if pid == 0:
            self._leave()
            raise _Become(request, fds)
        _close(fds)
        try:
            os.setpgid(pid, pid)  # also done by the child: whichever runs first
        except OSError:
            pass  # the child already exec'd its group or exited
        self.children.add(pid)
        self.send({"id": request["id"], "pid": pid})
        return True

    def _reap(self) -> None:
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done, status = pid, 255 << 8
            if done:
                self.children.discard(pid)
                self.send({"exited": pid, "returncode": os.waitstatus_to_exitcode(status)})

    def _stop_children(self) -> None:
        for pid in self.children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except OSError:
                pass

    def _leave(self) -> None:
        """In the child: let go of everything the server holds."""
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # As the interpreter leaves them at start: a closed pipe raises, ^C raises.
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        self.selector.close()
        self.sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)


def _close(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _prctl(option: int, value: int) -> None:
    ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _take_fds(fds: list[int]) -> None:
    """The log on stdout and stderr, the events pipe on fd 3, nothing on stdin."""
    log_fd, events_fd = fds
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.dup2(events_fd, EVENTS_FD)
    for fd in fds:
        if fd > EVENTS_FD:
            os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    if null != 0:
        os.dup2(null, 0)
        os.close(null)


def _take_limits(request: dict[str, Any]) -> None:
    """Join the process's control group (in every hierarchy) while still root, and lower its
    resource limits: an OSError here ends the process before any of the job's code runs."""
    for procs in request.get("cgroup") or ():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))
    import resource

    for name, value in (request.get("rlimits") or {}).items():
        which = getattr(resource, name)
        hard = resource.getrlimit(which)[1]
        value = value if hard == resource.RLIM_INFINITY else min(value, hard)
        resource.setrlimit(which, (value, value))


def _take_account(request: dict[str, Any]) -> None:
    uid, gid = request.get("uid"), request.get("gid")
    if uid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        # A change of account leaves the process undumpable, and its /proc files root's; a
        # process exec'd as that account would be the account's own, so make it so.
        _prctl(_PR_SET_DUMPABLE, 1)
    if request.get("umask") is not None:
        os.umask(request["umask"])


def become(request: dict[str, Any], fds: list[int], base_path: list[str]) -> str:
    """Turn this forked child into the job's process; returns the main file to run."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setpgid(0, 0)
    _take_fds(fds)  # first: what goes wrong next is said in the job's log
    _take_limits(request)
    _take_account(request)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    main, *args = request["argv"][1:]
    sys.argv = [main, *args]
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.realpath(main)), *pythonpath, *base_path]
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    import importlib
    import tempfile

    importlib.invalidate_caches()  # folders made since the warm process started
    _take_threads()
    _take_keras_config()
    tempfile.tempdir = None  # TMPDIR is the job's
    return main


def _take_threads() -> None:
    # OpenMP read the warm process's OMP_NUM_THREADS when torch was imported; the job's wins.
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _take_keras_config() -> None:
    """What Keras does with its configuration file when imported: the preloaded Keras found
    none (``NO_KERAS_HOME``), so this process reads its job's, as Keras would have."""
    keras = sys.modules.get("tf_keras")
    if keras is None:
        return
    home = os.environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return  # none, or unreadable: Keras then keeps its defaults too
    backend = keras.backend
    backend.set_floatx(config.get("floatx", backend.floatx()))
    backend.set_epsilon(config.get("epsilon", backend.epsilon()))
    backend.set_image_data_format(config.get("image_data_format",
                                             backend.image_data_format()))


def _own_frame(tb) -> bool:
    name = tb.tb_frame.f_code.co_filename
    return name == __file__ or name.endswith(("runpy.py", "<frozen runpy>"))


def run_main(main: str) -> None:
    """Run the main file as ``__main__``, reporting an error as the interpreter would."""
    import runpy

    try:
        with open(main, "rb"):
            pass
    except OSError as exc:
        print(f"{sys.executable}: can't open file {main!r}: [Errno {exc.errno}] {exc.strerror}",
              file=sys.stderr)
        sys.exit(2)
    try:
        runpy.run_path(main, run_name="__main__")
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:
        tb = exc.__traceback__
        while tb is not None and _own_frame(tb):
            tb = tb.tb_next  # the user's frames only, as after ``python main.py``
        traceback.print_exception(type(exc), exc, tb)
        sys.exit(1)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    kind = sys.argv[2] if len(sys.argv) > 2 else "torch"
    pythonpath = set(os.environ.get("PYTHONPATH", "").split(os.pathsep))
    base_path = [p for p in sys.path[1:] if p not in pythonpath]
    server = Server(sock)
    try:
        preload(kind)
    except BaseException as exc:  # noqa: BLE001 - told to the agent, which starts processes cold
        server.send({"error": f"preload failed: {exc!r}"})
        return
    # What was preloaded (torch, the runtime: some 290,000 objects) moves out of the collector's
    # reach, once: otherwise a forked process's first full collection walks them all, which
    # takes 0.1 s and writes to every object, copying some 70 MB of pages that would stay
    # shared; and its exit walks them again, 1.2 s of CPU instead of 0.3. Frozen once, not
    # before each fork: a cycle the server itself drops later is still collected.
    gc.freeze()
    server.send({"ready": True, "pid": os.getpid()})
    try:
        server.serve()
    except _Become as child:
        try:
            target = become(child.request, child.fds, base_path)
        except OSError as exc:  # the job's account cannot enter its folder, say
            print(f"--- cannot start: {exc}", file=sys.stderr, flush=True)
            os._exit(71)
    else:
        return
    del server, sock
    try:
        run_main(target)
        code = 0
    except SystemExit as exc:
        code = _exit_code(exc.code)
    # A forked child ends as multiprocessing's do: its threads joined, the exit handlers and
    # the standard streams, then os._exit, without the interpreter's teardown. That teardown
    # would destroy the job's process groups, and the destructor of one whose member died
    # mid-collective joins gloo's thread, which waits out the collective's timeout (minutes)
    # first: a worker that finished training would hold its slot that long (found by
    # test_eight_workers_go_on_at_seven_when_rank_0_dies_mid_broadcast in runtime/tests).
    import threading

    from runtime.membership import exit_at_once

    threading._shutdown()  # the script's own threads finish first, as at any interpreter's end
    exit_at_once(code)


def _exit_code(code: object) -> int:
    """What the interpreter exits with for ``sys.exit(code)``: a message is printed, then 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    main()
