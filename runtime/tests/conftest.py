"""Fixtures the runtime's in-process tests share."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch.distributed as dist

from runtime import events
from runtime.config import JobEnv


@pytest.fixture
def one_process_group() -> Iterator[None]:
    """A real gloo group of one: the collectives run, and sum over one member."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture
def standalone_env(tmp_path: Path, monkeypatch) -> Iterator[JobEnv]:
    """This process as a standalone run (no driver), its results under ``tmp_path``."""
    for name in ("EDT_ROLE", "EDT_WORKER_ID", "LOG_DIR", "CHECKPOINT_DIR", "SAVED_MODEL_DIR",
                 "EDT_EVENTS_REDIS_URL", "EDT_EVENTS_FD", "EDT_ATTEMPT", "EDT_STEP_LOG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RESULT_DIR", str(tmp_path))
    events.configure(source="standalone", log_dir=str(tmp_path / "log"), echo=False)
    yield JobEnv.from_environ()
    events.configure(source="standalone")

