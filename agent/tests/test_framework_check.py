"""A TensorFlow job on an interpreter without TensorFlow fails at launch, before any process
starts, saying what to install (``agent.processes._check_framework``); a PyTorch job is never
asked, and an interpreter that has TensorFlow launches."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.processes import LaunchError, launch_argv
from models.models import ModelDefinition

pytestmark = pytest.mark.django_db


def interpreter(tmp_path: Path, has_tensorflow: bool) -> str:
    """A stand-in for a job's Python: answers the find_spec question as told."""
    path = tmp_path / ("python-tf" if has_tensorflow else "python-no-tf")
    path.write_text(f"#!/bin/sh\nexit {0 if has_tensorflow else 1}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.slow  # asks a (stand-in) interpreter in a process of its own
def test_a_tensorflow_job_without_tensorflow_fails_at_launch_with_what_to_install(
        job, tmp_path):
    ModelDefinition.objects.filter(pk=job.model_id).update(framework="TensorFlow")
    job.refresh_from_db()
    with pytest.raises(LaunchError) as refused:
        launch_argv(job, interpreter(tmp_path, has_tensorflow=False))
    message = str(refused.value)
    assert "TensorFlow job (--exec-start edtTensorflow)" in message
    assert "pip install 'elastic-console[tensorflow]'" in message
    assert "the built-in 'tensorflow' one" in message


@pytest.mark.slow  # as above
def test_a_tensorflow_job_launches_where_tensorflow_is_installed(job, tmp_path):
    ModelDefinition.objects.filter(pk=job.model_id).update(framework="TensorFlow")
    job.refresh_from_db()
    python = interpreter(tmp_path, has_tensorflow=True)
    assert launch_argv(job, python)[0] == python


def test_a_pytorch_job_is_never_asked(job, tmp_path):
    python = interpreter(tmp_path, has_tensorflow=False)
    assert launch_argv(job, python)[0] == python
