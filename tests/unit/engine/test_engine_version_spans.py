"""The reference engine's `meta_info.weight_versions` (`scheduler.version_spans`): the spans
SGLang 0.5.23's `compute_weight_version_spans` gives for the same weight-update events."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from asyncrl.services.engine.scheduler import version_spans


def spans(n: int, events: list[tuple[str, int]], current: str) -> list[tuple[str, int, int]]:
    r = SimpleNamespace(output_ids=list(range(n)), version_events=events, weight_version=current)
    return [(s["version"], s["start"], s["end"]) for s in version_spans(r)]


@pytest.mark.parametrize(
    ("n", "events", "current", "want"),
    [
        (4, [], "1", [("1", 0, 4)]),  # no update while it ran
        (0, [], "1", [("1", 0, 0)]),  # no tokens: one empty span at 0
        (5, [("1", 2)], "2", [("1", 0, 2), ("2", 2, 5)]),
        (6, [("1", 2), ("2", 4)], "3", [("1", 0, 2), ("2", 2, 4), ("3", 4, 6)]),
        (3, [("1", 3)], "2", [("1", 0, 3)]),  # updated after its last token: all old
        (4, [("1", 2), ("2", 2)], "3", [("1", 0, 2), ("3", 2, 4)]),  # two updates between tokens
        (4, [("1", 2)], "1", [("1", 0, 4)]),  # same name again: one span
    ],
)
def test_spans_match_sglangs_rule(n, events, current, want):
    assert spans(n, events, current) == want
