"""The buffer's Lua scripts (no Redis here: their text and layouts). A group's or a job's state
is written and compared in the scripts as a quoted word, and admission answers likewise: each
must be a `GroupState` or `Admission` value, or the Python side and the scripts would speak two
vocabularies."""

from __future__ import annotations

import re

import pytest

from asyncrl.buffer import admission, groups, jobs, versions
from asyncrl.buffer.connection import Script
from asyncrl.proto.states import Admission, GroupState

# Quoted words in the scripts that are not states: hash fields, counters, stream entry fields.
FIELDS = {"accepted", "put", "duplicates", "jobs_enqueued", "jobs_", "gid", "mv", "entry", "stream", "reason",
          "data", "groups", "jobs", "table", "batch_groups", "max_staleness", "version",
          "stepped"}  # fmt: skip
SCRIPTS = [
    s
    for module in (groups, jobs, admission, versions)
    for s in vars(module).values()
    if isinstance(s, Script)
]


def test_every_state_word_in_a_script_is_a_state_of_proto_states():
    assert len(SCRIPTS) >= 6
    words = {w for s in SCRIPTS for w in re.findall(r"'([a-z_]+)'", s.source)}
    states = words - FIELDS
    assert {"buffered", "trained", "dead_lettered", "queued", "admitted", "full"} <= states
    known = {*GroupState, *Admission}
    assert states <= known, f"neither GroupState nor Admission values: {sorted(states - known)}"


@pytest.mark.parametrize("name", ["type", "redis", "unpack"])
def test_a_script_name_may_not_hide_a_lua_global(name):
    with pytest.raises(ValueError, match="hide Lua's own"):
        Script(f"a {name}", "b", "return 1")


def test_a_call_must_name_exactly_the_layout():
    script = Script("state *rest", "n", "return 1")
    assert script.layout({"state": "k", "rest": ["x", "y"], "n": 3}) == (["k", "x", "y"], [3])
    with pytest.raises(TypeError, match="script takes"):
        script.layout({"state": "k", "n": 3})
