import pytest

from resources.models import GPU, Host, ResourceGroup

pytestmark = pytest.mark.django_db


def test_ngpus_counts_gpus_and_falls_back_to_cpu_slots(cluster):
    rg = cluster["resource_group"]
    gpu_host = Host.objects.create(name="gpu-host", cpu_slots=2)
    for i in range(8):
        GPU.objects.create(host=gpu_host, index=i, uuid=f"GPU-{i}", model="H100")
    assert rg.slots_by_host() == {
        cluster["hosts"][0].id: 4,
        cluster["hosts"][1].id: 4,
        gpu_host.id: 8,
    }


def test_static_slots_and_static_selection(cluster):
    rg = ResourceGroup.objects.create(
        name="static",
        slots_mode=ResourceGroup.SlotsMode.STATIC,
        static_slots=2,
        selection=ResourceGroup.Selection.STATIC,
    )
    rg.hosts.add(cluster["hosts"][0])
    assert rg.slot_formula == "2"
    assert rg.slots_by_host() == {cluster["hosts"][0].id: 2}


def test_unavailable_hosts_offer_no_slots(cluster):
    host = cluster["hosts"][1]
    host.state = Host.State.UNAVAILABLE
    host.save()
    assert cluster["resource_group"].slots_by_host() == {cluster["hosts"][0].id: 4}


def test_slots_are_counted_in_one_query_however_many_hosts(cluster, django_assert_num_queries):
    for n in range(20):
        host = Host.objects.create(name=f"gpu-{n}", cpu_slots=2)
        GPU.objects.create(host=host, index=0, uuid=f"GPU-one-{n}")
    with django_assert_num_queries(1):
        slots = cluster["resource_group"].slots_by_host()
    assert len(slots) == 22 and sorted(set(slots.values())) == [1, 4]
