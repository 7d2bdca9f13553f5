"""The check before submit (``environments.services``): which environment a model's jobs run
in, what it provides, and the warnings said for a model's imports."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from environments.models import Environment, EnvironmentBuild
from environments.services import (
    environment_for,
    import_warnings,
    model_requirements,
    provided_modules,
)
from environments.spec import DEFAULT_NAME, PRODUCT_NAME, TENSORFLOW_NAME

pytestmark = pytest.mark.django_db

READY, BUILDING = EnvironmentBuild.State.READY, EnvironmentBuild.State.BUILDING


def _env(name: str, **hosts: tuple[str, list[str]]) -> Environment:
    env = Environment.objects.create(name=name, packages="torch==2.14.1")
    for host, (state, modules) in hosts.items():
        EnvironmentBuild.objects.create(environment=env, host=host, state=state,
                                        modules=modules)
    return env


def _model(folder, main: str = "import torch\n", environment=None, requirements: str = "",
           main_file: str = "main.py"):
    path = folder / main_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(main)
    return SimpleNamespace(location=str(folder), main_file=main_file, requirements=requirements,
                           environment=environment,
                           environment_id=environment.pk if environment else None)


def _group(environment=None, allow: bool = True):
    return SimpleNamespace(name="sig-elastic", default_environment=environment,
                           default_environment_id=environment.pk if environment else None,
                           allow_model_requirements=allow)


def test_the_models_environment_else_the_groups_else_the_clusters(tmp_path, settings):
    mine, groups = _env("mine"), _env("groups")
    assert environment_for(_model(tmp_path, environment=mine), _group(groups)) == mine
    assert environment_for(_model(tmp_path), _group(groups)) == groups
    assert environment_for(_model(tmp_path), _group()).name == PRODUCT_NAME  # conftest's
    settings.EDT_DEFAULT_ENVIRONMENT = DEFAULT_NAME
    assert environment_for(_model(tmp_path)).name == DEFAULT_NAME


def test_what_an_environment_provides_is_its_ready_builds_union():
    env = _env("vision", gpu=(READY, ["torch", "timm"]), cpu=(READY, ["torch", "numpy"]),
               new=(BUILDING, ["wandb"]))
    assert provided_modules(env) == {"torch", "timm", "numpy"}
    assert provided_modules(_env("fresh", h=(BUILDING, []))) is None
    product = provided_modules(Environment.objects.get(name=PRODUCT_NAME))
    assert "torch" in product and "pyedt" in product
    assert "timm_missing_xyz" not in product and "not a name" not in product


def test_a_missing_import_is_named_with_the_environment(tmp_path):
    env = _env("vision", h=(READY, ["torch"]))
    (tmp_path / "helpers.py").write_text("")
    main = "import os\nimport torch\nimport helpers\nimport timm_missing_xyz\n"
    assert import_warnings(_model(tmp_path, main, environment=env)) == [
        "`timm_missing_xyz` is not in environment vision: add it to requirements.txt or pick "
        "another environment"]
    # The runtime's modules are on every job's path, whatever the environment.
    clean = "import torch\nimport helpers\nimport pth_parameter_mgr\nfrom fabric_model import F\n"
    assert import_warnings(_model(tmp_path, clean, environment=env)) == []


def test_the_models_requirements_and_its_requirements_txt_provide(tmp_path):
    env = _env("vision", h=(READY, ["torch"]))
    main = "import torch\nimport timm_missing_xyz\nimport wandb\n"
    model = _model(tmp_path, main, environment=env, requirements="timm-missing-xyz==1.0")
    assert [w.split("`")[1] for w in import_warnings(model)] == ["wandb"]
    (tmp_path / "requirements.txt").write_text("# logging\nwandb\n")
    assert import_warnings(model) == []
    assert model_requirements(model) == ["timm-missing-xyz==1.0", "wandb"]


def test_requirements_that_will_not_be_installed_do_not_count(tmp_path):
    env = _env("vision", h=(READY, ["torch"]))
    main = "import timm_missing_xyz\n"
    model = _model(tmp_path, main, requirements="timm-missing-xyz")
    [said] = import_warnings(model, _group(env, allow=False))
    assert said.startswith("`timm_missing_xyz` is not in environment vision: pick another")
    assert "instance group sig-elastic does not install" in said
    [said] = import_warnings(model)  # the product's own Python (conftest's default)
    assert "environment product: pick another environment" in said
    assert "requirements.txt" not in said


def test_an_environment_built_nowhere_is_said_once(tmp_path):
    env = _env("fresh", h=(BUILDING, []))
    main = "import a_missing\nimport b_missing\n"
    assert import_warnings(_model(tmp_path, main, environment=env)) == [
        "environment fresh is not built on any host yet: its imports cannot be checked"]


def test_a_syntax_error_is_a_warning_naming_the_line(tmp_path):
    env = _env("fresh")
    [said] = import_warnings(_model(tmp_path, "import torch\nif x\n    y = 1\n",
                                    environment=env))
    assert said.startswith("main.py line 2: SyntaxError")
    assert "fail at once" in said


def test_a_main_file_in_a_sub_folder_sees_its_neighbours(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "parts.py").write_text("")
    model = _model(tmp_path, "import parts\nimport torch\n", main_file="src/train.py")
    assert import_warnings(model) == []


def test_a_main_file_that_cannot_be_read_here_says_nothing_or_why(tmp_path, monkeypatch):
    model = _model(tmp_path)
    (tmp_path / "main.py").unlink()
    assert import_warnings(model) == []
    monkeypatch.setattr("environments.imports.MAIN_MAX_BYTES", 4)
    (tmp_path / "main.py").write_text("import torch\n")
    [said] = import_warnings(model)
    assert "its imports were not checked" in said


def test_many_missing_imports_are_counted_past_the_first_twenty(tmp_path):
    env = _env("vision", h=(READY, ["torch"]))
    main = "".join(f"import missing_{i:02d}\n" for i in range(25))
    said = import_warnings(_model(tmp_path, main, environment=env))
    assert len(said) == 21 and said[-1].startswith("5 more imports")


def _tf(model):
    model.framework = "TensorFlow"
    return model


def test_a_tensorflow_model_gets_the_tensorflow_environment_where_the_default_is_builtin(
        tmp_path, settings):
    settings.EDT_DEFAULT_ENVIRONMENT = DEFAULT_NAME
    tf = environment_for(_tf(_model(tmp_path, main="import tensorflow\n")), _group())
    assert tf.name == TENSORFLOW_NAME
    packages = set(tf.requirements())
    assert {"tensorflow==2.21.0", "tf-keras==2.21.0", "torch==2.14.1"} <= packages
    assert not any(p.startswith("torchvision") for p in packages)  # see environments.spec
    assert environment_for(_model(tmp_path), _group()).name == DEFAULT_NAME  # PyTorch's
    # What the model or its instance group names wins, and so does a default an admin chose.
    mine, groups = _env("mine"), _env("groups")
    assert environment_for(_tf(_model(tmp_path, environment=mine)), _group(groups)) == mine
    assert environment_for(_tf(_model(tmp_path)), _group(groups)) == groups
    settings.EDT_DEFAULT_ENVIRONMENT = PRODUCT_NAME
    assert environment_for(_tf(_model(tmp_path)), _group()).name == PRODUCT_NAME


def test_the_tensorflow_environment_pins_what_the_products_extra_pins():
    """One release of TensorFlow for a job wherever it runs: the product's own extra (the
    product's interpreter, the tests) and the built-in environment."""
    import tomllib
    from pathlib import Path

    from environments.spec import TENSORFLOW_PACKAGES

    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    extra = set(project["project"]["optional-dependencies"]["tensorflow"])
    assert extra and extra <= set(TENSORFLOW_PACKAGES), (extra, TENSORFLOW_PACKAGES)


def test_a_frameworks_version_is_what_its_models_run_on_by_default(settings):
    from importlib import metadata

    from environments.services import framework_version

    settings.EDT_DEFAULT_ENVIRONMENT = DEFAULT_NAME
    assert framework_version("PyTorch") == "2.14.1"
    assert framework_version("TensorFlow") == "2.21.0"
    settings.EDT_DEFAULT_ENVIRONMENT = PRODUCT_NAME
    assert framework_version("PyTorch") == metadata.version("torch")
    Environment.objects.create(name="plain", packages="numpy==2.4.6")
    settings.EDT_DEFAULT_ENVIRONMENT = "plain"
    assert framework_version("TensorFlow") == ""  # pins none: not an error
    settings.EDT_DEFAULT_ENVIRONMENT = "removed"
    assert framework_version("PyTorch") == ""
