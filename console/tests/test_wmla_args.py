"""The WMLA ``args`` string: dlicmd's submit flags taken, the rest left for the user's script."""

import pytest

from console.wmla.args import ArgsError, parse_args_string

NOTEBOOK_ARGS = (
    "--exec-start edtPyTorch         --cs-datastore-meta type=fs,data_path=pytorch-mnist"
    "         --model-dir resnet-wmla         --edt-options maxWorkers=2"
    "         --model-main elastic-main.py         "
)


def test_it_reads_the_edt_notebooks_args_string():
    parsed = parse_args_string(NOTEBOOK_ARGS)
    assert parsed.framework == "edtPyTorch"
    assert parsed.model_main == "elastic-main.py"
    assert parsed.model_dir == "resnet-wmla"
    assert parsed.max_workers == 2
    assert parsed.data_path == "pytorch-mnist"
    assert parsed.user_args == []


def test_it_takes_the_submit_flags():
    parsed = parse_args_string(
        "--exec-start edtPyTorch --model-main main.py --numWorker 4 --workerDeviceNum 2 "
        "--workerDeviceType cpu --msd-env EDT_PULL_FAILED_LIMITS=3 --msd-env A=x=y "
        "--msd-priority 7000 --appName cifar --ig sig-elastic"
    )
    assert (parsed.max_workers, parsed.devices_per_worker, parsed.worker_device_type) == (
        4, 2, "cpu"
    )
    assert parsed.env_vars == {"EDT_PULL_FAILED_LIMITS": "3", "A": "x=y"}
    assert (parsed.priority, parsed.app_name, parsed.instance_group) == (
        7000, "cifar", "sig-elastic"
    )


def test_edt_options_max_workers_wins_over_num_worker():
    parsed = parse_args_string(
        "--exec-start edtPyTorch --model-main m.py --numWorker 2 --edt-options maxWorkers=6"
    )
    assert parsed.max_workers == 6


def test_unknown_flags_and_everything_after_a_double_dash_go_to_the_script_in_order():
    parsed = parse_args_string(
        "--exec-start edtPyTorch --lr 0.1 --model-main m.py --epochs=3 -- --numWorker 9 'a b'"
    )
    assert parsed.user_args == ["--lr", "0.1", "--epochs=3", "--numWorker", "9", "a b"]
    assert parsed.user_args_string == "--lr 0.1 --epochs=3 --numWorker 9 'a b'"
    assert parsed.max_workers == 1


def test_wmla_only_deployment_flags_are_accepted_and_not_passed_to_the_script():
    parsed = parse_args_string(
        "--exec-start edtPyTorch --model-main m.py --workerMemory 8g --msd-image-name x "
        "--conda-env-name py3"
    )
    assert parsed.user_args == []


@pytest.mark.parametrize(
    "args, message",
    [
        ("", "args is empty"),
        ("   ", "args is empty"),
        ("--model-main m.py", "--exec-start <framework> is required"),
        ("--exec-start tensorflow --model-main m.py", "'tensorflow' is not a framework here"),
        ("--exec-start PyTorch --model-main m.py", "supported: edtPyTorch"),
        ("--exec-start edtPyTorch", "--model-main <file> is required"),
        ("--exec-start edtPyTorch --model-main", "argument --model-main: expected one argument"),
        ("--exec-start edtPyTorch --model-main m.py --numWorker two", "must be an integer"),
        ("--exec-start edtPyTorch --model-main m.py --numWorker 0", "at least 1"),
        ("--exec-start edtPyTorch --model-main m.py --workerDeviceNum -1", "at least 1"),
        ("--exec-start edtPyTorch --model-main m.py --edt-options maxWorkers=x", "must be an"),
        ("--exec-start edtPyTorch --model-main m.py --edt-options minWorkers=1", "unknown option"),
        ("--exec-start edtPyTorch --model-main m.py --edt-options maxWorkers", "name=value"),
        ("--exec-start edtPyTorch --model-main m.py --workerDeviceType tpu", "invalid choice"),
        ("--exec-start edtPyTorch --model-main m.py --msd-env NOVALUE", "NAME=value"),
        ("--exec-start edtPyTorch --model-main m.py --msd-priority high", "invalid int value"),
        ("--exec-start edtPyTorch --model-main m.py --cs-datastore-meta type=s3", "not supported"),
        ("--exec-start edtPyTorch --model-main 'unclosed", "cannot be split into words"),
    ],
)
def test_bad_args_strings_raise_an_error_naming_the_flag(args, message):
    with pytest.raises(ArgsError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args_string(args)
