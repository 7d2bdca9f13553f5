"""bench/threads.py: each thread's CPU time a step, read from /proc, under the name that
says what it does (the training thread, torch's autograd thread, the others, the driver)."""

from __future__ import annotations

import os
import queue
import threading
import time

from bench.threads import ThreadTimes, read


def _burn(cpu_s: float) -> None:
    """Use ``cpu_s`` seconds of this thread's CPU time, however busy the machine is."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def test_each_thread_is_counted_under_its_role_per_step():
    times = ThreadTimes({"worker": os.getpid()})
    go, done, end = threading.Event(), threading.Event(), threading.Event()

    def helper() -> None:
        go.wait()
        _burn(0.1)
        done.set()
        end.wait()  # alive and idle until the test has read it

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    try:
        for _ in range(2):  # two windows of 5 steps, 0.15 s of the main thread's each
            times.start()
            _burn(0.15)
            times.stop(5)
        times.start()  # a third window of 10 steps, in which only the helper works
        go.set()
        assert done.wait(10), "the helper thread did not burn its CPU in 10 s"
        times.stop(10)
    finally:
        end.set()
        thread.join(10)

    figures = times.per_step()  # over 20 steps
    # Main: 0.3 s over 20 steps, 15 ms a step (clock ticks are 10 ms: a tick per window off).
    assert 13_000 <= figures["main"]["cpu_us"] <= 17_000, figures
    # The helper's 0.1 s fell in the third window only: 5 ms a step over the 20.
    assert 4_000 <= figures["other"]["cpu_us"] <= 7_000, figures
    assert set(figures["main"]) == {"cpu_us", "preempted", "sleeps", "waited_us"}
    assert figures["main"]["preempted"] >= 0 and figures["main"]["waited_us"] >= 0


def test_a_driver_counts_whole_and_an_ended_process_is_left_out():
    me = os.getpid()
    now = read({"driver": me, "gone": 2**22 + 7})  # above any pid Linux hands out by default
    assert {key for key, _ in now} == {"driver"}  # every thread of it, as the driver
    assert all(tid > 0 for _, tid in now)


def _until_asleep(tid: int, who: str) -> None:
    """Spin (no sleep of this thread's own) until thread ``tid`` of this process is blocked."""
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/self/task/{tid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "S":
                return
        assert time.monotonic() < deadline, f"the {who} did not wait within 10 s"


def test_a_thread_that_waits_for_another_is_counted_asleep_each_time():
    # A helper and the main thread hand 200 items to each other, each waiting for the other:
    # each gives its core up every time it waits (a voluntary switch), which is how a thread
    # that waits for a lock or for work mid-step shows, beside its CPU time. Each hands over
    # only once the other is blocked, so every hand-over is a wait, however loaded the machine
    # is (otherwise a thread preempted before it waits finds its item already there).
    work, acks = queue.Queue(), queue.Queue()
    main_tid = threading.get_native_id()
    helper_tid: list[int] = []

    def helper() -> None:
        helper_tid.append(threading.get_native_id())
        while (item := work.get()) is not None:
            _until_asleep(main_tid, "main thread")
            acks.put(item)

    thread = threading.Thread(target=helper, daemon=True)
    thread.start()
    times = ThreadTimes({"worker": os.getpid()})
    try:
        times.start()
        for i in range(200):
            while not helper_tid:
                pass
            _until_asleep(helper_tid[0], "helper")
            work.put(i)
            assert acks.get(timeout=10) == i, "the helper did not hand item back in 10 s"
        times.stop(10)
    finally:
        work.put(None)
        thread.join(10)

    figures = times.per_step()  # 20 hand-overs a step
    assert figures["other"]["sleeps"] >= 10, figures
    assert figures["main"]["sleeps"] >= 10, figures
