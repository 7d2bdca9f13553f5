"""Bad input gets a clear 4xx naming the field at fault, never a 500, and changes nothing.

Two halves:

- schemathesis generates requests (valid and invalid by the schema) for every operation of the
  project's own OpenAPI schema and sends them to the Django WSGI app as a signed-in normal user
  who owns some data: no response may be a 5xx or contradict the schema;
- hand-written hostile inputs (zip slip, archive bombs, paths escaping the data roots, absurd
  worker counts and priorities, bad environment variable names, unknown policies), each
  checked for its 4xx, the field it names, and unchanged row counts and upload folders.
"""

from __future__ import annotations

import io
import json
import os
import struct
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import schemathesis
from django.contrib.auth import get_user_model
from django.core import signals
from django.core.handlers.wsgi import WSGIHandler
from django.db import close_old_connections
from drf_spectacular.generators import SchemaGenerator
from drf_spectacular.renderers import OpenApiJsonRenderer
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
)

from datasets import services as dataset_services
from datasets.models import Dataset
from jobs import services as job_services
from jobs.models import JobEvent, SlotAllocation, TrainingJob
from models import services as model_services
from models.models import ModelDefinition
from resources.models import Host, InstanceGroup, ResourceGroup

# Examples per operation and generation mode: enough to hit every field with a few bad values,
# few enough for the whole schemathesis pass to stay well under a minute on two cores.
EXAMPLES = int(os.environ.get("EDT_SCHEMATHESIS_EXAMPLES", "12"))


def _openapi() -> dict:
    """The schema /api/schema/ serves, built in-process (no request, no database)."""
    spec = SchemaGenerator().get_schema(request=None, public=True)
    return json.loads(OpenApiJsonRenderer().render(spec))


SCHEMA = schemathesis.openapi.from_dict(_openapi())
SCHEMA.app = WSGIHandler()
# /api/v1 is this suite's subject; the WMLA-compatible API has its own tests.
OPERATIONS = [
    op for op in (result.ok() for result in SCHEMA.get_all_operations())
    if op.path.startswith("/api/v1/")
]
# Cluster objects only an admin may change; their writes are also fuzzed as the admin.
ADMIN_WRITES = ("/api/v1/hosts/", "/api/v1/resource-groups/", "/api/v1/instance-groups/")


@dataclass
class World:
    alice: object  # the normal user the fuzzer signs in as
    admin: object
    ids: dict[str, int]  # path prefix -> an id of one of alice's objects (or a shared one)
    root: Path


def _make_world(tmp_path: Path, settings) -> World:
    data, models_root = tmp_path / "data", tmp_path / "models"
    # alice registers datasets from her own area of the data root, data/alice/, and models
    # from hers of the model root, models/alice/.
    code = models_root / "alice" / "mlp"
    for folder in (data / "alice" / "train", data / "alice" / "test", code):
        folder.mkdir(parents=True)
    (code / "main.py").write_text("print('train')\n")
    settings.EDT_DATA_ROOTS = [data.resolve()]
    settings.EDT_MODEL_ROOTS = [models_root.resolve()]
    settings.EDT_UPLOAD_ROOT = (tmp_path / "uploads").resolve()
    settings.EDT_RESULT_ROOT = (tmp_path / "results").resolve()

    users = get_user_model().objects
    alice = users.create_user("alice")
    admin = users.create_superuser("root", password=None)
    host = Host.objects.create(name="cpu-host-1", cpu_slots=4)
    rg = ResourceGroup.objects.create(name="rg", slots_mode="static", static_slots=4)
    rg.hosts.add(host)
    ig = InstanceGroup.objects.create(name="ig", resource_group=rg)
    dataset = dataset_services.dataset_create(
        owner=alice, name="ds", train_path=str(data / "alice" / "train"),
        test_path=str(data / "alice" / "test"),
    )
    model = model_services.model_create(
        owner=alice, name="mlp", location=str(code), dataset=dataset,
        hyper_parameters={"epochs": 2},
    )
    job = job_services.job_submit(user=alice, model=model, instance_group=ig, max_workers=2)
    SlotAllocation.objects.create(job=job, host=host, slot=0, worker_id="w0")
    job_services.record_event(job, "worker.joined", "w0 joined")
    return World(
        alice=alice,
        admin=admin,
        ids={
            "/api/v1/datasets/": dataset.pk,
            "/api/v1/models/": model.pk,
            "/api/v1/jobs/": job.pk,
            "/api/v1/hosts/": host.pk,
            "/api/v1/resource-groups/": rg.pk,
            "/api/v1/instance-groups/": ig.pk,
        },
        root=tmp_path,
    )


@pytest.fixture
def world(db, tmp_path, settings) -> World:
    return _make_world(tmp_path, settings)


@pytest.fixture
def keep_test_connection():
    """The raw WSGI handler closes the database connection after each request, which would end
    the test's transaction on PostgreSQL; Django's own test client unhooks the same signals."""
    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    yield
    signals.request_started.connect(close_old_connections)
    signals.request_finished.connect(close_old_connections)


def _token(user) -> dict[str, str]:
    return {"Authorization": f"Token {Token.objects.get_or_create(user=user)[0].key}"}


def _fuzz(operation, world: World, user, mode: GenerationMode) -> None:
    headers = _token(user)
    checks = [not_a_server_error, response_schema_conformance, content_type_conformance]
    known_id = next((v for k, v in world.ids.items() if operation.path.startswith(k)), None)
    if mode is GenerationMode.POSITIVE and operation.method.upper() == "GET":
        # One deterministic read of a real object first: its response must match the schema
        # whatever the random examples below happen to hit.
        params = {"id": known_id} if "{id}" in operation.path else None
        operation.Case(path_parameters=params).call_and_validate(headers=headers, checks=checks)

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode), use_known_id=st.booleans())
    def run(case, use_known_id: bool) -> None:
        # Random ids mostly miss; half the examples aim at an object that exists.
        if use_known_id and known_id is not None and "id" in (case.path_parameters or {}):
            case.path_parameters["id"] = known_id
        case.call_and_validate(headers=headers, checks=checks)

    try:
        run()
    except Unsatisfiable:
        # Only string query parameters (any string is valid) and no body: nothing to violate.
        assert mode is GenerationMode.NEGATIVE
        pytest.skip("the schema leaves no way to send this operation invalid input")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=str)
@pytest.mark.parametrize("operation", OPERATIONS, ids=lambda op: op.label)
def test_it_answers_generated_requests_without_5xx_or_schema_violations(
    world: World, keep_test_connection, operation, mode: GenerationMode
) -> None:
    users = [world.alice]
    if operation.method.upper() != "GET" and operation.path.startswith(ADMIN_WRITES):
        users.append(world.admin)
    for user in users:
        _fuzz(operation, world, user, mode)


# --- Hand-written hostile input ------------------------------------------------------------


def _counts() -> dict[str, int]:
    return {
        "datasets": Dataset.objects.count(),
        "models": ModelDefinition.objects.count(),
        "jobs": TrainingJob.objects.count(),
        "events": JobEvent.objects.count(),
        "instance_groups": InstanceGroup.objects.count(),
        "resource_groups": ResourceGroup.objects.count(),
    }


def _files(root: Path) -> list[str]:
    """What uploads left under ``root``: every entry below the per-kind folders (``datasets/``),
    so one left-over extraction folder, even empty, shows."""
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if len(p.relative_to(root).parts) >= 2)


@pytest.fixture
def alice_api(world: World) -> APIClient:
    client = APIClient()
    client.force_authenticate(world.alice)
    return client


@pytest.fixture
def admin_api(world: World) -> APIClient:
    client = APIClient()
    client.force_authenticate(world.admin)
    return client


def _refused(response, field: str) -> None:
    """A 4xx whose JSON body names ``field``."""
    assert 400 <= response.status_code < 500, (response.status_code, response.content[:500])
    body = response.json()
    assert field in body, f"the error does not name '{field}': {body}"


def _zip(members: dict[str, bytes], *, symlink: str | None = None) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        if symlink:
            info = zipfile.ZipInfo("train/escape")
            info.external_attr = (0o120777 << 16)
            archive.writestr(info, symlink)
    return buf.getvalue()


def _tar(add) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as archive:
        add(archive)
    return buf.getvalue()


def _tar_member(archive: tarfile.TarFile, name: str, data: bytes = b"x", **attrs) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data) if attrs.get("type", tarfile.REGTYPE) == tarfile.REGTYPE else 0
    for key, value in attrs.items():
        setattr(info, key, value)
    archive.addfile(info, io.BytesIO(data) if info.size else None)


def _lying_zip() -> bytes:
    """A zip whose headers declare 10 bytes for a member that inflates to 4 MiB."""
    raw = bytearray(_zip({"train/a.bin": b"\0" * (4 << 20), "test/b.txt": b"b"}))
    declared = 10
    # Patch the uncompressed size in the local header (offset 22) and the central directory
    # entry (offset 24) of the first member.
    raw[22:26] = struct.pack("<I", declared)
    central = raw.rfind(b"PK\x01\x02", 0, raw.rfind(b"PK\x05\x06"))
    first_central = raw.find(b"PK\x01\x02")
    assert first_central != -1 and central != -1
    raw[first_central + 24:first_central + 28] = struct.pack("<I", declared)
    return bytes(raw)


def _corrupt_zip() -> bytes:
    """A well-formed directory over member data that does not inflate."""
    raw = bytearray(_zip({"train/a.txt": b"hello " * 1000, "test/b.txt": b"b"}))
    raw[40:80] = b"\xff" * 40
    return bytes(raw)


def _encrypted_zip() -> bytes:
    """A zip whose first member is flagged as encrypted (general purpose bit 0)."""
    raw = bytearray(_zip({"train/a.txt": b"a", "test/b.txt": b"b"}))
    raw[6] |= 0x01  # local header flags
    first_central = raw.find(b"PK\x01\x02")
    raw[first_central + 8] |= 0x01  # central directory flags
    return bytes(raw)


VALID_LAYOUT = {"train/a.txt": b"a", "test/b.txt": b"b"}
BAD_ARCHIVES = {
    "zip-slip": _zip({**VALID_LAYOUT, "../../evil.txt": b"pwned"}),
    "absolute-member": _zip({**VALID_LAYOUT, "/tmp/edt-evil.txt": b"pwned"}),
    "zip-symlink": _zip(VALID_LAYOUT, symlink="/etc/passwd"),
    "tar-slip": _tar(lambda a: [_tar_member(a, "train/a"), _tar_member(a, "test/b"),
                                _tar_member(a, "../evil")]),
    "tar-symlink": _tar(lambda a: [_tar_member(a, "test/b"),
                                   _tar_member(a, "train", type=tarfile.SYMTYPE,
                                               linkname="/etc")]),
    "tar-hardlink": _tar(lambda a: [_tar_member(a, "test/b"),
                                    _tar_member(a, "train/passwd", type=tarfile.LNKTYPE,
                                                linkname="/etc/passwd")]),
    "tar-device": _tar(lambda a: [_tar_member(a, "train/a"), _tar_member(a, "test/b"),
                                  _tar_member(a, "test/null", type=tarfile.CHRTYPE)]),
    "zip-bomb": _zip({"train/zeros.bin": b"\0" * (8 << 20), "test/b.txt": b"b"}),
    "zip-lying-size": _lying_zip(),
    "zip-corrupt-data": _corrupt_zip(),
    "zip-encrypted": _encrypted_zip(),
    "not-an-archive": b"this is plain text, not an archive\n" * 10,
    "empty-file": b"",
    "truncated-zip": _zip(VALID_LAYOUT)[:60],
    "truncated-tar-gz": _tar(lambda a: [_tar_member(a, "train/a", b"a" * 5000),
                                        _tar_member(a, "test/b")])[:-40],
    "no-train-folder": _zip({"test/b.txt": b"b", "other/c.txt": b"c"}),
}


@pytest.mark.parametrize("kind", list(BAD_ARCHIVES))
def test_it_refuses_a_bad_archive_upload_and_keeps_nothing(
    world: World, alice_api: APIClient, settings, kind: str
) -> None:
    settings.EDT_MAX_UPLOAD_BYTES = 1 << 20  # the bomb and the liar both expand beyond 1 MiB
    before, files = _counts(), _files(settings.EDT_UPLOAD_ROOT)
    upload = io.BytesIO(BAD_ARCHIVES[kind])
    upload.name = f"{kind}.zip"
    response = alice_api.post(
        "/api/v1/datasets/upload/", {"name": f"up-{kind}", "archive": upload}, format="multipart"
    )
    _refused(response, "archive")
    assert _counts() == before
    assert _files(settings.EDT_UPLOAD_ROOT) == files
    assert not (world.root.parent / "evil.txt").exists()
    assert not Path("/tmp/edt-evil.txt").exists()


def test_it_accepts_a_good_archive_so_the_refusals_mean_something(
    world: World, alice_api: APIClient
) -> None:
    upload = io.BytesIO(_zip(VALID_LAYOUT))
    upload.name = "good.zip"
    response = alice_api.post(
        "/api/v1/datasets/upload/", {"name": "good", "archive": upload}, format="multipart"
    )
    assert response.status_code == 201, response.content
    assert Path(response.json()["train_path"], "a.txt").read_bytes() == b"a"


def _escaping_paths(root: Path) -> dict[str, str]:
    outside = root / "outside"
    outside.mkdir(exist_ok=True)
    link = root / "data" / "escape"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    return {
        "dotdot": "../outside",
        "dotdot-inside-absolute": str(root / "data" / "train" / ".." / ".." / "outside"),
        "absolute-outside": str(outside),
        "etc": "/etc",
        "symlink-out": str(link),
        "symlink-out-relative": "escape",
        "nul": "train\x00/x",
        "empty": "",
        "missing": str(root / "data" / "no-such-folder"),
    }


@pytest.mark.parametrize(
    "case",
    ["dotdot", "dotdot-inside-absolute", "absolute-outside", "etc", "symlink-out",
     "symlink-out-relative", "nul", "empty", "missing"],
)
@pytest.mark.parametrize("field", ["train_path", "test_path"])
def test_it_refuses_a_dataset_path_outside_the_data_roots(
    world: World, alice_api: APIClient, case: str, field: str
) -> None:
    paths = {"train_path": str(world.root / "data" / "alice" / "train"),
             "test_path": str(world.root / "data" / "alice" / "test")}
    paths[field] = _escaping_paths(world.root)[case]
    before = _counts()
    response = alice_api.post("/api/v1/datasets/", {"name": f"ds-{case}", **paths}, format="json")
    _refused(response, field)
    assert _counts() == before


@pytest.mark.parametrize("case", ["dotdot", "absolute-outside", "etc", "symlink-out", "nul"])
def test_it_refuses_a_model_location_outside_the_model_roots(
    world: World, alice_api: APIClient, case: str
) -> None:
    location = _escaping_paths(world.root)[case]
    if case == "symlink-out":
        link = world.root / "models" / "escape"
        link.symlink_to(world.root / "outside", target_is_directory=True)
        location = str(link)
    before = _counts()
    response = alice_api.post(
        "/api/v1/models/",
        {"name": f"m-{case}", "location": location, "main_file": "main.py",
         "dataset": world.ids["/api/v1/datasets/"]},
        format="json",
    )
    _refused(response, "location")
    assert _counts() == before


@pytest.mark.parametrize("main_file", ["../../../etc/passwd", "/etc/passwd", "missing.py"])
def test_it_refuses_a_main_file_outside_the_model_folder(
    world: World, alice_api: APIClient, main_file: str
) -> None:
    before = _counts()
    response = alice_api.post(
        "/api/v1/models/",
        {"name": "m", "location": str(world.root / "models" / "alice" / "mlp"),
         "main_file": main_file, "dataset": world.ids["/api/v1/datasets/"]},
        format="json",
    )
    _refused(response, "main_file")
    assert _counts() == before


@pytest.mark.parametrize(
    "hyper_parameters",
    [{"epochs": -1}, {"epochs": "ten"}, {"learning_rate": True}, {"optimizer": "Magic"}, [1, 2]],
)
def test_it_refuses_bad_hyper_parameters_on_create_and_update(
    world: World, alice_api: APIClient, hyper_parameters
) -> None:
    before = _counts()
    response = alice_api.post(
        "/api/v1/models/",
        {"name": "m2", "location": str(world.root / "models" / "alice" / "mlp"),
         "dataset": world.ids["/api/v1/datasets/"], "hyper_parameters": hyper_parameters},
        format="json",
    )
    _refused(response, "hyper_parameters")
    model_id = world.ids["/api/v1/models/"]
    response = alice_api.patch(
        f"/api/v1/models/{model_id}/", {"hyper_parameters": hyper_parameters}, format="json"
    )
    _refused(response, "hyper_parameters")
    assert _counts() == before
    assert ModelDefinition.objects.get(pk=model_id).hyper_parameters == {"epochs": 2}


def _submit(world: World, **overrides) -> dict:
    ig = world.ids["/api/v1/instance-groups/"]
    return {"model": world.ids["/api/v1/models/"], "instance_group": ig, "max_workers": 2,
            **overrides}


BAD_SUBMITS = {
    "max_workers": [0, -1, -(2**63), 10**6, 2**63, "four", 1.5, None],
    "devices_per_worker": [0, -3, 10**9],
    "priority": [0, -1, 10001, 2**40, "high", 5000.5],
    "env_vars": [
        {"1ABC": "x"}, {"A-B": "x"}, {"": "x"}, {"A B": "x"}, {"PATH=/x": "y"}, {"ÄB": "x"},
        {"A\x00B": "x"}, {"SECRET_KEY": "x"}, {"DATABASE_URL": "x"}, {"CUDA_VISIBLE_DEVICES": "0"},
        {"OK": {"nested": 1}}, ["A=1"], "A=1",
    ],
    "model": [999_999, "x", None],
    "instance_group": [999_999, None],
}


@pytest.mark.parametrize(
    ("field", "value"),
    [(field, value) for field, values in BAD_SUBMITS.items() for value in values],
    ids=lambda v: repr(v)[:40],
)
def test_it_refuses_a_bad_job_submission_and_stores_nothing(
    world: World, alice_api: APIClient, field: str, value
) -> None:
    before = _counts()
    response = alice_api.post("/api/v1/jobs/", _submit(world, **{field: value}), format="json")
    _refused(response, field)
    assert _counts() == before


def test_it_accepts_a_good_job_submission_so_the_refusals_mean_something(
    world: World, alice_api: APIClient
) -> None:
    before = _counts()["jobs"]
    response = alice_api.post(
        "/api/v1/jobs/", _submit(world, priority=10000, env_vars={"MY_FLAG": "1"}), format="json"
    )
    assert response.status_code == 201, response.content
    assert _counts()["jobs"] == before + 1


@pytest.mark.parametrize("priority", [0, -1, 10001, 2**31, "urgent", None, 12.5])
def test_it_refuses_a_priority_out_of_range_and_keeps_the_old_one(
    world: World, alice_api: APIClient, priority
) -> None:
    job_id = world.ids["/api/v1/jobs/"]
    before = _counts()
    response = alice_api.patch(f"/api/v1/jobs/{job_id}/", {"priority": priority}, format="json")
    _refused(response, "priority")
    assert TrainingJob.objects.get(pk=job_id).priority == 5000
    assert _counts() == before


@pytest.mark.parametrize("order", [[], [999_999], "1,2", [1, 1], [None], [2**63], [-(2**63) - 1]])
def test_it_refuses_a_bad_reorder_and_changes_no_priority(
    world: World, alice_api: APIClient, order
) -> None:
    before = dict(TrainingJob.objects.values_list("pk", "priority"))
    events = _counts()["events"]
    response = alice_api.post("/api/v1/jobs/reorder/", {"order": order}, format="json")
    _refused(response, "order")
    assert dict(TrainingJob.objects.values_list("pk", "priority")) == before
    assert _counts()["events"] == events


@pytest.mark.parametrize(
    ("field", "value"),
    [("policy", "lottery"), ("policy", ""), ("policy", None), ("reclaim_grace_s", -1),
     ("reclaim_grace_s", 10**7), ("resource_group", 999_999), ("name", "")],
)
def test_it_refuses_a_bad_instance_group(
    world: World, admin_api: APIClient, field: str, value
) -> None:
    body = {"name": "ig2", "resource_group": world.ids["/api/v1/resource-groups/"],
            "policy": "fairshare", field: value}
    before = _counts()
    _refused(admin_api.post("/api/v1/instance-groups/", body, format="json"), field)
    ig = world.ids["/api/v1/instance-groups/"]
    _refused(admin_api.patch(f"/api/v1/instance-groups/{ig}/", {field: value}, format="json"),
             field)
    assert _counts() == before
    assert InstanceGroup.objects.get(pk=ig).policy == "fairshare"


@pytest.mark.parametrize(
    ("field", "value"),
    [("static_slots", 0), ("static_slots", 1025), ("static_slots", -4), ("slots_mode", "magic"),
     ("selection", "some"), ("hosts", [999_999])],
)
def test_it_refuses_a_bad_resource_group(
    world: World, admin_api: APIClient, field: str, value
) -> None:
    before = _counts()
    body = {"name": "rg2", "slots_mode": "static", "static_slots": 2, field: value}
    _refused(admin_api.post("/api/v1/resource-groups/", body, format="json"), field)
    assert _counts() == before


@pytest.mark.parametrize(
    ("path", "user"),
    [("datasets", "alice"), ("models", "alice"), ("instance-groups", "admin"),
     ("resource-groups", "admin")],
)
def test_it_refuses_to_delete_an_object_still_in_use_with_a_409(
    world: World, alice_api: APIClient, admin_api: APIClient, path: str, user: str
) -> None:
    """A dataset used by a model, a model used by a job, a group used by jobs or another group:
    the database protects them; the API says so instead of failing."""
    client = alice_api if user == "alice" else admin_api
    before = _counts()
    response = client.delete(f"/api/v1/{path}/{world.ids[f'/api/v1/{path}/']}/")
    assert response.status_code == 409, (response.status_code, response.content[:300])
    assert "detail" in response.json()
    assert _counts() == before


@pytest.mark.parametrize("path", ["datasets", "models", "jobs", "hosts", "instance-groups",
                                  "resource-groups", "jobs/{}/allocations", "jobs/{}/kill"])
@pytest.mark.parametrize("pk", [2**63, 10**30, -1])
def test_it_answers_an_id_beyond_the_integer_range_with_a_4xx(
    world: World, admin_api: APIClient, path: str, pk: int
) -> None:
    url = f"/api/v1/{path.format(pk)}/" if "{}" in path else f"/api/v1/{path}/{pk}/"
    before = _counts()
    response = admin_api.post(url) if url.endswith("kill/") else admin_api.get(url)
    assert response.status_code == 404, (url, response.status_code)
    assert _counts() == before


def test_it_refuses_a_malformed_json_body_with_a_4xx(world: World, alice_api: APIClient) -> None:
    before = _counts()
    response = alice_api.generic(
        "POST", "/api/v1/jobs/", b'{"model": 1, "max_workers": ', content_type="application/json"
    )
    assert response.status_code == 400, response.content
    assert _counts() == before
