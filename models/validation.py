"""The rules a model definition's values follow: hyper-parameters and the main file.

One rule each, applied by ``models.services`` when a model is created or changed and by
``jobs.services.job_submit`` when a job overrides them, so ``/api/v1``, the WMLA API and the
console's forms refuse the same values with the same message, at once, instead of a job failing
minutes later on an agent.
"""

from __future__ import annotations

import codecs
import json
import math
import os
import stat
import tokenize
from io import BytesIO
from pathlib import Path

from django.core.exceptions import ValidationError

OPTIMIZERS = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad")
# Positive whole numbers, with a bound well above any real run: a value past it is a typo (or a
# probe) that would otherwise reach the database's integer columns and the runtime's loops.
EPOCHS_MAX = 100_000
BATCH_SIZE_MAX = 1_000_000
INT_BOUNDS = {
    "epochs": (1, EPOCHS_MAX),
    "epoch": (1, EPOCHS_MAX),  # pth_parameter_mgr.getEpoch's WMLA spelling
    "batch_size": (1, BATCH_SIZE_MAX),
    "train_batch_size": (1, BATCH_SIZE_MAX),
}
FLOAT_MAX = 1e6
FLOAT_KEYS = ("learning_rate", "lr", "momentum", "weight_decay", "eps")
# Hyper-parameters reach every job process as one environment variable (EDT_HPARAMS): the
# kernel refuses a single variable over 128 KiB, so the whole object stays well below that.
HPARAMS_MAX_BYTES = 32 * 1024
HPARAMS_MAX_DEPTH = 16
INT64 = 2**63


def _error(message: str) -> ValidationError:
    return ValidationError({"hyper_parameters": message})


def _check_text(text: str) -> None:
    # PostgreSQL's JSON holds neither a NUL character nor a lone surrogate.
    if "\x00" in text:
        raise _error("Hyper-parameters may not contain a NUL character.")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise _error("Hyper-parameters must be valid Unicode text.") from None


def _check_tree(value: object) -> None:
    """Every number fits what a database and the runtime can hold; nesting stays shallow.
    Iterative, so a deep value cannot exhaust the stack here."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > HPARAMS_MAX_DEPTH:
            raise _error(f"Hyper-parameters may nest at most {HPARAMS_MAX_DEPTH} levels deep.")
        if isinstance(item, str):
            _check_text(item)
            continue
        if isinstance(item, bool) or item is None:
            continue
        if isinstance(item, int):
            if not -INT64 <= item < INT64:
                raise _error("A hyper-parameter is an integer too large (64-bit at most).")
        elif isinstance(item, float):
            if not math.isfinite(item):
                raise _error("Hyper-parameters must be finite numbers (no NaN or infinity).")
        elif isinstance(item, dict):
            for key in item:
                _check_text(str(key))
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list | tuple):
            stack.extend((v, depth + 1) for v in item)
        else:
            raise _error(f"Unsupported hyper-parameter value of type {type(item).__name__}.")


def _check_known(hp: dict) -> None:
    for key, (low, high) in INT_BOUNDS.items():
        if key not in hp:
            continue
        value = hp[key]
        if isinstance(value, bool) or not isinstance(value, int):
            raise _error(f"'{key}' must be an int.")
        if not low <= value <= high:
            raise _error(f"'{key}' must be between {low} and {high}.")
    for key in FLOAT_KEYS:
        if key not in hp:
            continue
        value = hp[key]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise _error(f"'{key}' must be a float.")
        if not 0 <= value <= FLOAT_MAX:
            raise _error(f"'{key}' must be between 0 and {FLOAT_MAX:g}.")
    if "optimizer" in hp and hp["optimizer"] not in OPTIMIZERS:
        raise _error(f"'optimizer' must be one of {', '.join(OPTIMIZERS)}.")


def validate_hyper_parameters(hp: object) -> dict:
    """``hp`` as stored, or a ValidationError on ``hyper_parameters`` saying what is wrong."""
    if hp in (None, ""):
        return {}
    if not isinstance(hp, dict):
        raise _error("Hyper-parameters must be an object.")
    _check_known(hp)
    _check_tree(hp)
    if len(json.dumps(hp)) > HPARAMS_MAX_BYTES:
        raise _error(f"Hyper-parameters may take at most {HPARAMS_MAX_BYTES} bytes as JSON.")
    return hp


SAMPLE_BYTES = 4096
MAIN_FILE_MAX = 255  # ModelDefinition.main_file's length
# What a main file that is not Python source usually starts with.
_NOT_SOURCE = {
    b"PK\x03\x04": "a zip archive",
    b"PK\x05\x06": "a zip archive",
    b"\x1f\x8b": "a gzip archive",
    b"BZh": "a bzip2 archive",
    b"\xfd7zXZ\x00": "an xz archive",
    b"7z\xbc\xaf\x27\x1c": "a 7z archive",
    b"\x7fELF": "a compiled program",
}


def main_file_problem(head: bytes) -> str | None:
    """Why the first bytes of a main file show it is not Python source, or None.

    ``python main.py`` would happily run a zip archive holding ``__main__.py``; WMLA runs the
    main file of the model folder as a script, and an archive there is always an upload
    mistake (the archive should have been the model), so it is refused."""
    for magic, what in _NOT_SOURCE.items():
        if head.startswith(magic):
            hint = ": upload the archive as the model instead" if "archive" in what else ""
            return f"is {what}, not Python source{hint}"
    if b"\0" in head:
        return "is not Python source (it holds binary content)"
    try:
        encoding, _ = tokenize.detect_encoding(BytesIO(head).readline)
        # Not final when the sample is full: a character cut at its end is not an error.
        codecs.getincrementaldecoder(encoding)().decode(head, final=len(head) < SAMPLE_BYTES)
    except (SyntaxError, LookupError, UnicodeDecodeError):
        return "is not Python source (it is not text in its declared or UTF-8 encoding)"
    return None


def check_main_file(location: Path, main_file: str) -> str:
    """``main_file`` if it names a regular file of Python source inside the folder
    ``location``; else a ValidationError on ``main_file``."""
    main_file = (main_file or "main.py").strip()
    if len(main_file) > MAIN_FILE_MAX or "\x00" in main_file:
        raise ValidationError(
            {"main_file": f"The main file's name must be a path of at most {MAIN_FILE_MAX} "
                          "characters, without NUL."}
        )
    target = (location / main_file).resolve()
    if location not in target.parents or not target.is_file():
        raise ValidationError({"main_file": f"'{main_file}' is not a file in the model folder."})
    try:
        # O_PATH opens nothing for reading: a FIFO or a device under the name is looked at,
        # never opened (no hang, no side effect); only a regular file is read.
        path_fd = os.open(target, os.O_PATH | os.O_CLOEXEC)
    except OSError as exc:
        raise ValidationError(
            {"main_file": f"'{main_file}' cannot be opened: {exc.strerror}."}
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(path_fd).st_mode):
            raise ValidationError({"main_file": f"'{main_file}' is not a regular file."})
        with open(f"/proc/self/fd/{path_fd}", "rb") as f:
            head = f.read(SAMPLE_BYTES)
    except PermissionError:
        # Readable by the owner's job account but not by the console: the host agent checks
        # the content when it launches the job.
        return main_file
    except OSError as exc:
        raise ValidationError(
            {"main_file": f"'{main_file}' cannot be read: {exc.strerror}."}
        ) from None
    finally:
        os.close(path_fd)
    problem = main_file_problem(head)
    if problem:
        raise ValidationError({"main_file": f"The main file '{main_file}' {problem}."})
    return main_file
