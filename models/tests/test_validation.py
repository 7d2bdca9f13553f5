"""The rules of a model's values: hyper-parameter bounds and the main file's type."""

from __future__ import annotations

import json

import pytest
from django.core.exceptions import ValidationError

from models.validation import check_main_file, main_file_problem, validate_hyper_parameters


@pytest.mark.parametrize("hp", [
    {"epochs": 5, "batch_size": 64, "learning_rate": 0.01, "optimizer": "Adam"},
    {"lr": 0.1, "betas": [0.9, 0.999], "custom": {"depth": 3, "name": "x"}},
    {}, None,
])
def test_it_accepts_sane_hyper_parameters(hp):
    assert validate_hyper_parameters(hp) == (hp or {})


@pytest.mark.parametrize("hp, message", [
    ({"epochs": 10**30}, "between 1 and"),
    ({"epochs": 0}, "between 1 and"),
    ({"epoch": -1}, "between 1 and"),
    ({"train_batch_size": 10**7}, "between 1 and"),
    ({"epochs": True}, "must be an int"),
    ({"learning_rate": 1e30}, "between 0 and"),
    ({"momentum": -0.5}, "between 0 and"),
    ({"weights": [1, [2, [3, 10**20]]]}, "too large"),
    ({"x": float("nan")}, "finite"),
    ({"x": "a\x00b"}, "NUL"),
    ({"\ud800": 1}, "Unicode"),
    ({"deep": json.loads("[" * 20 + "]" * 20)}, "nest"),
    ({"blob": "x" * 40_000}, "bytes as JSON"),
    ([1, 2], "must be an object"),
])
def test_it_refuses_out_of_range_hyper_parameters_naming_the_field(hp, message):
    with pytest.raises(ValidationError) as err:
        validate_hyper_parameters(hp)
    assert message in err.value.message_dict["hyper_parameters"][0]


@pytest.mark.parametrize("head, problem", [
    (b"PK\x03\x04rest", "zip archive"),
    (b"\x1f\x8b\x08\x00", "gzip archive"),
    (b"\x7fELF\x02\x01", "compiled program"),
    (b"print('a')\x00\x00", "binary content"),
    (b"\xff\xfe\xfa", "not text"),
    (b"# -*- coding: no-such-codec -*-\n", "not text"),
])
def test_it_knows_a_main_file_that_is_no_python_source(head, problem):
    assert problem in main_file_problem(head)


@pytest.mark.parametrize("head", [
    b"print('hi')\n", "print('h\u00e9')\n".encode(), b"# -*- coding: latin-1 -*-\nx = '\xe9'\n",
    ("x = 1\n" * 700).encode()[:4095] + "\u00e9".encode()[:1],  # a character cut at the end
])
def test_it_accepts_python_source(head):
    assert main_file_problem(head[:4096]) is None


def test_a_fifo_under_the_main_files_name_is_refused_without_hanging(tmp_path):
    import os

    os.mkfifo(tmp_path / "main.py")
    with pytest.raises(ValidationError) as err:
        check_main_file(tmp_path, "main.py")
    assert "main_file" in err.value.message_dict
