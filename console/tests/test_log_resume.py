"""The job history's log offset: a page that reconnects asks for the lines after the last one it
shows (``?log_after=<id>``), a bounded page at a time, and gets exactly those, in order."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.urls import reverse

from console import views
from events.ingest import ingest_many
from events.logs import read_log_after

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_channels")]


def log_lines(job, count: int, *, first: int = 1) -> list[str]:
    """Ingest ``count`` numbered log lines under stream ids ``<1000 + n>-<n % 3>``, as
    ``run_events`` would; returns their ids."""
    items = [
        (f"{1000 + n}-{n % 3}", {"type": "log", "job_id": job.pk, "source": "driver",
                                 "ts": 1e9 + n, "stream": "stdout", "line": f"line {n}"})
        for n in range(first, first + count)
    ]
    assert ingest_many(items) == count
    return [stream_id for stream_id, _ in items]


def history(client, job, **params) -> dict:
    response = client.get(reverse("job-history", args=[job.pk]), params)
    assert response.status_code == 200, response.content[:300]
    return response.json()


def test_after_an_id_it_returns_exactly_the_later_lines_in_order(client, owner, job):
    ids = log_lines(job, 10)
    client.force_login(owner)
    data = history(client, job, log_after=ids[3])
    assert [r["line"] for r in data["log"]] == [f"line {n}" for n in range(5, 11)]
    assert [r["id"] for r in data["log"]] == ids[4:]
    assert data["log_more"] is False
    # The rest of the history comes with the first page, as on a first load.
    assert {"job", "chart", "metrics", "events"} <= set(data)


def test_an_offset_between_ids_or_before_all_of_them_resumes_at_the_next_line(
    client, owner, job
):
    ids = log_lines(job, 5)
    client.force_login(owner)
    assert [r["id"] for r in history(client, job, log_after="1002")["log"]] == ids[1:]
    assert [r["id"] for r in history(client, job, log_after="0")["log"]] == ids
    assert history(client, job, log_after=ids[-1])["log"] == []


def test_a_long_gap_comes_in_pages_that_say_when_more_follow(client, owner, job):
    ids = log_lines(job, 2 * views.LOG_PAGE + 7)
    client.force_login(owner)
    first = history(client, job, log_after="0")
    assert (len(first["log"]), first["log_more"]) == (views.LOG_PAGE, True)
    got = [r["id"] for r in first["log"]]
    pages = 1
    more = True
    while more:
        page = history(client, job, log_after=got[-1], only="log")
        assert set(page) == {"log", "log_more"}  # the charts are not sent again for each page
        got += [r["id"] for r in page["log"]]
        more = page["log_more"]
        pages += 1
    assert got == ids
    assert pages == 3


def test_without_an_offset_it_is_the_tail_as_before(client, owner, job):
    ids = log_lines(job, views.LOG_PAGE + 3)
    client.force_login(owner)
    data = history(client, job)
    assert [r["id"] for r in data["log"]] == ids[-views.LOG_PAGE:]
    assert data["log_more"] is False


@pytest.mark.parametrize("value", ["", "abc", "12-", "-1", "1-2-3", "1.5", "9" * 21])
def test_a_bad_offset_is_a_400_naming_the_parameter(client, owner, job, value):
    client.force_login(owner)
    response = client.get(reverse("job-history", args=[job.pk]), {"log_after": value})
    assert response.status_code == 400
    assert response.json()["parameter"] == "log_after"
    assert "log_after" in response.json()["error"]


def test_an_unknown_part_is_a_400_naming_the_parameter(client, owner, job):
    client.force_login(owner)
    response = client.get(reverse("job-history", args=[job.pk]), {"only": "metrics"})
    assert response.status_code == 400
    assert response.json()["parameter"] == "only"


def test_another_users_job_is_a_404_with_an_offset_too(client, other, job):
    log_lines(job, 3)
    client.force_login(other)
    for params in ({"log_after": "0"}, {"log_after": "0", "only": "log"}, {"log_after": "x"}):
        response = client.get(reverse("job-history", args=[job.pk]), params)
        assert response.status_code == 404, params


def test_a_job_without_a_log_resumes_to_nothing(client, owner, job):
    client.force_login(owner)
    assert history(client, job, log_after="0", only="log") == {"log": [], "log_more": False}


# --- the search itself, on a file written by hand ---------------------------------------------


def write_log(path: Path, records: list[dict | str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))


def test_the_search_agrees_with_a_full_scan_for_every_offset(tmp_path):
    """Lines without an id (ingested outside the stream), blank and broken lines are mixed in:
    none of them may throw the binary search off, and none is returned."""
    path = tmp_path / "log" / "console.jsonl"
    records: list[dict | str] = []
    for n in range(1, 60):
        records.append({"id": f"{100 + n // 4}-{n % 4}", "line": f"line {n}" + "x" * (n * 7 % 50)})
        if n % 5 == 0:
            records.append({"id": "", "line": "no id"})
        if n % 17 == 0:
            records.append("not json")
    write_log(path, records)
    with_ids = [r for r in records if isinstance(r, dict) and r["id"]]
    for after in [(0, 0), *[views._log_id(r["id"]) for r in with_ids], (999, 0)]:
        want = [r for r in with_ids if views._log_id(r["id"]) > after]
        for limit in (1, 7, 100):
            got, more = read_log_after(str(tmp_path), after, limit)
            assert got == want[:limit], (after, limit)
            assert more is (len(want) > limit), (after, limit)


def test_a_line_still_being_written_is_left_for_the_next_page(tmp_path):
    path = tmp_path / "log" / "console.jsonl"
    write_log(path, [{"id": "1-0", "line": "a"}, {"id": "2-0", "line": "b"}])
    with path.open("a") as fh:
        fh.write('{"id": "3-0", "li')  # ingest is halfway through this line
    got, more = read_log_after(str(tmp_path), (1, 0), 10)
    assert ([r["line"] for r in got], more) == (["b"], False)
    with path.open("a") as fh:
        fh.write('ne": "c"}\n')
    got, _ = read_log_after(str(tmp_path), (2, 0), 10)
    assert [r["line"] for r in got] == ["c"]
