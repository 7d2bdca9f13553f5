"""bench/runtime.py's step counter: it counts the whole lines of a log being appended to,
reading only what is new, and a line still being written is not counted until it ends."""

from __future__ import annotations

from bench.runtime import _LineCount


def test_it_counts_whole_lines_as_they_are_appended(tmp_path):
    log = tmp_path / "steps.jsonl"
    with _LineCount(log) as lines:
        assert lines.now() == 0  # no file yet
        log.write_text('{"step": 1}\n{"st')
        assert lines.now() == 1  # the second line is half written
        with log.open("a") as f:
            f.write('ep": 2}\n{"step": 3}\n')
        assert lines.now() == 3
        assert lines.now() == 3  # nothing new, nothing counted twice
