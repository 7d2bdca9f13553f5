"""The README's "Coming from WMLA" tables say what is served: every WMLA route the console serves
is in the endpoint table and every row marked served resolves to one, taking the method it
names; every flag our ``dlicmd`` or the ``args`` string parses is in the flag table, and a flag
marked not served is parsed by neither."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

from django.urls import Resolver404, resolve

from console.cli.dlicmd import build_parser
from console.wmla import urls as wmla_urls
from console.wmla.args import _PARSER as ARGS_PARSER

README = Path(__file__).resolve().parents[2] / "README.md"
# What a row's placeholders stand for, as the README's text says.
EXAMPLES = {"{id}": "alice-42", "{appId}": "edt-42", "{sigId}": "sig-elastic",
            "{driverId}": "driver-1", "{executorId}": "host1-slot0", "{n}": "1",
            "{name}": "alice-hpo-1054030076043153"}
PREFIX = re.compile(r"^\*\*`(/[^`]+)`\*\*$")
ENDPOINT = re.compile(r"^`(?:(GET|POST|PUT|DELETE) )?(/[^`?]*)")
FLAG = re.compile(r"`(--?[A-Za-z][\w-]*\*?)`")


def _table(heading: str) -> list[list[str]]:
    """The rows (cells split on unescaped pipes) of the first table under ``heading``."""
    text = README.read_text()
    start = text.index(f"\n{heading}\n")
    end = text.find("\n#", start + len(heading) + 2)
    lines = [line for line in text[start:end if end > 0 else None].splitlines()
             if line.startswith("|")]
    rows = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in lines]
    return rows[2:]  # past the header and its --- line


def _served(cell: str) -> bool:
    assert cell in {"yes", "yes, ours", "accepted, ignored", "no"}, f"served is {cell!r}"
    return cell != "no"


def _endpoints() -> list[tuple[str | None, str, bool]]:
    """(method, full path, served) for every row of the endpoint table."""
    out, prefix = [], ""
    for cells in _table("### Every WMLA endpoint"):
        head = PREFIX.match(cells[0])
        if head:
            prefix = head.group(1)
            continue
        found = ENDPOINT.match(cells[0])
        assert found and cells[3], f"a row needs a path and what a user changes: {cells}"
        out.append((found.group(1), prefix + found.group(2), _served(cells[1])))
    return out


def _concrete(path: str) -> list[str]:
    """Each path a row stands for: placeholders filled in, ``a\\|b`` segments expanded."""
    for name, value in EXAMPLES.items():
        path = path.replace(name, value)
    return ["/".join(parts) for parts in
            itertools.product(*(seg.split("\\|") for seg in path.split("/")))]


def _wmla_route(path: str):
    try:
        match = resolve(path)
    except Resolver404:
        return None
    return match if (match.url_name or "").startswith("wmla-") else None


def test_every_served_wmla_route_is_in_the_endpoint_table():
    listed = {_wmla_route(path).url_name for method, row, served in _endpoints() if served
              for path in _concrete(row) if _wmla_route(path)}
    routes = {pattern.name for pattern in wmla_urls.urlpatterns}
    assert routes - listed == set(), "served but not in the README's endpoint table"


def test_every_row_marked_served_resolves_and_takes_its_method():
    for method, row, served in _endpoints():
        if not served:
            continue
        for path in _concrete(row):
            match = _wmla_route(path)
            assert match, f"{row} is marked served, but {path} is no WMLA route"
            view = getattr(match.func, "view_class", None)
            takes = hasattr(view, method.lower()) if view else method == "GET"
            assert takes, f"{match.url_name} does not take {method}"


def test_rows_marked_not_served_are_no_route():
    rows = [row for _method, row, served in _endpoints() if not served]
    assert rows, "the table lists what is not served too"
    for row in rows:
        for path in _concrete(row):
            if "..." not in path:
                assert _wmla_route(path) is None, f"{path} is marked not served, but resolves"


def _parsed_flags() -> set[str]:
    """Every option string our dlicmd's parser or the server's ``args`` parser knows."""
    return set(build_parser()._option_string_actions) | set(ARGS_PARSER._option_string_actions)


def _flag_rows() -> list[tuple[set[str], bool]]:
    rows = []
    for cells in _table("### Every dlicmd flag"):
        flags = set(FLAG.findall(cells[0]))
        assert flags and cells[2], f"a row needs flags and what a user changes: {cells}"
        rows.append((flags, _served(cells[1])))
    return rows


def test_every_flag_parsed_is_in_the_flag_table():
    listed = set().union(*(flags for flags, _served in _flag_rows()))
    assert _parsed_flags() - listed == set(), "parsed but not in the README's flag table"


def test_flags_marked_served_are_parsed_and_the_others_are_not():
    parsed = _parsed_flags()
    for flags, served in _flag_rows():
        if served:
            assert flags <= parsed, f"marked served but parsed by nothing: {flags - parsed}"
        else:
            concrete = {flag for flag in flags if not flag.endswith("*")}
            assert not concrete & parsed, f"marked not served but parsed: {concrete & parsed}"
            covered = {p for p in parsed for f in flags - concrete if p.startswith(f[:-1])}
            assert not covered, f"a not-served pattern covers parsed flags: {covered}"
