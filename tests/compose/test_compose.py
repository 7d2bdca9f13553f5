"""Static checks of docker-compose.yml and the Dockerfile (no Docker engine on CI machines).

The file is parsed as Docker Compose would read it (YAML merge keys included) and each promise
of the evaluation stack is checked: services, healthchecks, start order, the GPU profile, the
volumes shared by the console and the host agents, and that every command a container runs
exists in this project and accepts its arguments.
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath

import pytest
import yaml
from django.core.management import call_command, get_commands, load_command_class

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
SETUP_SCRIPT = ROOT / "edt"

INFRA = {"db", "redis"}
DJANGO_SERVICES = {"migrate", "web", "scheduler", "events", "worker", "gpu-worker"}
LONG_RUNNING = DJANGO_SERVICES - {"migrate"}
SHARED_ROOTS = {
    "EDT_DATA_ROOTS": "data",
    "EDT_MODEL_ROOTS": "models",
    "EDT_RESULT_ROOT": "results",
}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose: dict) -> dict:
    return compose["services"]


def _argv(command: str | list[str]) -> list[list[str]]:
    """The programs a compose ``command`` runs: a list is one argv; ``sh -c "a && b"`` is two."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if argv[:2] == ["sh", "-c"] or argv[:2] == ["bash", "-c"]:
        return [shlex.split(part) for part in re.split(r"&&|;", argv[2]) if part.strip()]
    return [argv]


def _command(service: dict) -> list[list[str]]:
    assert "command" in service, "every Django service names its command explicitly"
    return _argv(service["command"])


def _mounts(service: dict) -> dict[str, str]:
    """Container path -> named volume."""
    mounts = {}
    for entry in service.get("volumes", []):
        source, target = entry.split(":")[:2]
        mounts[target] = source
    return mounts


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def _volume_of(path: str, mounts: dict[str, str]) -> str | None:
    for target, source in mounts.items():
        if PurePosixPath(path) == PurePosixPath(target) or PurePosixPath(target) in PurePosixPath(
            path
        ).parents:
            return source
    return None


def test_it_defines_the_whole_stack(services: dict) -> None:
    assert INFRA | DJANGO_SERVICES <= set(services), sorted(INFRA | DJANGO_SERVICES - set(services))


def test_it_checks_postgres_over_tcp_so_initialisation_does_not_count_as_ready(
    services: dict,
) -> None:
    test = " ".join(services["db"]["healthcheck"]["test"])
    assert "pg_isready" in test and "-h 127.0.0.1" in test
    assert services["db"]["image"].startswith("postgres:")


def test_it_checks_redis_answers_ping(services: dict) -> None:
    test = " ".join(services["redis"]["healthcheck"]["test"])
    assert "redis-cli" in test and "ping" in test
    assert services["redis"]["image"].startswith("redis:")


def test_it_migrates_and_bootstraps_once_before_anything_else(services: dict) -> None:
    migrate = services["migrate"]
    programs = _command(migrate)
    assert ["python", "manage.py", "migrate", "--noinput"] in programs
    assert any(argv[:3] == ["python", "manage.py", "bootstrap"] for argv in programs)
    # Order matters: bootstrap writes rows into the tables migrate creates.
    names = [argv[2] for argv in programs if argv[:2] == ["python", "manage.py"]]
    assert names.index("migrate") < names.index("bootstrap")
    assert migrate.get("restart") == "no"
    assert migrate["depends_on"]["db"]["condition"] == "service_healthy"
    env = _env(migrate)
    assert {"EDT_ADMIN_USER", "EDT_ADMIN_PASSWORD"} <= set(env)


@pytest.mark.parametrize("name", sorted(LONG_RUNNING))
def test_it_starts_each_service_after_healthy_infra_and_a_finished_migration(
    services: dict, name: str
) -> None:
    depends = services[name]["depends_on"]
    assert depends["db"]["condition"] == "service_healthy"
    assert depends["redis"]["condition"] == "service_healthy"
    assert depends["migrate"]["condition"] == "service_completed_successfully"


@pytest.mark.parametrize("name", sorted(DJANGO_SERVICES))
def test_it_points_every_django_service_at_the_compose_database_and_redis(
    services: dict, name: str
) -> None:
    env = _env(services[name])
    assert re.match(r"^postgres(ql)?://[^@]+@db:5432/", env["DATABASE_URL"]), env["DATABASE_URL"]
    assert re.match(r"^redis://:[^@]+@redis:6379/", env["REDIS_URL"]), env["REDIS_URL"]


def _defaulted(value: str) -> str:
    """``value`` as Compose reads it when no variable is set: ``${NAME:-default}`` -> default."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def test_redis_requires_the_password_every_service_logs_in_with(services: dict) -> None:
    from urllib.parse import urlsplit

    from config.redis_auth import COMPOSE_DEFAULT_PASSWORD

    argv = services["redis"]["command"]
    assert "--requirepass" in argv, "Redis must not answer without a password"
    password = argv[argv.index("--requirepass") + 1]
    assert password == "${REDIS_PASSWORD:-" + COMPOSE_DEFAULT_PASSWORD + "}"
    for name in sorted(DJANGO_SERVICES):
        url = urlsplit(_defaulted(_env(services[name])["REDIS_URL"]))
        assert url.password == _defaulted(password), name
    # The healthcheck logs in too (redis-cli reads REDISCLI_AUTH), or Redis never turns healthy.
    assert _env(services["redis"])["REDISCLI_AUTH"] == password
    # The example default is named where operators read, and a root agent recognises it.
    header = COMPOSE.read_text().split("x-edt:")[0]
    assert "REDIS_PASSWORD" in header and COMPOSE_DEFAULT_PASSWORD in header


def test_it_adds_the_gpu_worker_only_with_the_gpu_profile(services: dict) -> None:
    gpu = services["gpu-worker"]
    assert gpu["profiles"] == ["gpu"]
    devices = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    # `docker compose up` without a profile must work on a machine without GPUs.
    assert [n for n, s in services.items() if n != "gpu-worker" and s.get("profiles")] == []
    assert all("deploy" not in s for n, s in services.items() if n != "gpu-worker")


def test_it_serves_the_console_over_http_on_8000_and_https_on_8443(services: dict) -> None:
    web = services["web"]
    assert _command(web) == [["python", "manage.py", "serve_web", "--host", "0.0.0.0",
                              "--port", "8000", "--https-port", "8443"]]
    assert any(str(port).endswith(":8000") for port in web["ports"])
    assert any(str(port).endswith(":8443") for port in web["ports"])
    assert "healthcheck" in web


def test_the_web_command_makes_a_certificate_and_runs_the_web_server_with_it(
    services: dict, settings, tmp_path
) -> None:
    from config import web_server

    settings.VAR_DIR = tmp_path
    argv = _command(services["web"])[0][2:]
    out = io.StringIO()
    call_command(*argv, "--check", stdout=out)
    server = out.getvalue().split()
    assert server[1:3] == ["-m", "config.web_server"]
    options = web_server.parse(server[3:])
    assert options.port == 8000 and options.host == "0.0.0.0" and options.https_port == 8443
    assert options.certfile == str(tmp_path / "tls" / "cert.pem")
    assert options.keyfile == str(tmp_path / "tls" / "key.pem")
    assert (tmp_path / "tls" / "cert.pem").is_file()
    assert oct((tmp_path / "tls" / "key.pem").stat().st_mode & 0o777) == "0o600"


def test_it_runs_a_cpu_host_agent_with_slots(services: dict) -> None:
    (argv,) = _command(services["worker"])
    assert argv[:3] == ["python", "manage.py", "run_host_agent"]
    assert "--cpu-slots" in argv and int(argv[argv.index("--cpu-slots") + 1]) >= 1
    assert "--name" in argv
    assert "--cpu-slots" not in _command(services["gpu-worker"])[0]


def test_it_gives_each_host_agent_its_own_name(services: dict) -> None:
    names = [argv[argv.index("--name") + 1] for n in ("worker", "gpu-worker")
             for argv in _command(services[n])]
    assert len(set(names)) == 2, names


@pytest.mark.parametrize("name", sorted(DJANGO_SERVICES))
def test_it_shares_the_data_model_and_result_volumes(services: dict, name: str) -> None:
    """Web, migrate (demo data) and the host agents see the same files at the same paths."""
    reference = services["web"]
    service = services[name]
    env, mounts = _env(service), _mounts(service)
    assert _mounts(reference) == mounts
    for variable, volume in SHARED_ROOTS.items():
        for path in env[variable].split(","):
            assert _volume_of(path, mounts) == volume, f"{name}: {variable}={path} not on {volume}"
    # Uploaded datasets must land where the host agents can read them.
    assert _volume_of(env["EDT_UPLOAD_ROOT"], mounts) == "data"
    # The state volume carries the generated secret key from migrate to everyone else.
    assert _volume_of(env["EDT_VAR_DIR"], mounts) == "state"


def test_it_declares_every_named_volume_it_mounts(compose: dict) -> None:
    declared = set(compose["volumes"])
    used = {src for s in compose["services"].values() for src in _mounts(s).values()}
    named = {v for v in used if not v.startswith((".", "/"))}
    assert named <= declared, sorted(named - declared)


def test_it_needs_no_env_file_to_start() -> None:
    """Every ${VAR} has a default, so `docker compose up` works on a fresh checkout."""
    body = "\n".join(
        line for line in COMPOSE.read_text().splitlines() if not line.lstrip().startswith("#")
    )
    bare = [m for m in re.findall(r"\$\{([^}]+)\}", body) if "-" not in m]
    assert bare == []


def _all_programs(services: dict) -> list[tuple[str, list[str]]]:
    return [(name, argv) for name in sorted(DJANGO_SERVICES) for argv in _command(services[name])]


def test_every_management_command_it_runs_exists_and_accepts_its_arguments(services: dict) -> None:
    available = get_commands()
    problems = []
    for name, argv in _all_programs(services):
        if argv[:2] != ["python", "manage.py"]:
            continue
        command, args = argv[2], argv[3:]
        if command not in available:
            problems.append(f"{name}: manage.py {command} does not exist")
            continue
        parser = load_command_class(available[command], command).create_parser("manage.py", command)
        try:
            parser.parse_args(args)
        except (SystemExit, argparse.ArgumentError) as exc:
            problems.append(f"{name}: manage.py {command} {' '.join(args)} rejected ({exc})")
    assert problems == [], "\n".join(problems)


def test_the_images_default_command_serves_an_application_that_imports() -> None:
    from config import web_server

    (cmd,) = [line for line in _shell_lines(DOCKERFILE.read_text()) if line.startswith("CMD ")]
    argv = json.loads(cmd.removeprefix("CMD "))
    assert argv[:3] == ["python", "-m", "config.web_server"]
    options = web_server.parse(argv[3:])
    assert (options.host, options.port) == ("0.0.0.0", 8000)
    module, attribute = web_server.APP.split(":")
    assert callable(getattr(importlib.import_module(module), attribute))


def test_it_runs_only_programs_the_image_provides(services: dict) -> None:
    for name, argv in _all_programs(services):
        assert argv[0] == "python", f"{name} runs {argv[0]}"


# --- Dockerfile ------------------------------------------------------------------------------


def _shell_lines(text: str) -> list[str]:
    """Logical shell lines: continuations joined, comments dropped."""
    text = re.sub(r"\\\n", " ", text)
    return [line.strip() for line in text.splitlines() if line.strip() and not
            line.strip().startswith("#")]


_PIP_INSTALL = re.compile(r"""(?:^|[\s;&|(])(?:\S*/)?pip3?["']?\s+install\s+(?P<args>[^;&|)]*)""")
_OPTIONS_WITH_VALUE = {"-i", "--index-url", "--extra-index-url", "-c", "--constraint",
                       "--find-links", "-f", "--target", "-t", "--prefix", "--root"}


def _pip_requirements(text: str) -> list[frozenset[str]]:
    """The requirement set of each ``pip install`` in a script, options left out; the project
    itself (``.``, ``-e ".[test]"``, a path) is written ``<project>``, extras dropped."""
    found = []
    for line in _shell_lines(text):
        for match in _PIP_INSTALL.finditer(line.removeprefix("RUN ")):
            tokens = shlex.split(match.group("args"), comments=True)
            reqs, skip = set(), False
            for token in tokens:
                if skip:
                    skip = False
                    continue
                if token in _OPTIONS_WITH_VALUE:
                    skip = True
                    continue
                if token.startswith("-"):  # -e, -q, --upgrade, --no-cache-dir ...
                    continue
                if token.startswith((".", "/", "$")):
                    reqs.add("<project>")
                else:
                    reqs.add(token.lower())
            found.append(frozenset(reqs))
    return found


def _pyproject_pins() -> dict[str, str]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        name, _, version = dep.partition("==")
        pins[re.sub(r"\[.*\]", "", name).lower()] = version
    return pins


def test_the_image_installs_the_project_the_way_the_setup_script_does() -> None:
    assert SETUP_SCRIPT.is_file(), "./edt (the README's first command) is missing"
    setup = set(_pip_requirements(SETUP_SCRIPT.read_text()))
    image = set(_pip_requirements(DOCKERFILE.read_text()))
    assert any("<project>" in reqs for reqs in setup), "./edt does not pip install the project"
    # The same install steps; only the options differ (editable and quiet on a bare machine).
    shown = {name: sorted(map(sorted, steps)) for name, steps in (("image", image), ("edt", setup))}
    assert image == setup, shown
    # The image installs no extras (tests, linters) that ./edt up would not.
    assert not re.search(r"pip3?\s+install[^\n]*\.\[", DOCKERFILE.read_text())
    # Whatever ./edt pins on the side (torch==2.13.0) is what pyproject.toml, and so the
    # image's `pip install .`, installs too.
    pins = _pyproject_pins()
    for reqs in setup:
        for req in reqs:
            name, sep, version = req.partition("==")
            if sep:
                assert pins.get(name) == version, f"./edt installs {req}, pyproject pins {name}"


def test_the_image_matches_the_supported_python_and_serves_static_files() -> None:
    text = DOCKERFILE.read_text()
    base = re.search(r"^FROM\s+python:(\d+)\.(\d+)", text, re.M)
    assert base, "the image starts from an official python image"
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    low = tuple(int(x) for x in re.search(r">=\s*(\d+)\.(\d+)", requires).groups())
    assert (int(base.group(1)), int(base.group(2))) >= low
    assert "collectstatic --noinput" in text
    assert re.search(r"^USER\s+(?!root\b)\S+", text, re.M), "containers run as a non-root user"


def test_it_keeps_local_state_and_the_venv_out_of_the_build_context() -> None:
    ignored = set((ROOT / ".dockerignore").read_text().split())
    assert {".git", ".venv", "var"} <= ignored


def test_host_agents_run_as_root_to_give_each_users_jobs_an_account_of_their_own(
    services: dict,
) -> None:
    agents = [name for name in DJANGO_SERVICES
              if any("run_host_agent" in argv for argv in _command(services[name]))]
    assert agents, "no host agent in the compose file"
    for name in agents:
        assert services[name].get("user") == "root", f"{name} cannot switch to job accounts"
        base = _defaulted(_env(services[name])["EDT_RUN_AS_UID_BASE"])
        assert int(base) > 0, f"{name} would run every job under its own account"
    for name in ("web", "scheduler", "events"):
        assert services[name].get("user") != "root", f"{name} needs no privilege"
