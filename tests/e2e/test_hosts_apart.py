"""Two hosts that are really apart (each host agent in a network namespace of its own, see
``tests.e2e.netns``): one job trains across both, every connection between them crossing a
real interface, then one host's link is cut mid-step and the job goes on on the other."""

from __future__ import annotations

import time

import pytest

from jobs import states
from jobs.models import JobEvent, SlotAllocation, TrainingJob
from jobs.services import job_submit
from tests.e2e import netns
from tests.e2e.harness import (
    assert_each_sample_once_per_epoch,
    database_url,
    steps,
    wait_until,
)

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

SAMPLES, EPOCHS = 2048, 2
PEER_TIMEOUT_S = 6.0  # the harness's EDT_PEER_TIMEOUT_S


@pytest.fixture
def network(settings, e2e):
    why = netns.available()
    if why:
        pytest.skip(why)
    net = netns.Network()
    forwarders: list[netns.Forwarder] = []
    try:
        net.add_host(1)
        net.add_host(2)
        # The control plane, reached from the hosts through the bridge's address.
        env = {}
        redis = netns.Forwarder(net.gateway, netns.target_of(settings.REDIS_URL, 6379))
        forwarders.append(redis)
        env["REDIS_URL"] = netns.through(settings.REDIS_URL, redis, net.gateway)
        if database_url().startswith("postgres"):
            db = netns.Forwarder(net.gateway, netns.target_of(database_url(), 5432))
            forwarders.append(db)
            env["DATABASE_URL"] = netns.through(database_url(), db, net.gateway)
        yield net, env
    finally:
        e2e.stop_all()  # the hosts first, while their connections can still end cleanly
        for forwarder in forwarders:
            forwarder.close()
        net.remove()


def trained_at(job, size: int, since: float) -> float | None:
    """When the job first trained a step at ``size`` workers after ``since`` (its step log:
    steps really taken, not a generation only announced)."""
    return next((s["ts_start"] for s in steps(job)
                 if s["size"] == size and s["ts_start"] >= since), None)


def test_a_job_on_hosts_apart_goes_on_when_one_hosts_link_is_cut(e2e, e2e_records, network):
    net, env = network
    hosts = {n: e2e.start_agent(n, address=net.address(n), inside=net.inside(n), env=env)
             for n in (1, 2)}
    e2e.start_scheduler()
    e2e.wait_ready(90)
    fast = e2e.tmp / "apart.fast"
    job = job_submit(
        user=e2e_records["owner"], model=e2e_records["model"],
        instance_group=e2e_records["instance_group"], max_workers=8, name="apart",
        env_vars={"TEST_EPOCHS": str(EPOCHS), "TEST_SAMPLES": str(SAMPLES), "TEST_BATCH": "4",
                  "TEST_ENGINES": "8", "TEST_DELAY_S": "0.05", "TEST_FAST_FILE": str(fast),
                  "EDT_STEP_LOG": str(e2e.tmp / "apart.steps.jsonl")},
    )
    wait_until(lambda: trained_at(job, 8, 0), "8 workers training across both hosts", 150,
               every=0.2, on_fail=e2e.dump_logs)
    driver_host = JobEvent.objects.get(job=job, type="driver.started").data["host"]
    (keep,) = [n for n, name in hosts.items() if name == driver_host]
    cut = 3 - keep
    # The driver listens on its host's own address, which the other host's workers reached.
    job.refresh_from_db()
    assert job.driver_address.startswith(f"{net.address(keep)}:"), job.driver_address

    cut_at = time.time()
    net.cut(cut)
    went_on = wait_until(lambda: trained_at(job, 4, cut_at),
                         "the job to train on with the 4 slots left", PEER_TIMEOUT_S + 30,
                         every=0.2, on_fail=e2e.dump_logs)
    # The survivors noticed the lost members within the peer timeout, not a collective's.
    assert went_on - cut_at < PEER_TIMEOUT_S + 5, went_on - cut_at

    fast.touch()
    wait_until(lambda: TrainingJob.objects.get(pk=job.pk).is_terminal, "the job to end", 150,
               on_fail=e2e.dump_logs)
    job.refresh_from_db()
    assert job.state == states.FINISHED, (job.error, e2e.dump_logs())
    assert job.attempt == 1  # the driver was never restarted
    assert_each_sample_once_per_epoch(job, SAMPLES, EPOCHS)
    lost = SlotAllocation.objects.filter(job=job, host__name=hosts[cut])
    wait_until(lambda: not lost.filter(released_at=None).exists(),
               "the cut host's slots to be released", 60, on_fail=e2e.dump_logs)
    # Cut off, its agent cannot shut down cleanly (its database calls hang): end it now rather
    # than wait out the harness's grace at teardown.
    e2e.kill(hosts[cut])
