"""What a job's command line and environment may hold, checked once at submit.

``jobs.services.job_submit`` applies these rules for every interface (``/api/v1``, the WMLA API,
the console's Train form), so a value the agent could never launch is a 400 naming the field at
submit, not a job that holds a slot and fails minutes later with a launch error.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex

from django.core.exceptions import ValidationError

from models.locations import location_problem

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
ENV_NAME_MAX = 256
ENV_COUNT_MAX = 256
# One argument word, or one NAME=value: Linux refuses any single string over 128 KiB
# (MAX_ARG_STRLEN) with E2BIG whatever the total; a quarter of that is plenty for a flag.
STRING_MAX = 32 * 1024
ARGS_WORDS_MAX = 4096
# The whole args string as typed (before splitting), so a huge body is refused before any work.
ARGS_MAX_BYTES = 128 * 1024

# The agent sets these for every job process (its folders, its identity and secret, the
# interpreter's search path); a job's own variables may not override them. The interpreter and
# loader variables are here too: the agent's start-up code runs in the job's process before
# the user's script, and they would change what it runs.
RESERVED_ENV = frozenset({
    "DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DJANGO_SETTINGS_MODULE",
    "CUDA_VISIBLE_DEVICES", "PATH", "HOME", "TMPDIR", "LANG", "LC_ALL",
    "RESULT_DIR", "LOG_DIR", "CHECKPOINT_DIR", "SAVED_MODEL_DIR",
    "DATA_DIR", "TRAIN_DATA_DIR", "TEST_DATA_DIR", "FABRIC_HOME",
    "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONEXECUTABLE",
    "PYTHONINSPECT", "PYTHONSAFEPATH", "PYTHONPLATLIBDIR", "PYTHONNOUSERSITE",
    "PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE",
})
RESERVED_PREFIXES = ("EDT_", "DLI_", "LD_")
# The runtime's tuning knobs (runtime/config.py) that WMLA users set with --msd-env, e.g.
# EDT_PULL_WEIGHT_TIME_OUT: the only EDT_ names a job may set.
USER_RUNTIME_KNOBS = frozenset({
    "EDT_PEER_TIMEOUT_S", "EDT_RDZV_GRACE_S", "EDT_PULL_WEIGHT_TIME_OUT",
    "EDT_PULL_FAILED_LIMITS", "EDT_BACKEND", "EDT_METRICS_INTERVAL_S", "EDT_SEED",
    "EDT_MIN_WORKERS", "EDT_HEARTBEAT_S", "EDT_STEP_LOG", "EDT_EVENTS_FLUSH_S",
    "EDT_KEEP_EPOCH_MODELS", "EDT_KEEP_BEST_BY",
})


def is_reserved_env(name: str) -> bool:
    if name in USER_RUNTIME_KNOBS:
        return False
    return name in RESERVED_ENV or name.startswith(RESERVED_PREFIXES)


def command_line_budget() -> int:
    """Bytes a job's own arguments, variables and hyper-parameters may take together: a quarter
    of the OS argument limit (the rest is the agent's own environment and paths, and a margin
    for agents on hosts with a smaller limit), at most 256 KiB."""
    try:
        arg_max = os.sysconf("SC_ARG_MAX")
    except (ValueError, OSError):
        arg_max = -1
    if arg_max <= 0:
        arg_max = 128 * 1024  # the smallest limit Linux has had
    return min(arg_max // 4, 256 * 1024)


def _nbytes(text: str, field: str, what: str) -> int:
    """The UTF-8 length of ``text``, which must be passable to a process: no NUL character,
    no lone surrogate."""
    if "\x00" in text:
        raise ValidationError({field: f"{what} contains a NUL character."})
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValidationError({field: f"{what} is not valid Unicode text."}) from None


def validate_args(args: object) -> list[str]:
    """The words of a job's ``args`` string, split as the agent will split them."""
    if args in (None, ""):
        return []
    if not isinstance(args, str):
        raise ValidationError({"args": "args must be a string, as typed on a command line."})
    if _nbytes(args, "args", "args") > ARGS_MAX_BYTES:
        raise ValidationError({"args": f"args may be at most {ARGS_MAX_BYTES} bytes long."})
    try:
        words = shlex.split(args)
    except ValueError as exc:  # an unclosed quote, a trailing escape
        raise ValidationError(
            {"args": f"args cannot be split like a command line: {exc}."}
        ) from None
    if len(words) > ARGS_WORDS_MAX:
        raise ValidationError({"args": f"args may hold at most {ARGS_WORDS_MAX} words."})
    for word in words:
        if len(word.encode("utf-8")) > STRING_MAX:
            raise ValidationError(
                {"args": f"An argument is longer than {STRING_MAX} bytes: pass it in a file."}
            )
    return words


def _env_name(name: object) -> str:
    if not isinstance(name, str) or len(name) > ENV_NAME_MAX or not ENV_NAME.match(name):
        shown = name[:60] if isinstance(name, str) else name
        raise ValidationError(
            {"env_vars": f"'{shown}' is not a valid environment variable name (letters, digits "
                         f"and _, not starting with a digit, at most {ENV_NAME_MAX} long)."}
        )
    if is_reserved_env(name):
        raise ValidationError(
            {"env_vars": f"'{name}' is set by the system and cannot be overridden."}
        )
    return name


def validate_env_vars(env_vars: object) -> dict[str, str]:
    """The job's own environment variables, as strings; a ValidationError on ``env_vars``."""
    if env_vars in (None, ""):
        return {}
    if not isinstance(env_vars, dict):
        raise ValidationError({"env_vars": "Environment variables must be an object of names."})
    if len(env_vars) > ENV_COUNT_MAX:
        raise ValidationError({"env_vars": f"At most {ENV_COUNT_MAX} environment variables."})
    clean: dict[str, str] = {}
    problems: list[str] = []
    for name, value in env_vars.items():
        try:
            clean[_env_name(name)] = _env_value(name, value)
        except ValidationError as exc:
            problems += exc.message_dict["env_vars"]
    if problems:  # every bad variable at once, not one per submit
        raise ValidationError({"env_vars": problems})
    return clean


def _env_value(name: str, value: object) -> str:
    if not isinstance(value, str | int | float | bool):
        raise ValidationError({"env_vars": f"The value of '{name}' must be a string."})
    if isinstance(value, float) and not math.isfinite(value):
        raise ValidationError({"env_vars": f"The value of '{name}' is not a finite number."})
    text = str(value)
    if len(name) + 1 + _nbytes(text, "env_vars", f"The value of '{name}'") > STRING_MAX:
        raise ValidationError(
            {"env_vars": f"'{name}' is longer than {STRING_MAX} bytes: pass it in a file."}
        )
    return text


def validate_command_line(words: list[str], env: dict[str, str], hyper_parameters: dict) -> None:
    """Arguments, variables and hyper-parameters (EDT_HPARAMS) together fit the OS limit."""
    def size(text: str) -> int:
        return len(text.encode("utf-8")) + 1

    parts = {
        "args": sum(size(w) for w in words),
        "env_vars": sum(size(f"{k}={v}") for k, v in env.items()),
        "hyper_parameters": size("EDT_HPARAMS=" + json.dumps(hyper_parameters)),
    }
    budget = command_line_budget()
    if sum(parts.values()) > budget:
        largest = max(parts, key=parts.__getitem__)
        raise ValidationError(
            {largest: f"The job's arguments, environment variables and hyper-parameters take "
                      f"{sum(parts.values())} bytes, over the {budget} bytes a job may pass on "
                      f"its command line: pass large inputs in a file."}
        )


def validate_model_location(model) -> None:
    """A job runs only a model whose folder keeps the model rule today (``models.locations``):
    a row stored before the rule, or whose folder became a link since, is refused at submit
    with the reason, rather than handing its jobs every user's code."""
    problem = location_problem(model)
    if problem:
        raise ValidationError({"model": f"Model '{model.name}' cannot run: {problem}"})
