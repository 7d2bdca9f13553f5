"""The rules of a job's command line and environment, checked once at submit."""

from __future__ import annotations

import os

import pytest
from django.core.exceptions import ValidationError

from jobs.validation import (
    command_line_budget,
    is_reserved_env,
    validate_args,
    validate_command_line,
    validate_env_vars,
)


def test_args_split_as_the_agent_splits_them():
    assert validate_args("--lr 0.1 'two words'") == ["--lr", "0.1", "two words"]
    assert validate_args("") == [] and validate_args(None) == []


@pytest.mark.parametrize("args, message", [
    ("--lr 'unclosed", "cannot be split"),
    ("trailing \\", "cannot be split"),
    ("a\x00b", "NUL"),
    ("\ud800", "Unicode"),
    ("x" * 40_000, "longer than"),
    ("y " * 70_000, "at most"),
    (42, "must be a string"),
])
def test_args_the_agent_could_not_pass_are_refused(args, message):
    with pytest.raises(ValidationError) as err:
        validate_args(args)
    assert message in err.value.message_dict["args"][0]


@pytest.mark.parametrize("name", [
    "EDT_JOB_SECRET", "EDT_DRIVER_ADDR", "EDT_HPARAMS", "DLI_EXECID", "LD_PRELOAD",
    "LD_LIBRARY_PATH", "PYTHONPATH", "PYTHONHOME", "RESULT_DIR", "CUDA_VISIBLE_DEVICES",
    "SECRET_KEY", "PATH", "HOME",
])
def test_names_the_product_sets_are_reserved(name):
    assert is_reserved_env(name)
    with pytest.raises(ValidationError, match="set by the system"):
        validate_env_vars({name: "x"})


@pytest.mark.parametrize("name", ["EDT_PULL_WEIGHT_TIME_OUT", "EDT_PULL_FAILED_LIMITS",
                                  "EDT_SEED", "OMP_NUM_THREADS", "MY_FLAG", "_private"])
def test_the_users_own_and_the_runtime_knobs_are_allowed(name):
    assert validate_env_vars({name: 3}) == {name: "3"}


@pytest.mark.parametrize("env", [
    {"BAD-NAME": "1"}, {"1ABC": "1"}, {"": "1"}, {"A" * 300: "1"}, {"A\x00": "1"},
    {"A": "x\x00y"}, {"A": {"nested": 1}}, {"A": float("inf")}, {"A": "x" * 40_000},
    {f"V{i}": "1" for i in range(300)}, ["A=1"],
])
def test_bad_environment_variables_are_refused(env):
    with pytest.raises(ValidationError) as err:
        validate_env_vars(env)
    assert "env_vars" in err.value.message_dict


def test_the_budget_leaves_room_for_the_agents_own_environment():
    budget = command_line_budget()
    assert 0 < budget <= os.sysconf("SC_ARG_MAX") // 4
    env = {f"V{i}": "z" * 30_000 for i in range(budget // 30_000 + 1)}
    with pytest.raises(ValidationError) as err:
        validate_command_line([], env, {})
    assert "env_vars" in err.value.message_dict
    validate_command_line(["--lr", "0.1"], {"A": "1"}, {"epochs": 3})
