"""The Train form's hyper-parameters, name limits, roots in the forms' help, the hosts page,
the pending queue and the Compare page, through Django's test client (no JavaScript)."""

from __future__ import annotations

import pytest
from django.urls import reverse

from jobs.models import TrainingJob
from resources.names import NAME_MAX_LENGTH

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]


@pytest.fixture
def signed_in(client, owner):
    client.force_login(owner)
    return client


def _train_post(model_def, cluster, **extra) -> dict:
    return {"model": model_def.pk, "instance_group": cluster["instance_group"].pk,
            "max_workers": 2, "devices_per_worker": 1, "priority": 5000, **extra}


# --- the Train form's hyper-parameters ---------------------------------------------------------


def test_the_train_form_is_prefilled_with_the_models_hyper_parameters(signed_in, model_def,
                                                                     cluster):
    model_def.hyper_parameters = {"epochs": 300, "batch_size": 16, "dropout": 0.2}
    model_def.save()
    form = signed_in.get(reverse("model-train", args=[model_def.pk])).context["form"]
    assert form["epochs"].value() == 300
    assert form["batch_size"].value() == 16
    assert form["other_hyper_parameters"].value() == "dropout=0.2"
    assert form["hyper_parameters_of"].value() == model_def.pk


def test_a_run_overrides_the_models_hyper_parameters_and_keeps_the_rest(signed_in, model_def,
                                                                      cluster):
    model_def.hyper_parameters = {"epochs": 300, "batch_size": 16, "dropout": 0.2}
    model_def.save()
    response = signed_in.post(reverse("train"), _train_post(
        model_def, cluster, epochs=3, batch_size=64, learning_rate=0.5, optimizer="Adam",
        other_hyper_parameters="dropout=0.5\nlayers=[64, 32]\nact=relu",
        hyper_parameters_of=model_def.pk,
    ))
    job = TrainingJob.objects.get()
    assert response.url == reverse("job", args=[job.pk])
    assert job.hyper_parameters == {"epochs": 3, "batch_size": 64, "learning_rate": 0.5,
                                    "optimizer": "Adam", "dropout": 0.5, "layers": [64, 32],
                                    "act": "relu"}
    assert job.epochs == 3
    model_def.refresh_from_db()
    assert model_def.hyper_parameters["epochs"] == 300  # the model keeps its own


def test_blank_hyper_parameter_fields_keep_the_models_values(signed_in, model_def, cluster):
    signed_in.post(reverse("train"), _train_post(model_def, cluster, epochs=""))
    assert TrainingJob.objects.get().hyper_parameters == {"epochs": 2, "batch_size": 16}


def test_a_bad_other_hyper_parameter_line_is_refused_on_its_field(signed_in, model_def, cluster):
    response = signed_in.post(reverse("train"), _train_post(
        model_def, cluster, other_hyper_parameters="no equals sign"))
    assert response.status_code == 400
    assert response.context["form"].errors["other_hyper_parameters"] == [
        "Line 1 is not name=value."]
    assert not TrainingJob.objects.exists()


def test_a_form_posted_for_another_model_shows_that_models_values(signed_in, owner, model_def,
                                                                 cluster, roots):
    from models.services import model_create

    other_model = model_create(owner=owner, name="other", location=str(roots["models"] / "resnet"),
                               dataset=model_def.dataset, hyper_parameters={"epochs": 7})
    response = signed_in.post(reverse("train"), _train_post(
        other_model, cluster, epochs=2, hyper_parameters_of=model_def.pk))
    assert response.status_code == 400
    form = response.context["form"]
    assert "they are now other's" in " ".join(form.non_field_errors())
    assert (form["epochs"].value(), form["hyper_parameters_of"].value()) == (7, other_model.pk)
    assert not TrainingJob.objects.exists()


def test_the_page_carries_every_models_values_for_the_model_picker(signed_in, model_def,
                                                                  cluster):
    page = signed_in.get(reverse("train")).content.decode()
    assert 'id="model-hyper-parameters"' in page and "console/train.js" in page


# --- names --------------------------------------------------------------------------------------


def test_a_400_character_job_name_is_refused_naming_the_limit(signed_in, model_def, cluster):
    response = signed_in.post(reverse("train"), _train_post(model_def, cluster, name="x" * 400))
    assert response.status_code == 400
    assert response.context["form"].errors["name"] == [
        f"A job's name may be at most {NAME_MAX_LENGTH} characters long."]
    assert 'maxlength' not in str(response.context["form"]["name"])  # no silent cut
    assert not TrainingJob.objects.exists()


def test_the_api_refuses_a_long_job_name_too(api, owner, model_def, cluster):
    response = api(owner).post("/api/v1/jobs/", {
        "model": model_def.pk, "instance_group": cluster["instance_group"].pk,
        "max_workers": 1, "name": "x" * 400}, format="json")
    assert response.status_code == 400
    assert response.json()["name"] == [
        f"A job's name may be at most {NAME_MAX_LENGTH} characters long."]


def test_long_names_are_clipped_with_the_whole_name_as_title(signed_in, owner, model_def,
                                                            cluster):
    from jobs.services import job_submit

    long_name = "n" * NAME_MAX_LENGTH
    job_submit(user=owner, model=model_def, instance_group=cluster["instance_group"],
               name=long_name)
    page = signed_in.get(reverse("jobs")).content.decode()
    assert f'<span class="clip" title="{long_name}">{long_name}</span>' in page


# --- roots named in the forms -----------------------------------------------------------------


def test_the_forms_name_the_roots_they_accept(signed_in, roots):
    dataset_page = signed_in.get(reverse("dataset-new-any")).content.decode()
    assert f"under the data roots ({roots['data']})" in dataset_page
    model_page = signed_in.get(reverse("model-new")).content.decode()
    assert f"under the model roots ({roots['models']})" in model_page


def test_a_model_folder_outside_is_said_to_be_outside_the_model_roots(signed_in, dataset, roots):
    response = signed_in.post(reverse("model-new"), {
        "framework": "PyTorch", "name": "m", "location": str(roots["data"]),
        "main_file": "main.py", "engine": "edt", "dataset": dataset.pk, "epochs": 1,
        "batch_size": 1, "learning_rate": 0.1, "optimizer": "SGD"})
    assert response.status_code == 400
    errors = response.context["form"].errors["location"]
    assert any("outside the allowed model roots" in e for e in errors), errors


# --- the pending queue and "just now" -----------------------------------------------------------


def test_an_empty_queue_is_a_sentence_not_item_one(signed_in, cluster):
    page = signed_in.get(reverse("instance-group", args=[cluster["instance_group"].pk]))
    html = page.content.decode()
    assert '<p id="pending-queue" class="hint">No job is waiting.</p>' in html
    assert "<ol" not in html.split('id="pending-queue"')[0].rsplit("<h2>Pending queue</h2>")[-1]


def test_times_under_a_minute_read_just_now():
    from datetime import timedelta

    from django.utils import timezone

    from console.templatetags.console_tags import ago

    now = timezone.now()
    assert ago(now - timedelta(seconds=59), now) == "just now"
    assert ago(now - timedelta(minutes=5), now) == "5\xa0minutes ago"
    assert ago(None) == "never"


# --- the hosts page -----------------------------------------------------------------------------


def test_the_hosts_page_shows_each_slots_holder_and_the_hosts_usage(signed_in, job, cluster):
    from jobs.models import SlotAllocation
    from resources.models import Host

    host = cluster["hosts"][0]
    Host.objects.filter(pk=host.pk).update(cpu_utilization=37, memory_mb=8000,
                                           memory_used_mb=2000, last_heartbeat=job.created)
    SlotAllocation.objects.create(job=job, host=host, slot=1, worker_id="w-7")
    page = signed_in.get(reverse("hosts")).content.decode()
    row = page.split(f'data-host="{host.name}"')[1].split("</tr>")[0]
    assert "CPU 37%" in row and "Memory 2000/8000 MB" in row
    assert "1 of 4 held" in row
    slot = row.split('data-slot="1"')[1].split("</li>")[0]
    assert f"#{job.pk}" in slot and "worker" in slot and "w-7" in slot
    assert "free" in row.split('data-slot="0"')[1].split("</li>")[0]


def test_the_hosts_page_shows_each_gpus_utilisation_memory_and_holder(signed_in, job):
    """A GPU host as its agent reports it: registered with what NVML found, then a heartbeat
    with each device's utilisation and memory in use. Each GPU is a slot: the page shows its
    figures and the job and worker holding it."""
    from django.utils.html import strip_tags

    from jobs.models import SlotAllocation
    from resources.discovery import GpuInfo
    from resources.services import host_heartbeat, host_register

    def gpus(used: tuple[int, int], busy: tuple[int, int]) -> list[GpuInfo]:
        return [GpuInfo(index=i, uuid=f"GPU-{i}-uuid", model="NVIDIA H100 80GB HBM3",
                        memory_mb=81559, memory_used_mb=used[i], utilization=busy[i])
                for i in (0, 1)]

    host = host_register(name="gpu-host", address="10.0.0.9", gpus=gpus((0, 0), (0, 0)))
    assert host_heartbeat(name="gpu-host", gpus=gpus((40960, 512), (87, 3)))
    SlotAllocation.objects.create(job=job, host=host, gpu=host.gpus.get(index=0), slot=0,
                                  worker_id="gpu-host-w0")
    page = signed_in.get(reverse("hosts")).content.decode()
    row = page.split('data-host="gpu-host"')[1].split("</tr>")[0]
    assert "1 of 2 held" in row
    first, second = (row.split(f'data-slot="{i}"')[1].split("</li>")[0] for i in (0, 1))
    first_text, second_text = (" ".join(strip_tags(li).split()) for li in (first, second))
    assert "gpu0 NVIDIA H100 80GB HBM3 · 87%" in first_text and "40960/81559 MB" in first_text
    # The UUID names the device on every host (an index is only meaningful on its own host).
    assert "GPU-0-uuid" in first_text and "GPU-1-uuid" in second_text
    assert 'value="87" aria-label="Utilisation of gpu0"' in first
    assert f"#{job.pk} resnet-edt, worker gpu-host-w0" in first_text
    assert "gpu1 NVIDIA H100 80GB HBM3 · 3%" in second_text and "512/81559 MB" in second_text
    assert 'value="3" aria-label="Utilisation of gpu1"' in second
    assert second_text.endswith("— free")


def test_the_hosts_page_does_not_name_another_users_job(client, other, job, cluster):
    from jobs.models import SlotAllocation

    SlotAllocation.objects.create(job=job, host=cluster["hosts"][0], slot=0, worker_id="w-1")
    client.force_login(other)
    page = client.get(reverse("hosts")).content.decode()
    assert "another user&#x27;s job" in page or "another user's job" in page
    assert job.name not in page


# --- the Compare page ---------------------------------------------------------------------------


def _metrics(job, losses: list[float], accuracy: float) -> None:
    from jobs.models import JobMetric

    for step, loss in enumerate(losses, 1):
        JobMetric.objects.create(job=job, kind="train", epoch=0, iteration=step,
                                 values={"loss": loss})
    JobMetric.objects.create(job=job, kind="test", epoch=0, values={"accuracy": accuracy})


def test_compare_draws_one_chart_per_metric_and_one_line_per_job(signed_in, owner, model_def,
                                                                  cluster, job):
    from console.compare import comparison
    from jobs.services import job_submit

    second = job_submit(user=owner, model=model_def, instance_group=cluster["instance_group"])
    _metrics(job, [2.0, 1.0], 0.5)
    _metrics(second, [3.0, 1.5, 0.5, 0.25], 0.75)
    response = signed_in.get(reverse("jobs-compare"), {"job": [job.pk, second.pk]})
    assert response.status_code == 200
    data = comparison([job, second])
    assert [c["metric"] for c in data["charts"]] == ["test accuracy", "train loss"]
    loss = data["charts"][1]["lines"]
    assert [line["job"] for line in loss] == [job.pk, second.pk]
    # Steps at their fraction of the epoch: runs of other lengths share one axis.
    assert [p["x"] for p in loss[0]["points"]] == [0.5, 1.0]
    assert [p["x"] for p in loss[1]["points"]] == [0.25, 0.5, 0.75, 1.0]
    assert data["charts"][0]["lines"][1]["points"] == [{"x": 1, "y": 0.75}]
    assert 'id="comparison"' in response.content.decode()


def test_compare_needs_two_jobs_and_whole_numbers(signed_in, job):
    one = signed_in.get(reverse("jobs-compare"), {"job": [job.pk]})
    assert one.status_code == 400 and b"at least two jobs" in one.content
    bad = signed_in.get(reverse("jobs-compare"), {"job": ["1", "x"]})
    assert bad.status_code == 400 and b"whole numbers" in bad.content


def test_compare_does_not_show_another_users_job(client, other, owner, model_def, cluster, job):
    from jobs.services import job_submit

    second = job_submit(user=owner, model=model_def, instance_group=cluster["instance_group"])
    client.force_login(other)
    response = client.get(reverse("jobs-compare"), {"job": [job.pk, second.pk]})
    assert response.status_code == 404


def test_the_jobs_list_offers_compare_checkboxes(signed_in, job):
    page = signed_in.get(reverse("jobs")).content.decode()
    assert 'id="compare-form"' in page
    assert f'name="job" value="{job.pk}" form="compare-form"' in page
    assert "{#" not in page and "comment" not in page  # template comments stay out of the page


def test_chart_legends_cut_long_names(owner, model_def, cluster):
    from console.selectors import LEGEND_CHARS, chart_label
    from jobs.services import job_submit

    job = job_submit(user=owner, model=model_def, instance_group=cluster["instance_group"],
                     name="z" * NAME_MAX_LENGTH)
    label = chart_label(job)
    assert len(label) == LEGEND_CHARS and label.endswith("…")
    assert label.startswith(f"#{job.pk} zzz")


def test_a_runs_override_reaches_the_training_process(signed_in, model_def, cluster,
                                                     monkeypatch):
    """Form -> job -> the environment the agent gives the job's processes -> what the model's
    ``pth_parameter_mgr`` calls answer."""
    import torch

    from agent.environment import build_env
    from runtime import wmla

    signed_in.post(reverse("train"), _train_post(
        model_def, cluster, epochs=9, batch_size=8, learning_rate=0.3, optimizer="SGD",
        momentum=0.5))
    env = build_env(TrainingJob.objects.get(), "worker")
    monkeypatch.setenv("EDT_HPARAMS", env["EDT_HPARAMS"])
    assert (wmla.getEpoch(), wmla.getTrainBatchSize(), wmla.getLearningRate()) == (9, 8, 0.3)
    optimizer = wmla.getOptimizer(torch.nn.Linear(2, 1))
    assert optimizer.param_groups[0]["momentum"] == 0.5


def test_other_hyper_parameters_read_back_as_they_were_written():
    from console.forms import other_hp_text, parse_other_hp

    hp = {"epochs": 3, "act": "relu", "digits": "12", "layers": [64, 32], "dropout": 0.1,
          "bn": True}
    text = other_hp_text(hp)
    assert "epochs" not in text  # it has its own field
    assert parse_other_hp(text) == {k: v for k, v in hp.items() if k != "epochs"}


@pytest.mark.parametrize("what", ["dataset", "model"])
def test_services_refuse_a_long_model_or_dataset_name_naming_the_limit(roots, owner, dataset,
                                                                       what):
    from django.core.exceptions import ValidationError

    from datasets.services import dataset_create
    from models.services import model_create

    long_name = "d" * (NAME_MAX_LENGTH + 1)
    with pytest.raises(ValidationError) as refused:
        if what == "dataset":
            dataset_create(owner=owner, name=long_name, train_path="cifar/train_db",
                           test_path="cifar/test_db")
        else:
            model_create(owner=owner, name=long_name, location=str(roots["models"] / "resnet"),
                         dataset=dataset)
    assert refused.value.message_dict == {
        "name": [f"A {what}'s name may be at most {NAME_MAX_LENGTH} characters long."]}


def test_a_gpu_hosts_slots_are_its_gpus_and_any_static_slot_held_past_them(owner, job, cluster):
    from console.selectors import hosts_overview
    from jobs.models import SlotAllocation
    from resources.models import GPU, Host

    host = Host.objects.create(name="gpu-host", cpu_slots=0)
    for index in (0, 1):
        GPU.objects.create(host=host, index=index, uuid=f"GPU-{index}", model="H100",
                           memory_mb=80_000, memory_used_mb=1_000 * index, utilization=50)
    # A static resource group of 3 slots a host: the third has no GPU of its own.
    SlotAllocation.objects.create(job=job, host=host, slot=2, worker_id="w-2")
    row = next(r for r in hosts_overview(user=owner) if r["host"] == host)
    assert [(s.index, s.gpu.uuid if s.gpu else None) for s in row["slots"]] == [
        (0, "GPU-0"), (1, "GPU-1"), (2, None)]
    assert row["slots"][2].job == job and row["held"] == 1


def test_favicon_ico_answers_for_browsers_and_tools_that_ask_for_it(client):
    response = client.get("/favicon.ico")
    assert response.status_code == 301
    assert response["Location"].endswith("/static/console/favicon.svg")


def test_a_refused_request_is_one_line_in_the_log_without_a_traceback(signed_in, caplog):
    with caplog.at_level("WARNING", logger="django.request"):
        response = signed_in.get(reverse("resource-group-new"))  # admins only
    assert response.status_code == 403
    refused = [r for r in caplog.records if r.name == "django.request"]
    assert refused and all(r.exc_info is None for r in refused), refused
    assert "Forbidden" in refused[0].getMessage()


def test_the_models_list_names_each_models_owner_for_an_admin_only(client, admin,
                                                                     owner, model_def):
    client.force_login(admin)
    page = client.get(reverse("models")).content.decode()
    assert "<th>Owner</th>" in page and f"<td>{owner.username}</td>" in page
    client.force_login(owner)
    assert "<th>Owner</th>" not in client.get(reverse("models")).content.decode()


def test_the_models_list_puts_folders_submitted_with_dlicmd_apart(signed_in, owner, model_def,
                                                                  cluster):
    from console.wmla.models import WmlaExec
    from jobs.services import job_submit
    from models.models import ModelDefinition

    # As POST /execs names the folder it unpacks (console.wmla.submit._model_name).
    submitted = ModelDefinition.objects.create(owner=owner, name="main-20261129-abc123",
                                               location=model_def.location,
                                               main_file=model_def.main_file)
    job = job_submit(user=owner, model=submitted, instance_group=cluster["instance_group"])
    WmlaExec.objects.create(job=job, framework="edtPyTorch", app_name="", args="")
    page = signed_in.get(reverse("models")).content.decode()
    registered, apart = page.split("data-submitted-models")
    assert model_def.name in registered and submitted.name not in registered
    assert "1 folder submitted with dlicmd" in apart and f">#{job.pk}</a>" in apart


def _log_lines(job, count: int) -> None:
    from events.ingest import ingest

    for i in range(count):
        ingest({"type": "log", "job_id": job.pk, "source": "driver", "ts": 1.0 + i,
                "stream": "stdout", "line": f"line {i}"}, stream_id=f"{i + 1}-0")


def test_the_whole_log_page_starts_at_the_first_line_and_pages_on(signed_in, job, tmp_path,
                                                                  settings):
    job.result_dir = str(tmp_path / "job-result")
    job.save()
    _log_lines(job, 700)
    page = signed_in.get(reverse("job-whole-log", args=[job.pk]))
    text = page.content.decode()
    assert ">[driver]</span> line 0<" in text and ">[driver]</span> line 499<" in text
    assert ">[driver]</span> line 500<" not in text
    following = page.context["next_offset"]
    text = signed_in.get(reverse("job-whole-log", args=[job.pk]), {"offset": following}).content
    assert b"line 699" in text and b"Next page" not in text
    searched = signed_in.get(reverse("job-whole-log", args=[job.pk]), {"q": "line 12"}).context
    assert [r["line"] for r in searched["lines"]] == ["line 12"] + [f"line {n}" for n in
                                                                    range(120, 130)]


def test_the_whole_log_is_its_owners_alone_and_also_over_the_api(client, other, api, owner,
                                                                 job, tmp_path):
    job.result_dir = str(tmp_path / "job-result")
    job.save()
    _log_lines(job, 3)
    client.force_login(other)
    assert client.get(reverse("job-whole-log", args=[job.pk])).status_code == 404
    body = api(owner).get(f"/api/v1/jobs/{job.pk}/log/", {"q": "line 2"}).json()
    assert [r["line"] for r in body["lines"]] == ["line 2"] and body["next"] is None
    assert api(other).get(f"/api/v1/jobs/{job.pk}/log/").status_code == 404
    assert api(owner).get(f"/api/v1/jobs/{job.pk}/log/", {"offset": -1}).status_code == 400


def test_the_train_form_says_every_problem_in_one_round(signed_in, model_def, cluster):
    response = signed_in.post(reverse("train"), _train_post(
        model_def, cluster, max_workers=1_000_000, args="--name 'unclosed",
        env_vars="LD_PRELOAD=/tmp/x.so\nPATH=/tmp\n1BAD=x"))
    assert response.status_code == 400
    errors = response.context["form"].errors
    assert {"max_workers", "args", "env_vars"} <= set(errors), errors
    assert len(errors["env_vars"]) == 3, errors["env_vars"]  # each bad variable named
    assert not TrainingJob.objects.exists()


def test_train_again_fills_the_form_as_the_job_was_started(signed_in, other, client, job):
    job.hyper_parameters = {"epochs": 7, "batch_size": 32, "dropout": 0.3}
    job.max_workers, job.priority, job.args = 3, 7000, "--lr 0.5"
    job.env_vars = {"MY_FLAG": "on"}
    job.save()
    page = signed_in.get(reverse("job", args=[job.pk])).content.decode()
    again = reverse("model-train", args=[job.model_id]) + f"?again={job.pk}"
    assert again in page
    form = signed_in.get(again).context["form"]
    assert (form["epochs"].value(), form["batch_size"].value()) == (7, 32)
    assert form["other_hyper_parameters"].value() == "dropout=0.3"
    assert (form["max_workers"].value(), form["priority"].value()) == (3, 7000)
    assert (form["args"].value(), form["env_vars"].value()) == ("--lr 0.5", "MY_FLAG=on")
    # Another user's job fills nothing (it is not theirs to see).
    client.force_login(other)
    assert client.get(reverse("train") + f"?again={job.pk}").context["form"][
        "args"].value() in (None, "")


def test_compare_puts_the_settings_that_differ_first(signed_in, owner, model_def, cluster):
    from console.compare import comparison, settings_table
    from jobs.services import job_submit

    group = cluster["instance_group"]
    job = job_submit(user=owner, model=model_def, instance_group=group,
                     hyper_parameters={"lr": 0.1, "epochs": 2})
    second = job_submit(user=owner, model=model_def, instance_group=group,
                        hyper_parameters={"lr": 0.01, "epochs": 2, "momentum": 0.9})
    _metrics(job, [2.0, 1.0], 0.5)
    _metrics(second, [3.0, 0.5], 0.75)
    data = comparison([job, second])
    table = settings_table([job, second], data["finals"])
    # lr differs, momentum is set in one run only; epochs, the model and the group are shared.
    assert table["differ"] == ["lr", "momentum"]
    assert ("epochs", "2") in table["same"] and ("model", model_def.name) in table["same"]
    assert [values for _, values, _ in table["rows"]] == [["0.1", "—"], ["0.01", "0.9"]]
    assert data["final_names"] == ["test accuracy"]
    assert [finals for _, _, finals in table["rows"]] == [["0.5"], ["0.75"]]
    page = signed_in.get(reverse("jobs-compare"), {"job": [job.pk, second.pk]}).content.decode()
    assert '<th class="differs" title="Differs between these runs">momentum</th>' in page
    assert "<code>epochs=2</code>" in page
