"""What IBM's Cloud Pak for Data EDT notebook reads, read its way: it follows an
exec by building a one-row table from ``GET /execs/{id}`` (``pandas.DataFrame(exec,
index=[0])``), and reads an executor's log through the scheduler with ``?lastlines=1000``."""

from __future__ import annotations

from pathlib import Path

import pytest

from console.tests.test_wmla_api import DL, submit
from jobs.models import SlotAllocation, TrainingJob

pytestmark = pytest.mark.django_db


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture
def wmla_job(api, owner, cluster, dataset, roots):
    response = submit(api(owner))
    assert response.status_code == 200, response.json()
    return TrainingJob.objects.get(pk=response.json()["jobId"])


def one_row_table(body: dict) -> dict:
    """The rule pandas applies to ``DataFrame(body, index=[0])``: a scalar fills the row, a
    mapping is looked up by the row's label, a list must be exactly one item long."""
    row = {}
    for key, value in body.items():
        if isinstance(value, list | tuple):
            assert len(value) == 1, f"{key}: a list of {len(value)} cannot fill a one-row table"
            value = value[0]
        elif isinstance(value, dict):
            value = value.get(0)
        row[key] = value
    return row


def test_an_exec_holding_slots_fits_a_one_row_table(api, owner, wmla_job, cluster):
    for i, host in enumerate(cluster["hosts"][:2]):
        SlotAllocation.objects.create(job=wmla_job, host=host, slot=0, worker_id=f"w{i}")
    body = api(owner).get(f"{DL}/execs/{wmla_job.pk}", HTTP_ACCEPT="application/json").json()
    row = one_row_table(body)
    assert row["state"] == "PENDING_CRD_SCHEDULER" and row["id"] == body["id"]
    # Still there for our own dlicmd --exec-watch: one entry per slot, by "<host>:<slot>".
    assert body["slots"] == {"host1:0": {"host": "host1", "slot": 0, "worker": "w0"},
                             "host2:0": {"host": "host2", "slot": 0, "worker": "w1"}}


def test_an_exec_without_slots_fits_a_one_row_table_too(api, owner, wmla_job):
    body = api(owner).get(f"{DL}/execs/{wmla_job.pk}").json()
    assert one_row_table(body)["slots"] is None


def _executor_log(job: TrainingJob, lines: int) -> None:
    folder = Path(job.result_dir) / "log" / "host1-slot0"
    folder.mkdir(parents=True)
    (folder / "stdout").write_text("".join(f"line {i}\n" for i in range(lines)))
    SlotAllocation.objects.create(job=job, host_id=_host_pk("host1"), slot=0,
                                  worker_id="host1-slot0")


def _host_pk(name: str) -> int:
    from resources.models import Host

    return Host.objects.get(name=name).pk


def test_lastlines_keeps_the_end_of_an_executors_log(api, owner, wmla_job):
    _executor_log(wmla_job, 1500)
    url = f"{DL}/scheduler/applications/{wmla_job.pk}/executor/1/logs/stdout"
    client = api(owner)
    tail = client.get(url + "?lastlines=1000", HTTP_ACCEPT="text/plain").content.decode()
    assert tail.splitlines() == [f"line {i}" for i in range(500, 1500)]
    whole = client.get(url, HTTP_ACCEPT="text/plain").content.decode()
    assert len(whole.splitlines()) == 1500
    # The exec id the notebook has (``r.json()['id']``) names the application as well.
    exec_id = client.get(f"{DL}/execs/{wmla_job.pk}").json()["id"]
    by_exec = client.get(f"{DL}/scheduler/applications/{exec_id}/executor/1/logs/stdout"
                         "?lastlines=2", HTTP_ACCEPT="text/plain")
    assert by_exec.content.decode() == "line 1498\nline 1499\n"


@pytest.mark.parametrize("bad", ["0", "-3", "ten"])
def test_a_bad_lastlines_is_a_400_naming_it(api, owner, wmla_job, bad):
    url = f"{DL}/scheduler/applications/{wmla_job.pk}/driver/logs/stdout?lastlines={bad}"
    response = api(owner).get(url)
    assert response.status_code == 400 and "lastlines" in response.json()


def test_our_watch_line_reads_the_slots_mapping():
    from console.cli import dlicmd

    line = dlicmd.watch_line({"id": "alice-7", "state": "RUNNING", "slots": {
        "h1:0": {"host": "h1", "slot": 0}, "h2:1": {"host": "h2", "slot": 1}}})
    assert "slots h1:0,h2:1" in line
