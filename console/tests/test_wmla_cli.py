"""The dlicmd client's own logic (the live-server flows are in tests/wmla/)."""

import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from console.cli import dlicmd


def test_it_runs_without_django_installed():
    # Block the import of Django, as on a laptop that only has requests.
    code = (
        "import sys; sys.modules['django'] = None; sys.modules['rest_framework'] = None; "
        "from console.cli import dlicmd; sys.exit(dlicmd.main(['--help']))"
    )
    done = subprocess.run(  # noqa: S603
        [sys.executable, "-c", code], cwd=settings.BASE_DIR, capture_output=True, text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "--exec-start edtPyTorch" in done.stdout


def test_the_submitted_args_drop_connection_options_and_shorten_the_model_dir():
    argv = [
        "--exec-start", "edtPyTorch", "--rest-host", "wmla.example.com", "--rest-port", "443",
        "--model-dir", "/home/me/models/resnet/", "--model-main", "main.py", "--jwt-token", "t",
        "--insecure", "-o", "json", "--cs-datastore-meta", "type=fs,data_path=cifar",
        "--", "--lr", "0.1", "two words",
    ]
    assert dlicmd.submitted_args(argv) == (
        "--exec-start edtPyTorch --model-dir resnet --model-main main.py "
        "--cs-datastore-meta type=fs,data_path=cifar -- --lr 0.1 'two words'"
    )


def test_it_reads_the_bare_token_file_wmla_dlicmd_writes(tmp_path, monkeypatch):
    monkeypatch.setenv("DLICMD_TOKEN_FILE", str(tmp_path / "tok"))
    (tmp_path / "tok").write_text("abc.def.ghi")
    assert dlicmd.load_session() == {"token": "abc.def.ghi"}
    dlicmd.save_session({"token": "x", "base_url": "http://h:1"})
    assert dlicmd.load_session()["base_url"] == "http://h:1"
    assert (tmp_path / "tok").stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--exec-get"], "expected one argument"),
        (["--exec-get-all"], "--rest-host is required"),
        (["--exec-priority", "1"], "expected 2 arguments"),
        (["--logon"], "--rest-host is required for --logon"),
    ],
)
def test_usage_errors_exit_1_with_a_message(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("DLICMD_TOKEN_FILE", str(tmp_path / "none"))
    assert dlicmd.main(argv) == 1
    assert message in capsys.readouterr().err


def test_an_unknown_command_prints_the_help(capsys):
    assert dlicmd.main(["--frobnicate"]) == 1
    assert "Usage:" in capsys.readouterr().out


def test_the_server_offers_the_cli_for_download(client):
    response = client.get("/ui/tools/dlicmd.py")
    assert response.status_code == 200
    body = b"".join(response.streaming_content) if response.streaming else response.content
    assert body == (Path(settings.BASE_DIR) / "console" / "cli" / "dlicmd.py").read_bytes()


def test_the_watch_line_shows_slots_and_progress():
    line = dlicmd.watch_line(
        {
            "id": "alice-7", "state": "RUNNING", "workers": 3, "maxWorkers": 8,
            "targetWorkers": 4, "priority": 5000, "progress": {"epoch": 1, "epochs": 4,
                                                               "iteration": 120},
            "lastMetrics": {"loss": 0.123456}, "slots": [
                {"host": "h1", "slot": 0}, {"host": "h1", "slot": 1}, {"host": "h2", "slot": 0}],
        }
    )
    assert "workers 3/8 (target 4)" in line and "priority 5000" in line
    assert "[#####---------------] epoch 1/4" in line and "iter 120" in line
    assert "loss 0.1235" in line and "slots h1:0,h1:1,h2:0" in line
