"""A TensorFlow job opens nothing new to other jobs: its processes listen on what a PyTorch
job's do and no more.

TensorFlow starts a gRPC server only for ``tf.distribute`` cluster specs (``TF_CONFIG``, a
``tf.train.Server``), which the product's TensorFlow runtime never uses: it all-reduces through
the runtime's own gloo process group (runtime/keras_trainer.py). So a TF job, trained by a real
driver and two workers under the supervisor (as a host agent runs them, under the owner's own
account when the test runs as root), listens on the driver's control endpoint (on the host's
own address, behind the job's secret) and on gloo's data ports (one per worker, as for PyTorch:
docs/security.md), nothing else; another user's client sent every operation of the driver's
protocol at every one of the driver's ports is refused, and the job still ends FINISHED.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from agent.accounts import job_accounts
from agent.children import registry
from jobs import states
from jobs.models import TrainingJob
from tests.e2e.harness import wait_until
from tests.security.test_driver_link import (
    UID_BASE,
    Victim,
    _attack,
    _listening,
    _own_accounts,
)
from tests.support import enterable_roots, tar_gz

psutil = pytest.importorskip("psutil")

pytestmark = [pytest.mark.slow, pytest.mark.tensorflow]

# A tf.keras model as seed 004 writes one, slowed per sample until the test lets it hurry,
# with the knobs of the end-to-end tests' model (TEST_*).
TF_MODEL = '''
import os, time

import numpy as np
import tensorflow as tf

from fabric_model import FabricModel

DELAY = float(os.environ.get("TEST_DELAY_S", "0"))
FAST = os.environ.get("TEST_FAST_FILE", "")


class Points:
    def __init__(self, n, seed):
        rng = np.random.default_rng(seed)
        self.x = rng.standard_normal((n, 8)).astype("float32")
        self.y = np.eye(3, dtype="float32")[rng.integers(0, 3, n)]

    def __getitem__(self, i):
        if DELAY and not (FAST and os.path.exists(FAST)):
            time.sleep(DELAY)
        return self.x[i], self.y[i]

    def __len__(self):
        return len(self.x)


model = tf.keras.Sequential([tf.keras.Input((8,)), tf.keras.layers.Dense(3, activation="softmax")])
edt = FabricModel(model, lambda: (Points(int(os.environ["TEST_SAMPLES"]), 1), Points(16, 2)),
                  "categorical_crossentropy", tf.keras.optimizers.Adam(learning_rate=0.01))
edt.train(int(os.environ["TEST_EPOCHS"]), int(os.environ["TEST_BATCH"]),
          int(os.environ["TEST_ENGINES"]), num_dataloader_threads=0)
'''


@pytest.fixture
def tf_victim(owner, cluster, settings, own_events_stream):
    from django.db import connection

    if connection.vendor == "sqlite" and "memory" in str(connection.settings_dict["NAME"]):
        pytest.skip("threads cannot share an in-memory SQLite test database")
    from datasets.services import dataset_create_from_archive
    from jobs.services import job_submit
    from models.services import model_create_from_archive

    root = enterable_roots(settings, "edt-tf-ports-")
    settings.EDT_DRIVER_HOST = ""
    isolated = _own_accounts(settings)
    dataset = dataset_create_from_archive(owner=owner, name="tf-data", archive=tar_gz(
        {"tdata/train/x.txt": "x", "tdata/test/y.txt": "y"}))
    model = model_create_from_archive(owner=owner, name="tf-model", dataset=dataset,
                                      archive=tar_gz({"tmodel/main.py": TF_MODEL}),
                                      framework="TensorFlow")
    job = job_submit(user=owner, model=model, instance_group=cluster["instance_group"],
                     max_workers=2)
    result = Path(job.result_dir)
    TrainingJob.objects.filter(pk=job.pk).update(env_vars={
        "TEST_EPOCHS": "2", "TEST_SAMPLES": "128", "TEST_BATCH": "4", "TEST_ENGINES": "2",
        "EDT_MIN_WORKERS": "2", "TEST_DELAY_S": "0.05", "TEST_FAST_FILE": str(result / "fast"),
        "EDT_STEP_LOG": str(result / "steps.jsonl"), "EDT_PEER_TIMEOUT_S": "10",
    })
    job.refresh_from_db()
    v = Victim(job, cluster["hosts"])
    v.uid = UID_BASE + owner.pk if isolated else os.geteuid()
    try:
        yield v
    finally:
        v.end()
        job_accounts.refusal = None
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.django_db(transaction=True)
def test_a_tensorflow_job_listens_on_nothing_a_pytorch_job_does_not(tf_victim, other) -> None:
    victim = tf_victim
    victim.start()
    wait_until(lambda: len(victim.steps()) >= 3, "the TensorFlow job to train", 180,
               on_fail=victim.driver_log)
    driver = registry.get_child(f"driver:{victim.job.pk}:1")
    workers = [registry.get_child(f"slot:{alloc.pk}") for alloc in victim.allocs]
    assert all(workers), workers
    pids = [driver.proc.pid, *(w.proc.pid for w in workers)]
    # Each process really runs TensorFlow (its library is mapped), and none was told of a
    # tf.distribute cluster, the only case in which TensorFlow serves gRPC.
    for pid in pids:
        process = psutil.Process(pid)
        assert any("tensorflow" in m.path for m in process.memory_maps()), pid
        assert "TF_CONFIG" not in process.environ(), pid
    # The driver: its control endpoint only, on the host's own address (as for PyTorch).
    targets = _listening(driver.proc.pid)
    assert len(targets) == 1 and targets[0][0] == "127.0.0.1", targets
    # Each worker: gloo's one data port, on the address that reaches the driver, as a PyTorch
    # worker's; TensorFlow added none.
    for worker in workers:
        ports = _listening(worker.proc.pid)
        assert len(ports) == 1 and ports[0][0] == "127.0.0.1", (worker.key, ports)

    report = _attack(targets, victim.allocs[0].worker_id, UID_BASE + other.pk)
    assert len(report) == 12 * 3
    assert {k: v for k, v in report.items() if v != "refused"} == {}
    # It kept training through the attack and ends FINISHED with its model saved.
    after = victim.steps()[-1]["global_step"]
    wait_until(lambda: victim.steps()[-1]["global_step"] >= after + 2,
               "the TensorFlow job to keep training", 60, on_fail=victim.driver_log)
    victim.wait()
    assert victim.outcomes["driver"] == states.FINISHED, victim.driver_log()
    job = TrainingJob.objects.get(pk=victim.job.pk)
    assert job.state == states.FINISHED and job.error == "" and job.attempt == 1
    assert (victim.result / "model" / "train" / "model_epoch_final.keras").is_file()
