"""``python dlicmd.py`` against a live server, as a separate process (it must not need Django):
logon with only the host name and port (https is tried first, then http, as WMLA's dlicmd does),
frameworks, submit a model folder, get, list, priority, watch, logs, result, stop, delete,
logoff."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from jobs.models import TrainingJob


def test_the_cli_drives_an_exec_end_to_end(dlicmd, wmla_model_dir):
    logon = dlicmd("--logon", "--username", "alice", "--password", "alice-pass-1234")
    assert "Logged on" in logon.stdout
    assert oct(dlicmd.token_file.stat().st_mode & 0o777) == "0o600"

    frameworks = dlicmd("--dl-frameworks", "-o", "json")
    assert [f["name"] for f in json.loads(frameworks.stdout)] == ["edtPyTorch", "edtTensorflow"]

    started = dlicmd(
        "--exec-start", "edtPyTorch", "--ig", "sig-elastic", "--model-dir", str(wmla_model_dir),
        "--model-main", "main.py", "--cs-datastore-meta", "type=fs,data_path=cifar10EDTpytorch",
        "--numWorker", "2", "--msd-priority", "6000", "--msd-env", "EDT_PULL_FAILED_LIMITS=3",
        "--", "--epochs", "1",
    )
    ids = json.loads(started.stdout)
    assert set(ids) == {"execId", "appId"}
    exec_id = ids["execId"]
    job = TrainingJob.objects.get(pk=int(exec_id.rsplit("-", 1)[1]))
    assert (job.max_workers, job.priority, job.args) == (2, 6000, "--epochs 1")
    assert job.env_vars == {"EDT_PULL_FAILED_LIMITS": "3"}
    # The server got the args string WMLA's dlicmd would send: no connection options, the
    # model folder by name only.
    args = job.wmla_exec.args
    assert "--rest-host" not in args and "--model-dir edt-linear " in args

    got = json.loads(dlicmd("--exec-get", exec_id).stdout)
    assert got["state"] == "PENDING_CRD_SCHEDULER" and got["priority"] == 6000
    table = dlicmd("--exec-get-all").stdout
    assert exec_id in table and "ELASTIC" in table
    listed = json.loads(dlicmd("--exec-get-all", "-o", "json", "--query-args",
                               "state=PENDING_CRD_SCHEDULER&limit=5").stdout)
    assert [e["id"] for e in listed] == [exec_id]

    assert "is now 9000" in dlicmd("--exec-priority", exec_id, "9000").stdout
    job.refresh_from_db()
    assert job.priority == 9000

    watch = dlicmd("--exec-watch", exec_id, "--interval", "0.2", "--watch-timeout", "0.5",
                   check=False)
    assert watch.returncode == 2, watch.stderr
    assert "PENDING_CRD_SCHEDULER" in watch.stdout and "workers 0/2" in watch.stdout
    assert "priority 9000" in watch.stdout

    # As WMLA's dlicmd: each process's own output, read through the scheduler view; a job
    # still pending has a driver with nothing written yet, and no executor.
    assert dlicmd("--exec-outlogs", exec_id).stdout == "==== driver stdout ====\n"

    # What the runtime leaves in the result folder, so the download has something to carry.
    result_dir = Path(job.result_dir)
    (result_dir / "model").mkdir(parents=True)
    (result_dir / "model" / "model_epoch_final.pth").write_bytes(b"weights")
    saved = dlicmd("--exec-trainresult", exec_id).stdout
    assert saved.strip() == f"Train result is saved to {exec_id}-result.zip"
    with zipfile.ZipFile(dlicmd.cwd / f"{exec_id}-result.zip") as archive:
        assert archive.namelist() == ["model/model_epoch_final.pth"]

    # Once its processes have written output, each one's shows under its own heading.
    logs = Path(job.result_dir) / "log"
    for name, text in (("driver", "rendezvous open\n"), ("host1-slot0", "a print\n"),
                       ("host2-slot0", "another print\n")):
        (logs / name).mkdir(parents=True)
        (logs / name / "stdout").write_text(text)
    assert dlicmd("--exec-outlogs", exec_id).stdout == (
        "==== driver stdout ====\nrendezvous open\n"
        "==== executor 1 stdout ====\na print\n"
        "==== executor 2 stdout ====\nanother print\n"
    )

    launcher = dlicmd("--exec-launcherlogs", exec_id).stdout
    assert launcher.startswith("==== driver launcherlog ====\n") and "executor 2" in launcher

    assert "succeed" in dlicmd("--exec-stop", exec_id).stdout
    watch = dlicmd("--exec-watch", exec_id, "--interval", "0.2", check=False)
    assert watch.returncode == 1 and "ended: KILLED" in watch.stdout
    assert "succeed" in dlicmd("--exec-delete", exec_id).stdout
    assert not TrainingJob.objects.filter(pk=job.pk).exists()

    assert "Logged off" in dlicmd("--logoff").stdout
    assert not dlicmd.token_file.exists()
    after = dlicmd("--exec-get-all", check=False)
    assert after.returncode == 1 and "log on first" in after.stderr


def test_the_cli_reports_server_errors_clearly(dlicmd, wmla_model_dir):
    dlicmd("--logon", "--username", "alice", "--password", "alice-pass-1234")
    wrong = dlicmd("--exec-start", "tensorflow", "--ig", "sig-elastic", "--model-dir",
                   str(wmla_model_dir), "--model-main", "main.py", check=False)
    assert wrong.returncode == 1 and "supported: edtPyTorch" in wrong.stderr
    missing = dlicmd("--exec-start", "edtPyTorch", "--model-dir", str(wmla_model_dir / "nope"),
                     "--model-main", "main.py", check=False)
    assert missing.returncode == 1 and "is not a folder" in missing.stderr
    foreign = dlicmd("--exec-get", "mallory-999", check=False)
    assert foreign.returncode == 1 and "HTTP:404" in foreign.stderr


def test_a_wrong_password_is_refused_and_nothing_is_saved(dlicmd):
    refused = dlicmd("--logon", "--username", "alice", "--password", "wrong", check=False)
    assert refused.returncode == 1 and "Authentication error" in refused.stderr
    assert not dlicmd.token_file.exists()


def test_delete_all_removes_the_ended_execs_and_keeps_the_active(dlicmd, wmla_model_dir):
    dlicmd("--logon", "--username", "alice", "--password", "alice-pass-1234")
    submit = ("--exec-start", "edtPyTorch", "--model-dir", str(wmla_model_dir), "--model-main",
              "main.py", "--cs-datastore-meta", "type=fs,data_path=cifar10EDTpytorch")
    ended, active = (json.loads(dlicmd(*submit).stdout)["execId"] for _ in range(2))
    dlicmd("--exec-stop", ended)
    out = dlicmd("--exec-delete-all").stdout
    assert out.startswith("Deleted 1 execs; 1 still active were kept."), out
    remaining = [e["id"] for e in json.loads(dlicmd("--exec-get-all", "-o", "json").stdout)]
    assert remaining == [active]


def test_the_cli_starts_lists_gets_stops_and_deletes_a_search(dlicmd, wmla_model_dir):
    from hpo.models import HpoTask

    dlicmd("--logon", "--username", "alice", "--password", "alice-pass-1234")
    search = dlicmd.cwd / "search.json"
    search.write_text(json.dumps({
        "algoDef": {"algorithm": "Tpe", "maxJobNum": 4, "maxParalleJobNum": 2,
                    "objectiveMetric": "loss", "objective": "minimize"},
        "hyperParams": [{"name": "learning_rate", "type": "Range", "dataType": "DOUBLE",
                         "minDbVal": 0.001, "maxDbVal": 0.1}],
    }))
    started = dlicmd(
        "--exec-start", "edtPyTorch", "--hpo-start", str(search), "--ig", "sig-elastic",
        "--model-dir", str(wmla_model_dir), "--model-main", "main.py",
        "--cs-datastore-meta", "type=fs,data_path=cifar10EDTpytorch",
        "--edt-options", "maxWorkers=2", "--", "--epochs", "1",
    )
    name = json.loads(started.stdout)["hpoName"]
    task = HpoTask.objects.get(name=name)
    assert task.search["algorithm"] == "Tpe" and task.trial_job["max_workers"] == 2
    assert task.trial_job["args"] == "--epochs 1" and task.instance_group.name == "sig-elastic"
    assert task.model.main_file == "main.py"

    listed = dlicmd("--hpo-get-all")
    assert name in listed.stdout and "minimize loss" in listed.stdout
    assert json.loads(dlicmd("--hpo-get", name).stdout)["hpoName"] == name
    assert "state STOPPED" in dlicmd("--hpo-stop", name).stdout
    assert "succeed" in dlicmd("--hpo-delete", name).stdout
    assert not HpoTask.objects.exists()

    refused = dlicmd("--hpo-start", str(dlicmd.cwd / "missing.json"), "--exec-start",
                     "edtPyTorch", "--model-dir", str(wmla_model_dir), check=False)
    assert refused.returncode == 1 and "missing.json" in refused.stderr
    assert "not found" in dlicmd("--hpo-get", "nope", check=False).stderr
