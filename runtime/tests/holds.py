"""A test's training script held at a named point until the test lets it go: the script
writes ``at-<name>`` in the hold folder, then waits (bounded) for ``go-<name>``. No torch
and no side effects, so that any script of a job can import it."""

import os
import time


def hold_at(folder: str, name: str, timeout_s: float = 120.0) -> None:
    open(os.path.join(folder, f"at-{name}"), "w").close()
    go = os.path.join(folder, f"go-{name}")
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the test never released {go}")
        time.sleep(0.01)
