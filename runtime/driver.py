"""The driver: one per job. Rendezvous, membership, metrics, checkpoints, final model.

It runs the user's script with ``EDT_ROLE=driver``; ``FabricModel.train()`` then serves
the control endpoint (JSON over TCP, see :mod:`runtime.wire`) instead of training, and
returns when the job finished (exits ``DRIVER_EXIT_FAILED`` when it FAILED,
``DRIVER_EXIT_STOPPED`` when it was stopped). It also keeps the keys the workers' process
groups rendezvous on (:mod:`runtime.store`), served on the same endpoint: the driver
listens on one port only.

The endpoint binds ``EDT_DRIVER_HOST`` and serves only connections that prove they hold
the job's secret (``EDT_JOB_SECRET``) first; any other is closed with nothing served.
Operations (``{"op": ...}``):

- workers: ``link`` (persistent: heartbeats, reports; replies carry ``pending``),
  ``join``, ``sync``, ``fetch_state``, ``upload_state`` (kind checkpoint | handoff |
  final | stop, payload = state blob), ``upload_onnx``, ``done``, ``error``, ``store``;
- the host agent (:mod:`runtime.control`): ``status``, ``leave``, ``stop``.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import socketserver
import threading
import time
import traceback
from typing import Any

from . import checkpoint, events, wire
from . import state as state_mod
from .callbacks import ELogLogger, call
from .config import DRIVER_EXIT_FAILED, DRIVER_EXIT_STOPPED, DriverState, JobEnv
from .rendezvous import Rendezvous
from .reports import Reports
from .results import Results
from .store import KeyValue

log = logging.getLogger("edt.driver")


def _advertise_host(env: JobEnv) -> str:
    host = os.environ.get("EDT_DRIVER_ADVERTISE_HOST")
    if host:
        return host
    if env.driver_host in ("127.0.0.1", "localhost", ""):
        return "127.0.0.1"
    if env.driver_host not in ("0.0.0.0", "::"):
        return env.driver_host
    return socket.gethostname()


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def _peer(address: Any) -> str:
    host, port = address[0], address[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


class Driver:
    def __init__(self, env: JobEnv, logger: Any, cfg: dict[str, Any]) -> None:
        self.env = env
        self.logger = logger if logger is not None else ELogLogger(env.result_dir)
        self.cfg = cfg
        self.results = Results(env.result_dir, env.checkpoint_dir, env.keep_epoch_models,
                               env.keep_best_by)
        self.done = threading.Event()
        self.outcome = DriverState.RUNNING
        self.error: str | None = None
        self.final_saved = False
        self.epoch = 0
        self.iteration = 0
        self.global_step = 0
        self.state = DriverState.STARTING
        self.reports = Reports(self.logger, env.metrics_interval_s,
                               on_test=self.results.note_test)
        self._lock = threading.Lock()
        self.addr = ""
        self._ops = {
            "join": self._op_join, "store": self._op_store, "sync": self._op_sync,
            "fetch_state": self._op_fetch_state, "upload_state": self._op_upload_state,
            "upload_onnx": self._op_upload_onnx, "done": self._op_done,
            "error": self._op_error, "status": self._op_status, "leave": self._op_leave,
            "stop": self._op_stop,
        }

    # -- lifecycle --------------------------------------------------------------------
    def run(self) -> str:
        env = self.env
        bind = env.driver_host or "127.0.0.1"
        host = _advertise_host(env)
        self.kv = KeyValue()
        self.rdzv = Rendezvous(
            min_workers=env.min_workers,
            max_workers=env.max_workers,
            grace_s=env.rdzv_grace_s,
            peer_timeout_s=env.peer_timeout_s,
            late_after_s=env.collective_timeout_s,
            on_event=_emit_and_log,
        )
        blob = checkpoint.load_latest(env.checkpoint_dir)
        if blob is not None:
            self.rdzv.put_state(blob)
            pos = state_mod.loads(blob)["position"]
            self.epoch = pos["epoch"]
            print(f"Resuming from checkpoint at epoch {pos['epoch']}", flush=True)
        server_class = _Server6 if ":" in bind else _Server
        server = server_class((bind, env.driver_port), self._handler_class())
        port = server.server_address[1]
        self.addr = f"{host}:{port}"
        threading.Thread(target=server.serve_forever, name="edt-driver-server", daemon=True).start()
        if env.driver_addr_file:
            checkpoint.atomic_write(env.driver_addr_file, self.addr.encode())
        self.state = DriverState.RUNNING
        events.emit("job.state", state=DriverState.RUNNING, driver_addr=self.addr)
        call(self.logger, "on_train_begin")
        try:
            while not self.done.is_set():
                self.rdzv.tick()
                self._give_up_broken()
                self._check_end()
                # Every request and report notifies; the timeout only drives the clocks
                # (peer timeouts, the start grace).
                self.rdzv.wait_change(0.05)
        finally:
            self.state = self.outcome
            # Give workers blocked on a reply a moment to read it before the server dies.
            time.sleep(0.2)
            server.shutdown()
            server.server_close()
        call(self.logger, "on_train_end")
        fields = {"error": self.error} if self.error else {}
        events.emit("job.state", state=self.outcome, **fields)
        return self.outcome

    def _give_up_broken(self) -> None:
        """A generation that lost a member never forms: members still waiting in the store for
        its addresses are let go at once (see KeyValue.give_up)."""
        broken = self.rdzv.broken_generation()
        if broken is not None:
            self.kv.give_up(broken)

    def _check_end(self) -> None:
        rdzv = self.rdzv
        with rdzv.cv:
            live = rdzv.live_members()
            if self.outcome == DriverState.FINISHED and self.final_saved and not live:
                self.done.set()
            elif self.outcome == DriverState.FAILED and not live:
                self.done.set()
            elif rdzv.stop_requested and not rdzv.members and not rdzv.awaiting_upload:
                if self.outcome == DriverState.RUNNING:
                    self.outcome = DriverState.KILLED
                self.done.set()

    # -- handlers ---------------------------------------------------------------------
    def _handler_class(self) -> type[socketserver.BaseRequestHandler]:
        driver = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    wire.accept(sock, driver.env.secret)
                except wire.AuthenticationError as exc:
                    # Nothing is served: whoever it was learnt a random nonce, no more.
                    log.warning("driver: refused a connection from %s: %s",
                                _peer(self.client_address), exc)
                    return
                driver._serve(sock)

        return Handler

    def _serve(self, sock: socket.socket) -> None:
        """Requests of one authenticated connection, in order, until the peer closes it."""
        while True:
            try:
                header, payload = wire.recv_msg(sock)
            except (OSError, ValueError):
                return
            op = header.get("op")
            if op == "link":
                self._link(sock, header)
                return
            try:
                reply, data = self._dispatch(op, header, payload)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                log.exception("driver: op %s failed", op)
                reply, data = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, None
            try:
                wire.send_msg(sock, reply, data)
            except OSError:
                return

    def _link(self, sock: socket.socket, header: dict[str, Any]) -> None:
        """A worker's persistent link: this thread reads its beats and reports, a second
        one pushes the membership view whenever it changes (and every ``keepalive`` s)."""
        worker_id = header["worker_id"]
        rdzv = self.rdzv
        closed = threading.Event()
        threading.Thread(target=self._push, args=(sock, closed), daemon=True,
                         name=f"edt-push-{worker_id}").start()
        try:
            while True:
                msg, _ = wire.recv_msg(sock)
                rdzv.heartbeat(worker_id)
                for report in msg.get("reports", []):
                    self._report(worker_id, report)
        except (OSError, ValueError):
            pass
        finally:
            closed.set()
            rdzv.link_closed(worker_id)

    def _push(self, sock: socket.socket, closed: threading.Event) -> None:
        keepalive = min(1.0, self.env.peer_timeout_s / 4)
        last: tuple | None = None
        sent_at = 0.0
        try:
            while not closed.is_set():
                view = self.rdzv.wait_view(last, max(0.0, sent_at + keepalive - time.monotonic()))
                if closed.is_set():
                    return
                if view != last or time.monotonic() - sent_at >= keepalive:
                    generation, pending, stop, broken = view
                    wire.send_msg(sock, {"generation": generation, "pending": pending,
                                         "stop": stop, "broken": broken})
                    last, sent_at = view, time.monotonic()
        except (OSError, ValueError):
            try:
                sock.shutdown(socket.SHUT_RDWR)  # unblock the reader too
            except OSError:
                pass

    def _dispatch(self, op: str, h: dict[str, Any], payload: bytes | None):
        handler = self._ops.get(op)  # each: (header, payload) -> (reply, payload)
        if handler is None:
            return {"ok": False, "error": f"unknown op {op!r}"}, None
        return handler(h, payload)

    # A request's own ``timeout`` bounds how long the driver may hold it (default an hour).
    @staticmethod
    def _timeout(h: dict[str, Any]) -> float:
        return float(h.get("timeout") or 3600)

    def _op_store(self, h: dict[str, Any], payload: bytes | None) -> tuple[dict, bytes | None]:
        return self.kv.handle(h, payload)

    def _op_join(self, h: dict[str, Any], _: bytes | None) -> tuple[dict, None]:
        if self.outcome != DriverState.RUNNING or self.rdzv.stop_requested:
            return {"action": "stop", "upload": False}, None
        reply = self.rdzv.join(h["worker_id"], self._timeout(h))
        return (reply or {"action": "wait_timeout"}), None

    def _op_sync(self, h: dict[str, Any], _: bytes | None) -> tuple[dict, None]:
        return self.rdzv.sync(h["worker_id"], int(h["generation"]), int(h["global_step"]),
                              bool(h.get("failed")), self._timeout(h)), None

    def _op_fetch_state(self, h: dict[str, Any], _: bytes | None) -> tuple[dict, bytes | None]:
        blob = self.rdzv.get_state(int(h.get("min_version", 1)), self._timeout(h))
        if blob is None:
            return {"ok": False, "error": "no state available in time"}, None
        return {"ok": True}, blob

    def _op_upload_state(self, h: dict[str, Any], payload: bytes | None) -> tuple[dict, None]:
        return self._upload(h, payload or b""), None

    def _op_upload_onnx(self, _: dict[str, Any], payload: bytes | None) -> tuple[dict, None]:
        if payload:
            self.results.save_onnx(payload)
        return {"ok": True}, None

    def _op_done(self, h: dict[str, Any], _: bytes | None) -> tuple[dict, None]:
        self.rdzv.mark_finished(h["worker_id"])
        return {"ok": True}, None

    def _op_error(self, h: dict[str, Any], _: bytes | None) -> tuple[dict, None]:
        self._fail(h.get("message", "worker failed"), h.get("traceback", ""), h.get("worker_id"))
        return {"ok": True}, None

    def _op_status(self, _: dict[str, Any], __: bytes | None) -> tuple[dict, None]:
        return self.status(), None

    def _op_leave(self, h: dict[str, Any], _: bytes | None) -> tuple[dict, None]:
        worker_id = h["worker_id"]
        if not self.rdzv.request_leave(worker_id):
            return {"ok": False, "error": f"unknown worker {worker_id!r}"}, None
        wait = h.get("wait", True)
        reason = self.rdzv.wait_left(worker_id, self._timeout(h)) if wait else None
        return {"ok": True, "left": reason is not None, "reason": reason}, None

    def _op_stop(self, h: dict[str, Any], _: bytes | None) -> tuple[dict, None]:
        self.rdzv.request_stop(bool(h.get("checkpoint", False)))
        return {"ok": True}, None

    def _upload(self, h: dict[str, Any], blob: bytes) -> dict[str, Any]:
        kind = h.get("kind")
        st = state_mod.loads(blob)
        if kind in ("handoff", "stop", "checkpoint"):
            # The driver keeps the latest state, so that if every worker is lost the next
            # ones resume from it without a restart.
            self.rdzv.put_state(blob)
        if kind == "stop":
            self.rdzv.awaiting_upload = None
        if kind in ("checkpoint", "stop"):
            self.results.save_checkpoint(blob)
        if kind == "final":
            self.rdzv.put_state(blob)
            self.results.save_final(blob)
            with self._lock:
                self.final_saved = True
                if self.outcome == DriverState.RUNNING:
                    self.outcome = DriverState.FINISHED
        return {"ok": True, "position": st["position"]}

    def _fail(self, message: str, tb: str, worker_id: str | None) -> None:
        with self._lock:
            first = self.outcome != DriverState.FAILED
            self.outcome = DriverState.FAILED
            self.error = self.error or message
        if first:
            if tb:
                print(tb, flush=True)
            print(f"Job FAILED: {message}", flush=True)
            events.emit("error", message=message, traceback=tb, worker_id=worker_id)
        self.rdzv.request_stop(checkpoint=False)

    # -- metrics ----------------------------------------------------------------------
    def _report(self, worker_id: str, r: dict[str, Any]) -> None:
        try:
            self.reports.handle(r)
        except Exception:  # noqa: BLE001 - a broken logger callback must not hang the job
            self._fail("driver logger callback raised", traceback.format_exc(), None)
        self.epoch, self.iteration = self.reports.epoch, self.reports.iteration
        self.global_step = self.reports.global_step
        self.rdzv.position = {"epoch": self.epoch, "iteration": self.iteration}

    def status(self) -> dict[str, Any]:
        snap = self.rdzv.snapshot()
        snap.update(
            ok=True,
            job_id=self.env.job_id,
            state=self.state if self.state != DriverState.RUNNING else self.outcome,
            epoch=self.epoch,
            iteration=self.iteration,
            global_step=self.global_step,
            driver_addr=self.addr,
            config=self.cfg,
        )
        return json.loads(json.dumps(snap, default=str))


def _emit_and_log(kind: str, **fields: Any) -> None:
    """The rendezvous's events, and each rescale as a line of the job's log too."""
    events.emit(kind, **fields)
    if kind == "generation.changed" and fields.get("previous_size"):
        took = fields.get("duration_s")
        print(f"[edt] rescaled {fields['previous_size']} -> {fields['size']} workers "
              f"(generation {fields['generation']})"
              + (f" in {took:.2f} s" if took is not None else ""), flush=True)


def run_driver(env: JobEnv, logger: Any, cfg: dict[str, Any]) -> str:
    if not env.secret:
        raise RuntimeError("EDT_ROLE=driver needs EDT_JOB_SECRET: the driver serves only "
                           "connections that prove they hold the job's secret")
    events.configure(source="driver", job_id=env.job_id, log_dir=env.log_dir)
    events.capture_output()
    driver = Driver(env, logger, cfg)
    outcome = driver.run()
    if outcome == DriverState.FAILED:
        # The traceback and "Job FAILED: <why>" are the last lines of this log: the host
        # agent ends the job with them, without a retry.
        raise SystemExit(DRIVER_EXIT_FAILED)
    if outcome == DriverState.KILLED:
        # Stopped, not finished: whoever starts drivers decides what the stop meant (the
        # host agent ends the job KILLED only when the console asked for it).
        print("Job stopped on request", flush=True)
        raise SystemExit(DRIVER_EXIT_STOPPED)
    return outcome
