"""The REST flow of WMLA's EDT notebook, with ``requests`` against a live server, written as
the notebook writes it: logon at Conductor's path, frameworks, tar the model folder, POST
``/execs?sigName=...&args=...`` with Basic credentials, poll the state, read the log, download
the result.

The part that needs the scheduler and host agents (the job running to FINISHED) is the last,
``slow`` test; it runs them as real processes and skips only when those commands are missing.
"""

from __future__ import annotations

import io
import os
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path

import pytest
import requests

from jobs.models import TrainingJob

ACTIVE = {"SUBMITTED", "PENDING_CRD_SCHEDULER", "LAUNCHING", "RUNNING", "RECOVERING"}
AUTH = ("alice", "alice-pass-1234")
HEADERS = {"Accept": "application/json"}


def make_tarfile(output_filename: str, source_dir: Path) -> None:
    # The notebook's own helper.
    with tarfile.open(output_filename, "w:gz") as tar:
        tar.add(str(source_dir), arcname=os.path.basename(source_dir))


def submit_like_the_notebook(dl_rest_url: str, model_dir: Path, args: str) -> requests.Response:
    temp = tempfile.mktemp(".modelDir.tar")  # noqa: S306 - the notebook's code, kept as is
    make_tarfile(temp, model_dir)
    try:
        with open(temp, "rb") as handle:
            files = {"file": handle}
            return requests.post(
                dl_rest_url + "/execs?sigName=" + "sig-elastic" + "&args=" + args,
                files=files, auth=AUTH, headers=HEADERS, timeout=30,
            )
    finally:
        os.remove(temp)


def poll_state(url: str, until: set[str], timeout: float, **auth) -> dict:
    deadline = time.monotonic() + timeout
    body: dict = {}
    while time.monotonic() < deadline:
        body = requests.get(url, headers=HEADERS, timeout=10, **auth).json()
        if body.get("state") in until:
            return body
        time.sleep(0.5)
    raise AssertionError(f"exec never reached {sorted(until)} in {timeout:g} s; last: {body}")


NOTEBOOK_ARGS = (
    "--exec-start edtPyTorch         --cs-datastore-meta type=fs,data_path=cifar10EDTpytorch"
    "         --model-dir edt-linear         --edt-options maxWorkers=2"
    "         --model-main main.py         "
)


def test_the_notebook_flow_submits_and_follows_an_exec(live_server, dl_rest_url, wmla_model_dir):
    sc_rest_url = live_server.url + "/platform/rest/conductor/v1"
    r = requests.get(sc_rest_url + "/auth/logon", auth=AUTH, headers=HEADERS, timeout=10)
    assert r.ok, r.content

    frameworks = requests.get(dl_rest_url + "/execs/frameworks", auth=AUTH, headers=HEADERS,
                              timeout=10).json()
    assert "edtPyTorch" in [f["name"] for f in frameworks]

    r = submit_like_the_notebook(dl_rest_url, wmla_model_dir, NOTEBOOK_ARGS)
    assert r.ok, r.content
    exec_id, sig_id, driver_id = r.json()["id"], r.json()["sigId"], r.json()["submissionId"]
    assert exec_id.startswith("alice-") and sig_id and driver_id.startswith("driver-")

    body = poll_state(dl_rest_url + "/execs/" + exec_id, ACTIVE, 10, auth=AUTH)
    assert body["numWorker"] == 2 and body["framework"] == "edtPyTorch"
    job = TrainingJob.objects.get(pk=body["jobId"])
    assert (Path(job.model.location) / "main.py").read_text().startswith("import os")

    # Before the job has run, its log is an empty JSON string and its result a clear 404.
    log = requests.get(dl_rest_url + "/execs/" + exec_id + "/log", auth=AUTH, headers=HEADERS,
                       timeout=10)
    assert log.ok and log.json() == ""
    result = requests.get(dl_rest_url + "/execs/" + exec_id + "/result", auth=AUTH, timeout=10)
    assert result.status_code == 404 and "no results yet" in result.json()["detail"]

    listed = requests.get(dl_rest_url + "/execs?sort_by=id:desc&limit=10", auth=AUTH,
                          headers=HEADERS, timeout=10).json()
    assert [e["id"] for e in listed] == [exec_id]


def test_the_token_flow_stops_and_deletes_an_exec(live_server, dl_rest_url, wmla_model_dir):
    token = requests.get(live_server.url + "/auth/v1/logon", auth=AUTH, timeout=10).json()[
        "accessToken"
    ]
    bearer = {"Authorization": f"Bearer {token}", "Accept": "application/json"}
    r = submit_like_the_notebook(dl_rest_url, wmla_model_dir, NOTEBOOK_ARGS)
    exec_id = r.json()["id"]
    stopped = requests.post(f"{dl_rest_url}/execs/{exec_id}/stop", headers=bearer, timeout=10)
    assert stopped.ok and stopped.json()["state"] == "KILLED"
    deleted = requests.delete(f"{dl_rest_url}/execs/{exec_id}", headers={"X-Auth-Token": token},
                              timeout=10)
    assert deleted.ok
    gone = requests.get(f"{dl_rest_url}/execs/{exec_id}", headers=bearer, timeout=10)
    assert gone.status_code == 404
    assert requests.post(live_server.url + "/auth/v1/logoff", headers=bearer, timeout=10).ok
    assert requests.get(f"{dl_rest_url}/execs", headers=bearer, timeout=10).status_code == 401


def test_a_foreign_exec_is_a_404_over_http(live_server, dl_rest_url, wmla_model_dir, other):
    exec_id = submit_like_the_notebook(dl_rest_url, wmla_model_dir, NOTEBOOK_ARGS).json()["id"]
    r = requests.get(f"{dl_rest_url}/execs/{exec_id}", auth=("mallory", "mallory-pass-1234"),
                     timeout=10)
    assert r.status_code == 404


# --- the whole run: needs the scheduler and a host agent (tests/wmla/conftest.py) -------

# IBM's CPD notebook names no data path: its model makes or fetches its own data.
CPD_NOTEBOOK_ARGS = (
    "--exec-start edtPyTorch --cs-datastore-meta type=fs --model-dir edt-linear "
    "--edt-options maxWorkers=2 --model-main main.py"
)


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("args", [NOTEBOOK_ARGS, CPD_NOTEBOOK_ARGS], ids=["edt", "cpd"])
def test_the_notebook_flow_runs_to_finished(
    live_server, dl_rest_url, wmla_model_dir, cluster_processes, tmp_path, args
):
    r = submit_like_the_notebook(dl_rest_url, wmla_model_dir, args)
    assert r.ok, r.content
    exec_id, sig_id, driver_id = r.json()["id"], r.json()["sigId"], r.json()["submissionId"]
    try:
        body = poll_state(dl_rest_url + "/execs/" + exec_id, {"FINISHED", "ERROR", "KILLED"},
                          300, auth=AUTH)
    except AssertionError:
        tails = {p.name: p.read_text(errors="replace")[-3000:]
                 for p in cluster_processes.iterdir()}
        raise AssertionError(f"the exec did not end; process logs: {tails}") from None
    assert body["state"] == "FINISHED", body
    assert body["progress"]["epochs"] == body["progress"]["epoch"] == 2, body
    # The training log holds only ELog lines; this model prints its own, which stay in the
    # driver's whole output, downloaded as the notebook downloads it from Conductor.
    log = requests.get(f"{dl_rest_url}/execs/{exec_id}/log?logType=outerrlog", auth=AUTH,
                       headers=HEADERS, timeout=10).json()
    assert "begin" not in log
    sc_rest_url = live_server.url + "/platform/rest/conductor/v1"
    apps = requests.get(sc_rest_url + "/instances/" + sig_id + "/applications?state=FINISHED",
                        auth=AUTH, headers=HEADERS, timeout=10).json()
    assert [job["driver"]["id"] for job in apps] == [driver_id]
    app_url = sc_rest_url + "/instances/" + sig_id + "/applications/" + driver_id
    output = [requests.get(app_url + "/logs/stdout/download", auth=AUTH, timeout=10,
                           headers={"Accept": "application/octet-stream"}).text]
    for executor in apps[0]["executors"]:
        output.append(requests.get(app_url + "/" + executor["id"] + "/logs/stdout/download",
                                   auth=AUTH, headers={"Accept": "application/octet-stream"},
                                   timeout=10).text)
    assert apps[0]["executors"] and "end" in "".join(output), output
    result = requests.get(f"{dl_rest_url}/execs/{exec_id}/result", auth=AUTH, timeout=60)
    assert result.ok and "filename=" in result.headers["Content-Disposition"]
    assert int(result.headers["Content-Disposition"].split("size=")[1]) == len(result.content)
    names = zipfile.ZipFile(io.BytesIO(result.content)).namelist()
    assert any(n.startswith("model/") for n in names), names
