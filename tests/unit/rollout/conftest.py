"""Fixtures of the rollout's unit tests: a character tokenizer on disk and an intake over it."""

from __future__ import annotations

import pytest

from asyncrl.services.ops.tinymodel import build_char_tokenizer
from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.services.rollout.intake import Intake


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_char_tokenizer(path, model_max_length=64)
    return str(path)


@pytest.fixture(scope="module")
def intake(tok_dir):
    from transformers import AutoTokenizer

    settings = RolloutSettings(
        tokenizer=tok_dir, max_new_tokens_cap=32, default_max_new_tokens=16, default_group_size=3
    )
    return Intake(settings, AutoTokenizer.from_pretrained(tok_dir), context_length=10)
