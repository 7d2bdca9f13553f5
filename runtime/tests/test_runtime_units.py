"""Fast, in-process tests of the runtime's pure parts (no processes spawned)."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest
import torch

from runtime import FabricModel, events
from runtime.checkpoint import ResultWriter, atomic_write, load_latest
from runtime.fabric_model import effective_batch
from runtime.rendezvous import Rendezvous
from runtime.sampler import ElasticSampler, shard
from runtime.state import Position, dumps, loads, snapshot


def _model_and_opt():
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_it_covers_every_sample_once_per_epoch_at_any_size(world: int) -> None:
    sampler = ElasticSampler(num_samples=50, batch_size=4, global_batch=12, seed=3)
    seen = []
    for step in range(sampler.steps_per_epoch):
        for rank in range(world):
            for chunk in sampler.assignment(1, step, rank, world):
                seen.extend(chunk)
    assert sorted(seen) == list(range(50))


def test_it_keeps_the_micro_batches_independent_of_the_size() -> None:
    sampler = ElasticSampler(num_samples=40, batch_size=4, global_batch=16, seed=0)
    one = sampler.assignment(0, 1, 0, 1)
    three = [c for r in range(3) for c in sampler.assignment(0, 1, r, 3)]
    assert sorted(map(tuple, one)) == sorted(map(tuple, three))
    assert sampler.micro_batches(0, 1) != sampler.micro_batches(1, 1)  # reshuffled per epoch


def test_it_shards_evaluation_data_disjointly() -> None:
    parts = [list(shard(10, r, 4)) for r in range(4)]
    assert sum(parts, []) == list(range(10))


@pytest.mark.parametrize(
    ("engines", "effective", "expected"),
    [(None, None, (4, 32)), (2, None, (2, 16)), (None, 64, (8, 64)), (2, 64, (8, 64)),
     (16, 64, (16, 128)), (None, 20, (3, 20))],
)
def test_it_applies_the_effective_batch_rules(engines, effective, expected) -> None:
    assert effective_batch(8, engines, effective, default_engines=4) == expected


def test_it_takes_keras_models_without_importing_tensorflow() -> None:
    """A Keras model is told by its class's module (TensorFlow is imported only by its
    training processes); PyTorch-only options and a torch optimizer are refused by name."""
    fake_keras = type("Sequential", (), {"__module__": "keras.models"})()
    model, opt = _model_and_opt()
    fm = FabricModel(fake_keras, lambda: None, "categorical_crossentropy", "adam")
    assert fm.framework == "tensorflow" and fm.lr_schedulers == []
    with pytest.raises(TypeError, match="tf.keras.optimizers instance or a name"):
        FabricModel(fake_keras, lambda: None, "mse", opt)
    with pytest.raises(ValueError, match="clip_grad_norm exist only for PyTorch"):
        FabricModel(fake_keras, lambda: None, "mse", "adam", clip_grad_norm=1.0)
    with pytest.raises(TypeError, match=r"torch.nn.Module \(PyTorch\) or a tf.keras.Model"):
        FabricModel(object(), lambda: None, "mse", "adam")


def test_it_accepts_wmla_sample_keyword_names() -> None:
    model, opt = _model_and_opt()
    logger, cb = object(), object()
    fm = FabricModel(model, lambda: None, torch.nn.functional.mse_loss, opt,
                     driver_logger=logger, worker_logger=logger, user_callback=[cb],
                     enable_onnx=True, fn_step_train=print, fn_test=print,
                     scaleup_function=print)
    assert fm.driver_logger_callback is logger and fm.worker_logger_callback is logger
    assert fm.user_callbacks == [cb] and fm.save_to_onnx
    assert fm.fn_step_train is print and fm.fn_test is print


def test_it_round_trips_state_with_weights_only_loading() -> None:
    model, opt = _model_and_opt()
    blob = dumps(snapshot(model, opt, Position(epoch=2, step=3, global_step=9)))
    st = loads(blob)
    assert st["position"]["epoch"] == 2 and st["position"]["global_step"] == 9


def test_it_writes_checkpoints_atomically_and_ignores_corrupt_ones(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    writer = ResultWriter(str(tmp_path), str(tmp_path / "checkpoint"))
    blob = dumps(snapshot(model, opt, Position(epoch=1)))
    manifest = writer.save_checkpoint(blob)
    assert manifest["epoch"] == 1
    assert load_latest(str(tmp_path / "checkpoint")) == blob
    assert not [p for p in os.listdir(tmp_path / "checkpoint") if p.startswith(".tmp-")]
    assert (tmp_path / "model" / "train" / "model_epoch_1.pth").exists()
    atomic_write(str(tmp_path / "checkpoint" / "edt_state.pth"), b"garbage")
    assert load_latest(str(tmp_path / "checkpoint")) is None


def test_a_400_epoch_run_keeps_the_last_five_epochs_model_files_and_its_final_model(
        tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    writer = ResultWriter(str(tmp_path), str(tmp_path / "checkpoint"))
    for epoch in range(1, 401):
        writer.save_checkpoint(dumps(snapshot(model, opt, Position(epoch=epoch))))
    writer.save_final(dumps(snapshot(model, opt, Position(epoch=400))))
    kept = sorted(os.listdir(tmp_path / "model" / "train"))
    epochs = sorted({int(n.split("_")[2].removesuffix(".pth")) for n in kept
                     if n.split("_")[2].removesuffix(".pth").isdigit()})
    assert epochs == [396, 397, 398, 399, 400]  # KEEP_EPOCH_MODELS, model and optimizer each
    assert len(kept) == 2 * 5 + 2 and "model_epoch_final.pth" in kept
    # The resume checkpoints are bounded on their own (the latest and the two before).
    assert len([n for n in os.listdir(tmp_path / "checkpoint") if n.endswith(".pth")]) == 3


def test_the_best_epoch_by_a_test_metric_keeps_its_model_files_beside_the_last_ones(
        tmp_path: Path) -> None:
    from runtime.config import best_by

    model, opt = _model_and_opt()
    writer = ResultWriter(str(tmp_path), str(tmp_path / "checkpoint"), keep_epoch_models=2,
                          keep_best_by="accuracy")
    accuracy = {0: 0.5, 1: 0.9, 2: 0.7, 3: 0.6, 4: 0.8, 5: 0.85}
    news = []
    for epoch, value in accuracy.items():
        # As a worker reports: the test of epoch e, then the checkpoint tagged e + 1.
        news.append(writer.note_test(epoch, {"accuracy": value, "loss": 1 - value}))
        writer.save_checkpoint(dumps(snapshot(model, opt, Position(epoch=epoch + 1))))
    assert [b["epoch"] for b in news if b] == [0, 1]  # only a better figure is news
    kept = sorted({int(n.split("_")[2].removesuffix(".pth"))
                   for n in os.listdir(tmp_path / "model" / "train") if n.endswith(".pth")})
    assert kept == [2, 5, 6]  # the best (after epoch 1) and the last two
    # A restarted job reads the best back: a worse figure later does not displace it.
    again = ResultWriter(str(tmp_path), str(tmp_path / "checkpoint"), keep_epoch_models=2,
                         keep_best_by="accuracy:max")
    assert again.best()["value"] == 0.9 and again.note_test(6, {"accuracy": 0.89}) is None
    assert best_by("val_loss") == ("val_loss", "min") and best_by("f1") == ("f1", "max")
    assert best_by("loss:max") == ("loss", "max") and best_by(" ") is None


def test_keeping_every_epochs_model_files_is_a_setting(tmp_path: Path) -> None:
    model, opt = _model_and_opt()
    writer = ResultWriter(str(tmp_path), str(tmp_path / "checkpoint"), keep_epoch_models=0)
    for epoch in range(1, 9):
        writer.save_checkpoint(dumps(snapshot(model, opt, Position(epoch=epoch))))
    assert len(os.listdir(tmp_path / "model" / "train")) == 2 * 8


def test_it_writes_events_to_the_log_dir_and_redis(tmp_path: Path, monkeypatch) -> None:
    redis = pytest.importorskip("redis")
    client = redis.Redis.from_url("redis://127.0.0.1:6379/0")
    try:
        client.ping()
    except redis.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    stream = f"edt:test:{uuid.uuid4().hex}"
    monkeypatch.setenv("EDT_EVENTS_REDIS_URL", "redis://127.0.0.1:6379/0")
    monkeypatch.setenv("EDT_EVENTS_STREAM", stream)
    try:
        events.configure(source="worker:h1-gpu0", job_id="job-7", log_dir=str(tmp_path))
        events.emit("worker.left", worker_id="h1-gpu0", reason="reclaimed", generation=3)
        line = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
        assert line["type"] == "worker.left" and line["source"] == "worker:h1-gpu0"
        assert line["job_id"] == "job-7" and isinstance(line["ts"], float)
        (_, fields), = client.xrange(stream)
        assert json.loads(fields[b"data"]) == line
    finally:
        client.delete(stream)
        events.configure(source="standalone")


def test_it_never_lets_a_broken_redis_stop_training(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("EDT_EVENTS_REDIS_URL", "redis://127.0.0.1:1/0")
    events.configure(source="driver", job_id="j", log_dir=str(tmp_path))
    try:
        events.emit("log", stream="stdout", line="still here")
        assert "still here" in (tmp_path / "events.jsonl").read_text()
    finally:
        events.configure(source="standalone")


def _formed_pair(seen: list, late_after_s: float | None = None) -> tuple[Rendezvous, dict]:
    """A rendezvous (peer timeout 0.2 s) whose first generation is members a and b."""
    import threading

    rdzv = Rendezvous(grace_s=0, peer_timeout_s=0.2, late_after_s=late_after_s,
                      on_event=lambda t, **f: seen.append((t, f)))
    replies: dict = {}
    threads = [threading.Thread(target=lambda w=w: replies.update({w: rdzv.join(w, 5)}))
               for w in ("a", "b")]
    for t in threads:
        t.start()
    while len(replies) < 2:
        rdzv.tick()
    for t in threads:
        t.join()
    assert rdzv.members == ["a", "b"] and replies["a"]["world_size"] == 2
    return rdzv, replies


def test_it_drops_a_member_that_stops_heartbeating() -> None:
    import threading

    seen: list = []
    rdzv, replies = _formed_pair(seen)
    rdzv.heartbeat("a")
    sync = threading.Thread(target=lambda: replies.update(a=rdzv.sync("a", 1, 5, False, 5)))
    sync.start()
    while sync.is_alive():
        rdzv.heartbeat("a")
        rdzv.tick()
    assert replies["a"]["world_size"] == 1 and replies["a"]["generation"] == 2
    assert ("worker.left", {"worker_id": "b", "reason": "lost", "generation": 1}) in seen


def test_a_rescale_says_how_long_it_took_from_the_ask() -> None:
    import threading

    seen: list = []
    rdzv, replies = _formed_pair(seen)
    rdzv.request_leave("b")
    time.sleep(0.05)  # the members reach their boundary a while after the ask
    syncs = [threading.Thread(target=lambda w=w: replies.update({w: rdzv.sync(w, 1, 5, False,
                                                                                5)}))
             for w in ("a", "b")]
    for t in syncs:
        t.start()
    while any(t.is_alive() for t in syncs):
        rdzv.tick()
    changed = [f for t, f in seen if t == "generation.changed"][-1]
    assert (changed["previous_size"], changed["size"], changed["left"]) == (2, 1, ["b"])
    assert changed["duration_s"] >= 0.05


def test_a_lost_member_breaks_its_generation_in_what_the_links_are_told() -> None:
    seen: list = []
    rdzv, _ = _formed_pair(seen)
    generation, pending, stop, broken = rdzv.wait_view(None, 0)
    assert (generation, pending, stop, broken) == (1, False, False, False)
    rdzv.link_closed("b")
    generation, pending, _, broken = rdzv.wait_view(None, 0)
    # The survivors leave the collective they wait in; none waits on b any more.
    assert (generation, pending, broken) == (1, True, True)


def test_a_member_alive_but_missing_the_rendezvous_is_dropped_as_late_and_told_to_rejoin(
) -> None:
    import threading

    seen: list = []
    rdzv, replies = _formed_pair(seen)
    sync = threading.Thread(target=lambda: replies.update(a=rdzv.sync("a", 1, 5, True, 5)))
    sync.start()
    while sync.is_alive():
        # b's link stays up (it heartbeats) but b is stuck and never arrives.
        rdzv.heartbeat("a")
        rdzv.heartbeat("b")
        rdzv.tick()
    assert replies["a"]["world_size"] == 1 and replies["a"]["generation"] == 2
    assert ("worker.left", {"worker_id": "b", "reason": "late", "generation": 1}) in seen
    assert rdzv.sync("b", 1, 5, True, 1)["action"] == "rejoin"


def test_a_member_busy_past_the_peer_timeout_while_its_link_beats_is_waited_for() -> None:
    """A change lands while b is busy in its own code (a long callback, a checkpoint): b
    arrives five peer timeouts after a, and stays a member."""
    import threading

    seen: list = []
    rdzv, replies = _formed_pair(seen, late_after_s=30)
    # The change: c joins.
    joining = threading.Thread(target=lambda: replies.update(c=rdzv.join("c", 10)))
    joining.start()
    syncs = {w: threading.Thread(target=lambda w=w: replies.update(
        {w: rdzv.sync(w, 1, 5, False, 10)})) for w in ("a", "b")}
    syncs["a"].start()
    busy_until = time.monotonic() + 1.0  # 5 x the peer timeout
    while time.monotonic() < busy_until:
        rdzv.heartbeat("a")
        rdzv.heartbeat("b")
        rdzv.tick()
        assert rdzv.generation == 1 and "b" not in rdzv.lost
        time.sleep(0.01)
    syncs["b"].start()
    while any(t.is_alive() for t in (*syncs.values(), joining)):
        rdzv.heartbeat("a")
        rdzv.heartbeat("b")
        rdzv.tick()
    assert replies["a"]["generation"] == replies["b"]["generation"] == 2
    assert {replies[w]["world_size"] for w in "abc"} == {3}
    assert not [f for t, f in seen if t == "worker.left"]


def test_a_failed_arrival_breaks_the_generation_so_a_stuck_member_leaves_its_collective(
) -> None:
    seen: list = []
    rdzv, _ = _formed_pair(seen, late_after_s=30)
    assert rdzv.wait_view(None, 0)[3] is False
    import threading

    threading.Thread(target=lambda: rdzv.sync("a", 1, 5, True, 2), daemon=True).start()
    deadline = time.monotonic() + 5
    while "a" not in rdzv.arrived:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    generation, pending, _, broken = rdzv.wait_view(None, 0)
    assert (generation, pending, broken) == (1, True, True)


@pytest.mark.slow
def test_a_failed_group_init_leaves_the_process_able_to_form_the_next() -> None:
    """A member whose generation failed to form (a peer died meanwhile) must still form the
    next one with a joiner that never saw the failed one."""
    import datetime
    import subprocess
    import sys

    import torch.distributed as dist

    from .helpers import REPO

    script = str(Path(__file__).with_name("group_init_script.py"))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    args = ["127.0.0.1", str(store.port)]
    survivor = subprocess.Popen([sys.executable, script, "fail_first", *args, "0"], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    store.wait(["failed-once"], datetime.timedelta(seconds=60))
    joiner = subprocess.Popen([sys.executable, script, "fresh", *args, "1"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=90) for p in (survivor, joiner)]
    for p, (out, err) in zip((survivor, joiner), outs, strict=True):
        assert p.returncode == 0, err
        assert out.strip() == "3"


@pytest.mark.slow
def test_forming_a_group_gives_up_on_a_dead_member_but_collectives_wait() -> None:
    """A member killed once its address is in the store never connects. The others give up
    on it after a few times the connect timeout, not after the collectives' hour; and a group
    they then form still waits for a peer slower than the connect timeout."""
    import datetime
    import re
    import subprocess
    import sys

    import torch.distributed as dist

    from .helpers import REPO

    script = str(Path(__file__).with_name("dead_peer_script.py"))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    args = ["127.0.0.1", str(store.port)]
    keys = store.num_keys()
    dead = subprocess.Popen([sys.executable, script, "publish", *args, "2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while store.num_keys() == keys:  # its address, then it waits for the others'
            assert dead.poll() is None, dead.communicate()
            assert time.monotonic() < deadline, "rank 2 never published its address"
            time.sleep(0.01)
    finally:
        dead.kill()
        dead.communicate()
    procs = [subprocess.Popen([sys.executable, script, "form", *args, str(r)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        took = re.search(r"gave up after ([0-9.]+)s", out)
        assert took and float(took.group(1)) < 30, out
        assert out.strip().endswith("sum 3"), out


def test_the_store_lets_go_of_waits_for_a_generation_that_will_not_form() -> None:
    """Once the driver gives a generation up (it lost a member), a wait for one of its keys
    (the address of the member that died) ends at once with the reason; waits for another
    generation's keys go on."""
    import threading

    from runtime.store import KeyValue, generation_prefix

    kv = KeyValue()
    replies: dict[int, dict] = {}

    def wait_for(generation: int) -> None:
        key = generation_prefix(generation) + "rank_2"
        replies[generation] = kv.handle({"call": "get", "key": key, "timeout": 60}, None)[0]

    waiters = [threading.Thread(target=wait_for, args=(g,)) for g in (3, 4)]
    for t in waiters:
        t.start()
    kv.give_up(3)
    waiters[0].join(10)
    assert not waiters[0].is_alive(), "the wait for generation 3 went on"
    assert replies[3] == {"ok": False, "error": replies[3]["error"]}
    assert "lost a member and will not form" in replies[3]["error"]
    assert waiters[1].is_alive()
    kv.handle({"call": "set", "key": generation_prefix(4) + "rank_2"}, b"addr")
    waiters[1].join(10)
    assert replies[4] == {"ok": True}


@pytest.mark.parametrize("when", ["before", "while"])
@pytest.mark.slow
def test_a_broadcast_from_a_silent_rank_0_fails_when_its_group_is_aborted(when: str) -> None:
    """A rank waiting for a broadcast from a rank 0 that never sends is released as soon as
    its group is aborted (as the driver's word does when a member is lost), whether the abort
    comes before it posts the receive or while it waits; and the group is thrown away at
    once, not after the collective's timeout."""
    import datetime
    import re
    import subprocess
    import sys

    import torch.distributed as dist

    from .helpers import REPO

    script = str(Path(__file__).with_name("aborted_group_script.py"))
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, script, "127.0.0.1", str(store.port), str(r),
                               when],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for r in (0, 1)]
    outs = [p.communicate(timeout=90) for p in procs]
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
    said = outs[1][0]
    took = re.search(r"failed after ([0-9.]+)s", said)
    assert took and float(took.group(1)) < 5, said  # the collective's timeout is 120 s
    assert said.strip().endswith("destroyed"), said


def test_the_drivers_store_serves_torchs_store_calls_only_to_holders_of_the_secret() -> None:
    import datetime
    import socket
    import threading

    import torch.distributed as dist

    from runtime import wire
    from runtime.store import KeyValue, LinkStore

    kv = KeyValue()
    listener = socket.create_server(("127.0.0.1", 0))

    def serve(sock: socket.socket) -> None:
        with sock:
            try:
                wire.accept(sock, "job-secret", timeout=5)
                while True:
                    header, payload = wire.recv_msg(sock)
                    wire.send_msg(sock, *kv.handle(header, payload))
            except (OSError, ValueError):
                return

    def accept_forever() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(sock,), daemon=True).start()

    threading.Thread(target=accept_forever, daemon=True).start()
    addr = f"127.0.0.1:{listener.getsockname()[1]}"
    try:
        store = LinkStore(addr, "job-secret", timeout_s=2)
        store.set("rank_0", b"addr0")
        assert store.get("rank_0") == b"addr0"
        assert store.add("count", 2) == 2 and store.add("count", 3) == 5
        assert store.get("count") == b"5"
        # compare_set as TCPStore does it: set when absent and nothing expected, else the
        # value now held.
        assert store.compare_set("cas", b"", b"one") == b"one"
        assert store.compare_set("cas", b"two", b"three") == b"one"
        assert store.compare_set("cas", b"one", b"three") == b"three"
        assert store.check(["rank_0", "cas"]) and not store.check(["rank_1"])
        # A waiter is woken by a set from another connection.
        later = threading.Timer(0.2, lambda: LinkStore(addr, "job-secret", 2).set("rank_1", b"x"))
        later.start()
        store.wait(["rank_1"], datetime.timedelta(seconds=5))
        with pytest.raises(dist.DistStoreError, match="not set within"):
            store.get("never")
        assert store.delete_key("rank_0") and store.num_keys() == 3
        # Without the job's secret, nothing: no key read, none written.
        with pytest.raises(dist.DistStoreError, match="refused this job secret"):
            LinkStore(addr, "a-guess", timeout_s=2).set("rank_1", b"attacker")
        assert store.get("rank_1") == b"x"
    finally:
        listener.close()
