"""Reading a main file's imports (``environments.imports``): what counts as required, what the
model's own folder provides, how requirements are matched, and how the folder is read."""

from __future__ import annotations

import os
import textwrap
import threading

import pytest

from environments.imports import (
    FileTooLarge,
    imported_modules,
    local_modules,
    missing_imports,
    read_model_file,
    read_requirements_txt,
)


def _src(text: str) -> str:
    return textwrap.dedent(text)


def test_the_standard_library_future_and_relative_imports_are_left_out():
    found = imported_modules(_src("""
        from __future__ import annotations
        import os, sys, json.decoder
        import torch.nn as nn
        from torchvision.models import resnet18
        from . import sibling
        from .helpers import x
        from .. import parent
        import timm
    """))
    assert found == {"torch", "torchvision", "timm"}


@pytest.mark.parametrize("handler", [
    "except ImportError:", "except ModuleNotFoundError:", "except (ValueError, ImportError):",
    "except Exception:", "except:", "except builtins.ImportError as exc:",
])
def test_an_import_in_a_try_that_catches_its_failure_is_optional(handler):
    source = _src(f"""
        try:
            import ujson as json
            from apex import amp
        {handler}
            import fallback_module
        """)
    # The fallback in the handler is required: it runs when the first one fails.
    assert imported_modules(source) == {"fallback_module"}


def test_an_import_in_a_try_that_catches_something_else_is_required():
    source = _src("""
        try:
            import timm
        except ValueError:
            pass
        else:
            import wandb
        finally:
            import tqdm
    """)
    assert imported_modules(source) == {"timm", "wandb", "tqdm"}


def test_nested_blocks_functions_and_type_checking():
    source = _src("""
        from typing import TYPE_CHECKING
        import typing
        if TYPE_CHECKING:
            import mypy_only
        if typing.TYPE_CHECKING:
            import also_typing_only
        else:
            import runtime_one
        def train():
            import inside_a_function
            try:
                for _ in range(3):
                    with open("x"):
                        import deep_optional
            except ImportError:
                pass
        class Net:
            import in_a_class
    """)
    assert imported_modules(source) == {"runtime_one", "inside_a_function", "in_a_class"}


def test_a_syntax_error_says_its_line():
    with pytest.raises(SyntaxError) as caught:
        imported_modules("import torch\n\ndef broken(:\n    pass\n")
    assert caught.value.lineno == 3


def test_bytes_with_an_encoding_declaration_are_read():
    source = "# -*- coding: latin-1 -*-\nimport caf\xe9_lib\n".encode("latin-1")
    assert imported_modules(source) == {"café_lib"}


def test_a_deeply_nested_file_does_not_exhaust_the_recursion_limit():
    body = "".join("    " * i + "if x:\n" for i in range(90)) + "    " * 90 + "import deep\n"
    assert imported_modules(body) == {"deep"}


def test_local_modules_are_its_files_and_packages(tmp_path):
    (tmp_path / "helpers.py").write_text("")
    (tmp_path / "compiled.pyc").write_text("")
    (tmp_path / "fast.cpython-311-x86_64-linux-gnu.so").write_text("")
    (tmp_path / "plain.so").write_text("")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "namespace").mkdir()
    (tmp_path / "not-a-name").mkdir()
    (tmp_path / "data.csv").write_text("")
    (tmp_path / "README").write_text("")
    assert local_modules(tmp_path) == {"helpers", "compiled", "fast", "plain", "pkg",
                                       "namespace"}


def test_local_modules_of_a_missing_or_linked_folder_are_none(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "helpers.py").write_text("")
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert local_modules(tmp_path / "link") == set()
    assert local_modules(tmp_path / "absent") == set()
    assert local_modules(tmp_path, "link") == set()
    assert local_modules(tmp_path, "real") == {"helpers"}


MAIN = _src("""
    import os
    import torch
    import timm_missing_xyz
    import helpers
    from pkg.sub import thing
    from . import relative_thing
""")


def _folder(tmp_path):
    (tmp_path / "helpers.py").write_text("X = 1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    return tmp_path


def test_missing_imports_are_those_neither_provided_nor_local(tmp_path):
    assert missing_imports(MAIN, _folder(tmp_path), {"torch"}, []) == ["timm_missing_xyz"]
    assert missing_imports(MAIN, tmp_path, {"torch", "timm_missing_xyz"}, []) == []


def test_a_requirement_of_the_same_normalised_name_provides_it(tmp_path):
    reqs = ["Timm-Missing.XYZ[extra]>=1.0 ; python_version > '3'"]
    assert missing_imports(MAIN, _folder(tmp_path), {"torch"}, reqs) == []
    # Requirements that all match imports by name do not hide the others.
    source = MAIN + "import wandb\n"
    assert missing_imports(source, tmp_path, {"torch"}, ["wandb==0.17"]) == ["timm_missing_xyz"]


def test_a_requirement_matching_no_import_by_name_leaves_the_rest_unknown(tmp_path):
    """scikit-learn provides sklearn: a requirement that no import is named after may be what
    provides any import left over, so those are not reported."""
    source = "import sklearn\nimport torch\n"
    assert missing_imports(source, tmp_path, {"torch"}, []) == ["sklearn"]
    assert missing_imports(source, tmp_path, {"torch"}, ["scikit-learn==1.9"]) == []


def test_the_main_files_own_folder_counts_as_local(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "model_parts.py").write_text("")
    (tmp_path / "common.py").write_text("")
    source = "import model_parts\nimport common\nimport absent_one\n"
    found = missing_imports(source, tmp_path, set(), [], main_file="src/train.py")
    assert found == ["absent_one"]
    assert missing_imports(source, tmp_path, set(), [], main_file="train.py") == [
        "absent_one", "model_parts"]


def test_reading_is_capped_and_follows_no_link(tmp_path):
    (tmp_path / "main.py").write_text("import torch\n")
    assert read_model_file(tmp_path, "main.py", 100) == b"import torch\n"
    with pytest.raises(FileTooLarge):
        read_model_file(tmp_path, "main.py", 5)
    (tmp_path / "sub").mkdir()
    os.symlink(tmp_path / "main.py", tmp_path / "sub" / "linked.py")
    os.symlink(tmp_path / "sub", tmp_path / "dirlink")
    for name in ("sub/linked.py", "dirlink/main.py", "../main.py", "/etc/passwd", "sub"):
        with pytest.raises(OSError):
            read_model_file(tmp_path, name, 100)


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    os.mkfifo(tmp_path / "main.py")
    done: list[BaseException] = []

    def read() -> None:
        try:
            read_model_file(tmp_path, "main.py", 100)
        except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
            done.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(5)
    assert done and isinstance(done[0], OSError), "a FIFO must be refused at once"


def test_requirements_txt_is_optional(tmp_path):
    assert read_requirements_txt(tmp_path) == ""
    (tmp_path / "requirements.txt").write_text("timm==1.0.9\n")
    assert read_requirements_txt(tmp_path) == "timm==1.0.9\n"
