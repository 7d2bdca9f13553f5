"""Membership in generations: the driver-side state machine (no sockets here).

A *generation* is a fixed, rank-ordered member list with its own process group. The
current members train; the driver only changes membership at an iteration boundary:

1. something asks for a change: a joiner registers, a leave or stop is requested, or a
   member is lost (its link socket closed, or no heartbeat for ``peer_timeout_s``);
2. the driver pushes ``pending`` down each worker's link at once; workers raise a flag in the next
   gradient all-reduce, so every member agrees to stop after that same step (or a
   collective fails because a peer died, and the survivors arrive with ``failed``);
3. each member calls ``sync``; once every live member has arrived the driver forms generation
   ``g+1``. A member that does not arrive is waited for as long as its link beats (a long
   callback, a checkpoint being written: up to ``late_after_s``, the collectives' own
   timeout), unless the generation is broken (a member lost, or one arrived saying its
   collective failed): then the others are told so, leave whatever collective they are
   stuck in, and one that still has not arrived ``peer_timeout_s`` after the first arrival
   is dropped as "late". The next generation is:
   survivors first (the one with the most committed steps is rank 0), then joiners.
   Leavers are told to leave; when nobody stays, the furthest leaver hands its state to
   the driver first, and rank 0 of the next generation fetches it from there.

Each generation's process group uses the key prefix ``edt/<generation>/`` in the driver's
key-value store (:mod:`runtime.store`), so a stale peer cannot join a newer group; once a
generation is broken, the driver ends every wait for its keys (``broken_generation``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Arrival:
    global_step: int  # committed steps of this worker's state; -1 = it has no state
    failed: bool
    at: float = field(default_factory=time.monotonic)


class Rendezvous:
    def __init__(
        self,
        *,
        min_workers: int = 1,
        max_workers: int | None = None,
        grace_s: float = 0.5,
        peer_timeout_s: float = 20.0,
        late_after_s: float | None = None,
        on_event: Callable[..., None] | None = None,
    ) -> None:
        self.min_workers = min_workers
        self.max_workers = max_workers
        self.grace_s = grace_s
        self.peer_timeout_s = peer_timeout_s
        self.late_after_s = max(peer_timeout_s, late_after_s or peer_timeout_s)
        self._emit = on_event or (lambda *a, **k: None)
        self.cv = threading.Condition()
        self.generation = 0
        self.members: list[str] = []
        self.joiners: dict[str, float] = {}  # worker id -> registration time (ordered)
        self.arrived: dict[str, Arrival] = {}
        self.leaving: set[str] = set()
        self.lost: set[str] = set()
        # Dropped for missing a rendezvous while their link stayed up (e.g. stuck connecting
        # to a peer that died as the generation formed): reported as "late", not "lost";
        # they rejoin when they get out.
        self.late: set[str] = set()
        self.left: dict[str, str] = {}  # worker id -> reason, for status and leave waiters
        self.finished: set[str] = set()
        self.last_seen: dict[str, float] = {}
        self.assignments: dict[str, dict[str, Any]] = {}
        self.stop_requested = False
        self.stop_checkpoint = False
        self.state_blob: bytes | None = None
        self.state_version = 0
        self.position: dict[str, Any] = {}
        self.ever_formed = False
        self.awaiting_upload: str | None = None  # a stopping worker still owes its state
        self.promised_version = 0  # state version a leaving worker is about to upload
        self._last_join = 0.0
        # When the change the next generation answers was first asked for (a joiner, a
        # leave, a lost member): each rescale reports how long it took from there.
        self._change_asked: float | None = None

    # -- driver-held state -------------------------------------------------------------
    def put_state(self, blob: bytes) -> int:
        with self.cv:
            self.state_blob = blob
            self.state_version += 1
            self.cv.notify_all()
            return self.state_version

    def get_state(self, min_version: int, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        with self.cv:
            while self.state_version < min_version or self.state_blob is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cv.wait(left)
            return self.state_blob

    # -- requests from workers ---------------------------------------------------------
    def pending(self) -> bool:
        """Whether the members should stop at the next boundary."""
        with self.cv:
            return self._pending_locked()

    def _staying(self) -> list[str]:
        return [m for m in self.members if m not in self.lost and m not in self.leaving]

    def _room(self) -> bool:
        return self.max_workers is None or len(self._staying()) < self.max_workers

    def _broken_locked(self) -> bool:
        """This generation's collectives cannot all complete: a member is lost, or one
        arrived saying its collective failed (its peers may still wait on it)."""
        return any(m in self.lost for m in self.members) or any(
            a.failed for m, a in self.arrived.items() if m in self.members)

    def _pending_locked(self) -> bool:
        if not self.members:
            return False
        return bool(
            self.stop_requested
            or self.arrived
            or (self.joiners and self._room())
            or any(m in self.leaving or m in self.lost for m in self.members)
        )

    def join(self, worker_id: str, timeout: float) -> dict[str, Any] | None:
        """Register a joiner and wait for its assignment (None: not admitted in time)."""
        deadline = time.monotonic() + timeout
        with self.cv:
            if worker_id in self.members:
                # A restarted process reusing its slot id: its old self is gone.
                self.lost.add(worker_id)
            self.left.pop(worker_id, None)
            self.finished.discard(worker_id)
            self.assignments.pop(worker_id, None)
            self.joiners[worker_id] = time.monotonic()
            self.last_seen[worker_id] = time.monotonic()
            self._last_join = time.monotonic()
            self._emit("worker.joining", worker_id=worker_id, generation=self.generation)
            if not self.members or self._room():
                self._asked()
            self.cv.notify_all()
            while worker_id not in self.assignments:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.joiners.pop(worker_id, None)
                    return None
                self.cv.wait(min(left, 0.5))
            return self.assignments.pop(worker_id)

    def sync(self, worker_id: str, generation: int, global_step: int, failed: bool,
             timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.cv:
            if generation != self.generation or worker_id not in self.members or (
                worker_id in self.lost
            ):
                return {"action": "rejoin", "reason": "not a member of the current generation"}
            self.arrived[worker_id] = Arrival(global_step, failed)
            if failed:
                self._asked()
            self.last_seen[worker_id] = time.monotonic()
            self.cv.notify_all()
            while worker_id not in self.assignments:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.arrived.pop(worker_id, None)
                    return {"action": "rejoin", "reason": "rendezvous timed out"}
                self.cv.wait(min(left, 0.5))
            return self.assignments.pop(worker_id)

    def wait_view(self, last: tuple | None, timeout: float) -> tuple[int, bool, bool, bool]:
        """What a worker's link is told, ``(generation, pending, stop requested, broken)``,
        once it differs from ``last`` or after ``timeout`` seconds. ``broken``: a member of
        this generation is lost, so its collectives can never complete."""
        deadline = time.monotonic() + timeout
        with self.cv:
            while True:
                broken = self._broken_locked()
                current = (self.generation, self._pending_locked(), self.stop_requested,
                           broken)
                left = deadline - time.monotonic()
                if current != last or left <= 0:
                    return current
                self.cv.wait(left)

    def broken_generation(self) -> int | None:
        """The current generation when it is broken (see ``_broken_locked``), else None."""
        with self.cv:
            return self.generation if self.members and self._broken_locked() else None

    def wait_change(self, timeout: float) -> None:
        with self.cv:
            self.cv.wait(timeout)

    def heartbeat(self, worker_id: str) -> None:
        with self.cv:
            self.last_seen[worker_id] = time.monotonic()

    def link_closed(self, worker_id: str) -> None:
        with self.cv:
            self.joiners.pop(worker_id, None)
            if self.awaiting_upload == worker_id:
                self.awaiting_upload = None
            if worker_id in self.members and worker_id not in self.finished:
                self.lost.add(worker_id)
                self._asked()
            self.cv.notify_all()

    def request_leave(self, worker_id: str) -> bool:
        with self.cv:
            if worker_id in self.joiners:
                self.joiners.pop(worker_id)
                self.assignments[worker_id] = {"action": "leave", "upload": False}
                self._mark_left(worker_id, "reclaimed")
                self.cv.notify_all()
                return True
            if worker_id not in self.members:
                return worker_id in self.left
            self.leaving.add(worker_id)
            self._asked()
            self.cv.notify_all()
            return True

    def wait_left(self, worker_id: str, timeout: float) -> str | None:
        deadline = time.monotonic() + timeout
        with self.cv:
            while worker_id not in self.left:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.cv.wait(min(left, 0.5))
            return self.left[worker_id]

    def request_stop(self, checkpoint: bool) -> None:
        with self.cv:
            self.stop_requested = True
            self.stop_checkpoint = self.stop_checkpoint or checkpoint
            for w in list(self.joiners):
                self.assignments[w] = {"action": "stop", "upload": False}
            self.joiners.clear()
            self.cv.notify_all()

    def mark_finished(self, worker_id: str) -> None:
        with self.cv:
            self.finished.add(worker_id)
            if worker_id not in self.left:
                self._mark_left(worker_id, "finished")
            self.cv.notify_all()

    def _asked(self) -> None:
        """A change was asked for now (the first ask since the last generation counts)."""
        if self._change_asked is None:
            self._change_asked = time.monotonic()

    def _mark_left(self, worker_id: str, reason: str) -> None:
        self.left[worker_id] = reason
        self._emit("worker.left", worker_id=worker_id, reason=reason, generation=self.generation)

    def live_members(self) -> list[str]:
        with self.cv:
            return [m for m in self.members if m not in self.lost and m not in self.finished]

    # -- the coordinator ---------------------------------------------------------------
    def tick(self) -> None:
        """Advance the state machine; the driver calls this on every change and at 20 Hz."""
        with self.cv:
            now = time.monotonic()
            self._mark_silent_lost(now)
            if not self.members:
                self._maybe_start(now)
                return
            if self._pending_locked() and self._all_arrived(now):
                self._form(now)

    def _mark_silent_lost(self, now: float) -> None:
        """Members not heard from for ``peer_timeout_s`` (and not waiting in a sync) are lost."""
        for m in self.members:
            stale = now - self.last_seen.get(m, now) > self.peer_timeout_s
            if m not in self.lost and m not in self.arrived and stale:
                self.lost.add(m)
                self._asked()
                self.cv.notify_all()

    def _all_arrived(self, now: float) -> bool:
        """Whether every live member has come to the sync. Those that have not are dropped as
        late ``peer_timeout_s`` after the first arrival when the generation is broken, else
        ``late_after_s`` after it; one whose link falls silent is lost before that."""
        missing = [m for m in self.members if m not in self.lost and m not in self.arrived]
        if not missing:
            return True
        first = min((a.at for a in self.arrived.values()), default=None)
        wait = self.peer_timeout_s if self._broken_locked() else self.late_after_s
        if first is None or now - first < wait:
            return False
        self.lost.update(missing)
        self.late.update(missing)
        return True

    def _maybe_start(self, now: float) -> None:
        if self.stop_requested or not self.joiners:
            return
        if len(self.joiners) < self.min_workers and not self.ever_formed:
            return
        if now - self._last_join < self.grace_s:
            return
        self._form(now)

    def _form(self, now: float) -> None:
        """Form the next generation from the members that arrived and the joiners."""
        old = list(self.members)
        arrived = self.arrived
        survivors = [m for m in old if m in arrived and m not in self.lost]
        self._report_dropped(old)
        if self.stop_requested:
            self._finish_stop(survivors, arrived)
            return
        staying, leavers = self._split(old, survivors, arrived)
        room = None if self.max_workers is None else max(0, self.max_workers - len(staying))
        joiners = list(self.joiners)[:room]
        has_state = any(arrived[m].global_step >= 0 for m in staying)
        upload_from = None if has_state else _furthest(leavers, arrived)
        self._send_away(leavers, upload_from)
        asked = self._change_asked
        self._advance(old, staying + joiners, joiners, upload_from)
        if self.members:
            self._assign(staying, joiners, has_state, arrived, now)
            self._announce(old, joiners, None if asked is None else now - asked)
        self.cv.notify_all()

    def _report_dropped(self, old: list[str]) -> None:
        for m in old:
            if m in self.lost and m not in self.left:
                self._mark_left(m, "late" if m in self.late else "lost")

    def _split(self, old: list[str], survivors: list[str],
               arrived: dict[str, Arrival]) -> tuple[list[str], list[str]]:
        """``(staying, leavers)``: the furthest of those staying is rank 0 (it broadcasts
        its state), then the old order."""
        rank_of = {m: i for i, m in enumerate(old)}
        staying = sorted((m for m in survivors if m not in self.leaving),
                         key=lambda m: (-arrived[m].global_step, rank_of[m]))
        return staying, [m for m in survivors if m in self.leaving]

    def _send_away(self, leavers: list[str], upload_from: str | None) -> None:
        for m in leavers:
            self.assignments[m] = {"action": "leave", "upload": m == upload_from}
            self._mark_left(m, "reclaimed")
            self.leaving.discard(m)

    def _advance(self, old: list[str], new: list[str], joiners: list[str],
                 upload_from: str | None) -> None:
        """Generation ``g+1`` is ``new``; what was pending about ``old`` is settled."""
        self.arrived = {}
        self.lost -= set(old)
        self.late -= set(old)
        for m in joiners:
            self.joiners.pop(m, None)
        self.members = new
        self.generation += 1
        self._change_asked = None
        if upload_from is not None:
            self.promised_version = self.state_version + 1

    def _assign(self, staying: list[str], joiners: list[str], has_state: bool,
                arrived: dict[str, Arrival], now: float) -> None:
        """Tell each member of the new generation its rank and where its state comes from:
        the driver (nobody staying has one), or rank 0 by broadcast (joiners, or survivors
        at different steps)."""
        self.ever_formed = True
        steps = {arrived[m].global_step for m in staying}
        version = max(self.state_version, self.promised_version)
        fetch = not has_state and (self.state_blob is not None or version > self.state_version)
        broadcast = bool(joiners) or len(steps) > 1 or not has_state
        new = self.members
        for rank, m in enumerate(new):
            self.assignments[m] = {
                "action": "train",
                "generation": self.generation,
                "rank": rank,
                "world_size": len(new),
                "members": new,
                "broadcast": broadcast,
                "fetch_state": fetch and rank == 0,
                "state_version": version,
            }
            self.last_seen[m] = now

    def _announce(self, old: list[str], joiners: list[str], took_s: float | None) -> None:
        new = self.members
        took = {} if took_s is None else {"duration_s": round(took_s, 3)}
        self._emit(
            "generation.changed",
            generation=self.generation,
            size=len(new),
            previous_size=len(old),
            members=new,
            joined=joiners,
            left=[m for m in old if m not in new],
            **took,
            **self.position,
        )
        for m in joiners:
            self._emit("worker.joined", worker_id=m, generation=self.generation,
                       rank=new.index(m))

    def _finish_stop(self, survivors: list[str], arrived: dict[str, Arrival]) -> None:
        upload_from = None
        if self.stop_checkpoint and survivors:
            upload_from = max(survivors, key=lambda m: arrived[m].global_step)
        self.awaiting_upload = upload_from
        for m in survivors:
            self.assignments[m] = {"action": "stop", "upload": m == upload_from}
            self._mark_left(m, "killed")
        self.arrived = {}
        self.members = []
        self.generation += 1
        self.cv.notify_all()

    def snapshot(self) -> dict[str, Any]:
        with self.cv:
            return {
                "generation": self.generation,
                "members": list(self.members),
                "size": len(self.members),
                "joining": list(self.joiners),
                "leaving": sorted(self.leaving),
                "left": dict(self.left),
                "state_version": self.state_version,
            }


def _furthest(leavers: list[str], arrived: dict[str, Arrival]) -> str | None:
    """The leaver with the most committed steps, to hand its state over; None when no
    leaver has any state."""
    if not leavers:
        return None
    best = max(leavers, key=lambda m: arrived[m].global_step)
    return best if arrived[best].global_step >= 0 else None
