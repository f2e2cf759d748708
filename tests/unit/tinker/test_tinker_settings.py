"""`asyncrl tinker`'s settings refuse what would sample silently from the wrong model."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.services.tinker.config import TinkerServiceSettings

REDIS = "redis://127.0.0.1:1/0"


def test_engines_serve_one_base_model_so_only_one_may_be_named_with_them():
    two = {"a/one": "/models/one", "b/two": "/models/two"}
    # `engine_urls` does not say which engine serves which base: a sample of b/two (or of an
    # adapter trained on it) would go to an engine serving a/one and answer for it.
    with pytest.raises(ValidationError, match="engine_urls serve one base model"):
        TinkerServiceSettings(redis_url=REDIS, base_models=two, engine_urls=["http://127.0.0.1:30000"])
    assert TinkerServiceSettings(redis_url=REDIS, base_models=two).engine_urls == []  # training only
    one = TinkerServiceSettings(
        redis_url=REDIS, base_models={"a/one": "/models/one"}, engine_urls=["http://e:1"]
    )
    assert one.engine_urls == ["http://e:1"]
