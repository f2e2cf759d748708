"""The engine fleet's HTTP bodies (`proto/fleet.py`): what an engine URL to join may be."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.proto.fleet import EngineJoin


def test_an_engine_url_to_join_is_a_base_url():
    assert EngineJoin(url=" http://10.0.0.7:30000/ ").url == "http://10.0.0.7:30000"
    assert EngineJoin(url="https://engine-3.svc").url == "https://engine-3.svc"
    for bad, why in [("ftp://e:1", "http\\(s\\)://host"), ("http://e:1/generate", "no path"),
                     ("http://e:1?x=1", "no path"), ("http://u:p@e:1", "credentials"),
                     ("http://e:99999", "Port out of range"), ("http://", "http\\(s\\)://host")]:  # fmt: skip
        with pytest.raises(ValidationError, match=why):
            EngineJoin(url=bad)
