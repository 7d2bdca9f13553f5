"""A user's training script cannot read other users' folders.

With ``EDT_RUN_AS_UID_BASE`` a root host agent runs each user's jobs under that user's own
account (uid = gid = base + user id). Real processes, real uploads through the services, the
real supervisor: user A's script tries to read and list user B's results, uploaded dataset and
uploaded model, the list of jobs and uploads, and the server's secret files, and reports what
the kernel said. Needs root (CI runs as root): only root can switch accounts.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from django.conf import settings as django_settings
from django.utils import timezone

from agent import driver_supervisor
from jobs import states
from jobs.models import TrainingJob
from tests.support import enterable_roots, python_for, tar_gz, upload_and_submit

BASE = 200_000

ADDR = 'import os\nopen(os.environ["EDT_DRIVER_ADDR_FILE"], "w").write("127.0.0.1:1")\n'

B_SCRIPT = ADDR + """
open(os.path.join(os.environ["RESULT_DIR"], "b-results.txt"), "w").write("B-RESULTS")
"""

# A's script: every probe is an attempt to read a file or list a folder; it records what
# happened ("ok" or the exception's name), then proves it can use its own things.
PROBE = ADDR + """
import json
probes = json.loads(os.environ["PROBES"])
seen = {}
for label, (kind, path) in probes.items():
    try:
        if kind == "list":
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
        seen[label] = "ok"
    except Exception as exc:
        seen[label] = type(exc).__name__
own = open(os.path.join(os.environ["TRAIN_DATA_DIR"], "mine.txt")).read()
open(os.path.join(os.environ["RESULT_DIR"], "a-results.txt"), "w").write("A-RESULTS")
json.dump({"seen": seen, "own": own, "uid": os.getuid(), "gid": os.getgid(),
           "groups": os.getgroups()},
          open(os.path.join(os.environ["RESULT_DIR"], "probe.json"), "w"))
"""


@pytest.fixture
def shared(settings):
    """Data, model, upload and result roots in a folder every account can enter, and the
    agent configured for isolation."""
    if os.geteuid() != 0:
        pytest.skip("only a host agent running as root runs jobs as other accounts (CI is root)")
    python = python_for(BASE + 1)
    if python is None:
        pytest.skip("no Python interpreter here may be run by an unprivileged account")
    root = enterable_roots(settings, "edt-isolation-")
    settings.EDT_RUN_AS_UID_BASE = BASE
    settings.EDT_SERVICE_GID = ""
    settings.EDT_USER_PYTHON = python
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _run(job: TrainingJob, attempt: int = 1) -> str:
    TrainingJob.objects.filter(pk=job.pk).update(state=states.RUNNING, attempt=attempt,
                                                 heartbeat=timezone.now())
    return driver_supervisor.run_driver(job.pk, attempt, "host1")


@pytest.mark.django_db
def test_a_users_script_cannot_read_another_users_folders(shared, owner, other, cluster):
    b_data, b_model, b_job = upload_and_submit(
        other, "b", {"bdata/train/secret.txt": "B-DATA", "bdata/test/t.txt": "t"}, B_SCRIPT,
        cluster)
    assert _run(b_job) == states.FINISHED
    # An upload of B's that no job of B's has used yet.
    from datasets.services import dataset_create_from_archive

    b_unused = dataset_create_from_archive(
        owner=other, name="b-unused", archive=tar_gz({"u/train/x.txt": "X", "u/test/y": "Y"}))

    a_data, a_model, a_job = upload_and_submit(
        owner, "a", {"adata/train/mine.txt": "A-DATA", "adata/test/t.txt": "t"}, PROBE, cluster)
    b_results = Path(b_job.result_dir)
    probes = {
        "B's results folder": ("list", str(b_results)),
        "B's results file": ("read", str(b_results / "b-results.txt")),
        "B's log": ("read", str(b_results / "log" / "driver" / "stdout")),
        "B's submitted code": ("read", str(b_results / "_submitted_code" / "bmodel" / "main.py")),
        "B's dataset folder": ("list", b_data.train_path),
        "B's dataset file": ("read", str(Path(b_data.train_path) / "secret.txt")),
        "B's unused upload": ("read", str(Path(b_unused.train_path) / "x.txt")),
        "B's model folder": ("list", b_model.location),
        "B's model code": ("read", str(Path(b_model.location) / "main.py")),
        "the list of jobs": ("list", str(shared / "results")),
        "the list of dataset uploads": ("list", str(shared / "uploads" / "datasets")),
        "the list of model uploads": ("list", str(shared / "models" / "uploads")),
    }
    secret_key = Path(django_settings.VAR_DIR) / "secret_key"
    if secret_key.exists():
        probes["the server's SECRET_KEY file"] = ("read", str(secret_key))
    db = django_settings.DATABASES["default"]
    if db["ENGINE"].endswith("sqlite3") and Path(str(db["NAME"])).is_file():
        probes["the database file"] = ("read", str(db["NAME"]))
    TrainingJob.objects.filter(pk=a_job.pk).update(env_vars={"PROBES": json.dumps(probes)})

    assert _run(a_job) == states.FINISHED, Path(a_job.result_dir, "log/driver/stdout").read_text()
    report = json.loads(Path(a_job.result_dir, "probe.json").read_text())
    assert report["seen"] == {label: "PermissionError" for label in probes}
    # Its own things: its dataset read, its results written, under its own account only.
    assert report["own"] == "A-DATA"
    assert Path(a_job.result_dir, "a-results.txt").read_text() == "A-RESULTS"
    assert report["uid"] == report["gid"] == BASE + owner.pk
    assert set(report["groups"]) <= {BASE + owner.pk}
    # B's job ran as B's account; each result folder is its job's account's and the service
    # group's, with nothing for anyone else.
    for job, user in ((a_job, owner), (b_job, other)):
        st = Path(job.result_dir).stat()
        assert (st.st_uid, st.st_gid) == (BASE + user.pk, (shared / "results").stat().st_gid)
        assert st.st_mode & 0o7777 == 0o2770
    assert (shared / "results").stat().st_mode & 0o007 == 0o001


@pytest.mark.django_db
def test_the_agent_follows_no_link_a_job_left_in_its_folder(shared, owner, cluster):
    _, _, job = upload_and_submit(
        owner, "a", {"adata/train/mine.txt": "A", "adata/test/t.txt": "t"}, ADDR, cluster)
    assert _run(job) == states.FINISHED
    victim = shared / "victim"
    victim.write_text("ROOT ONLY")
    victim.chmod(0o600)
    elsewhere = shared / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    result = Path(job.result_dir)
    # What a malicious script could leave behind for the (root) agent's next launch.
    (result / "log" / "driver" / "stdout").unlink()
    (result / "log" / "driver" / "stdout").symlink_to(victim)
    (result / "evil").symlink_to(victim)
    shutil.rmtree(result / "_submitted_code")
    (result / "_submitted_code").symlink_to(elsewhere)

    assert _run(job, attempt=2) == states.FINISHED
    st = victim.stat()
    assert (victim.read_text(), st.st_uid, st.st_mode & 0o777) == ("ROOT ONLY", 0, 0o600)
    assert list(elsewhere.iterdir()) == [] and elsewhere.stat().st_uid == 0
    log = result / "log" / "driver" / "stdout"
    assert not log.is_symlink() and "driver starting" in log.read_text()
    assert log.stat().st_uid == BASE + owner.pk


@pytest.mark.django_db
def test_an_uploaded_model_folder_cannot_be_registered_again_by_path(roots, owner, other):
    """Agents grant an uploaded model folder to its model's owner, so nobody may point a model
    of theirs at someone's upload."""
    from django.core.exceptions import ValidationError

    from datasets.services import dataset_create
    from models.services import model_create, model_create_from_archive

    data = dataset_create(owner=other, name="d", train_path="cifar/train_db",
                          test_path="cifar/test_db")
    upload = model_create_from_archive(owner=other, name="m", dataset=data,
                                       archive=tar_gz({"m/main.py": "print(1)\n"}))
    mine = dataset_create(owner=owner, name="mine", train_path="cifar/train_db",
                          test_path="cifar/test_db")
    with pytest.raises(ValidationError) as err:
        model_create(owner=owner, name="stolen", location=upload.location, dataset=mine)
    assert "location" in err.value.message_dict
