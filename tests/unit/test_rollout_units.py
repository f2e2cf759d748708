"""Pure pieces of the rollout service: request intake, settings, response checks, the
all-or-nothing gather. No network, no Redis (the integration tests cover those)."""

from __future__ import annotations

import json

import httpx
import pytest
from pydantic import ValidationError

from proto.rollout import RolloutRequest
from services.common.tinymodel import build_char_tokenizer
from services.rollout.config import RolloutSettings
from services.rollout.engine_client import _parse_generations
from services.rollout.intake import BadRequest, Intake, body_hash, job_id_for


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


def request(**fields) -> RolloutRequest:
    return RolloutRequest.model_validate({"reward_spec": {"verifier": "reverse"}, **fields})


def test_sampling_params_forward_only_what_was_set_plus_the_default_budget(intake):
    params = intake.sampling_params(
        request(prompts=[{"text": "ab"}], sampling_params={"temperature": 0.5, "seed": 7})
    )
    assert params == {"temperature": 0.5, "sampling_seed": 7, "max_new_tokens": 16}
    assert intake.sampling_params(request(prompts=[{"text": "ab"}]))["max_new_tokens"] == 16
    with pytest.raises(BadRequest, match="exceeds the cap 32"):
        intake.sampling_params(request(prompts=[{"text": "ab"}], sampling_params={"max_new_tokens": 33}))


def test_build_gives_one_group_job_per_prompt_with_stable_ids(intake):
    req = request(
        prompts=[
            {"text": "abc"},
            {"input_ids": [1, 5, 6], "reward_spec": {"verifier": "arith", "answer": "3"}},
        ]
    )
    jobs = intake.build(req, "jX", frozenset({"reverse", "arith"}))
    assert [j.group_id for j in jobs] == ["jX-000000", "jX-000001"]
    assert [j.prompt_id for j in jobs] == ["jX-p0", "jX-p1"]
    assert jobs[0].prompt_ids.tolist() == [3, 4, 5]  # a b c in the char vocabulary (no BOS, as Qwen2)
    assert jobs[0].reward_spec == {"verifier": "reverse"}
    assert jobs[1].reward_spec == {"verifier": "arith", "answer": "3"}
    assert {j.group_size for j in jobs} == {3}


def test_build_refuses_long_prompts_and_unknown_verifiers(intake):
    with pytest.raises(BadRequest, match="prompt 1 has 10 tokens"):
        intake.build(request(prompts=[{"text": "ab"}, {"text": "abcdefghij"}]), "j", frozenset({"reverse"}))
    with pytest.raises(BadRequest, match=r"unknown verifier\(s\) \['astro'\]"):
        intake.build(
            request(prompts=[{"text": "ab", "reward_spec": {"verifier": "astro"}}]),
            "j",
            frozenset({"reverse"}),
        )


def test_job_ids_follow_the_idempotency_key():
    a = request(prompts=[{"text": "ab"}], idempotency_key="k1")
    assert job_id_for("run1", a) == job_id_for("run1", a.model_copy())
    assert job_id_for("run1", a) != job_id_for("run2", a)
    assert job_id_for("run1", request(prompts=[{"text": "ab"}])) != job_id_for(
        "run1", request(prompts=[{"text": "ab"}])
    )
    b = request(prompts=[{"text": "ab"}], idempotency_key="k2")
    assert body_hash(a) == body_hash(b)  # the key itself is not part of the body's identity
    assert body_hash(a) != body_hash(request(prompts=[{"text": "ac"}], idempotency_key="k1"))


def test_settings_parse_engine_url_lists(tok_dir):
    s = RolloutSettings(tokenizer=tok_dir, engine_urls="http://a:1, http://b:2/")
    assert s.engine_url_list == ["http://a:1", "http://b:2"] and s.admin_url_list == s.engine_url_list
    s = RolloutSettings(
        tokenizer=tok_dir, engine_urls=json.dumps(["http://r:3"]), engine_admin_urls="http://w:4"
    )
    assert (s.engine_url_list, s.admin_url_list) == (["http://r:3"], ["http://w:4"])
    with pytest.raises(ValidationError, match="http"):
        RolloutSettings(tokenizer=tok_dir, engine_urls="a:1")
    with pytest.raises(ValidationError, match="recover_idle_s / 3"):
        RolloutSettings(tokenizer=tok_dir, heartbeat_s=5, recover_idle_s=10)


def generate_item(output_ids, logprobs, version="3") -> dict:
    return {
        "text": "x",
        "output_ids": output_ids,
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": len(output_ids)},
            "prompt_tokens": 2,
            "completion_tokens": len(output_ids),
            "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids)],
        },
    }


def batch(*items: dict) -> httpx.Response:
    return httpx.Response(200, json=list(items))


def test_generation_answers_are_checked():
    out = _parse_generations(batch(generate_item([5, 6], [-0.5, -1.25]), generate_item([7], [-2.0], "4")), 2)
    assert [(o.output_ids, o.logprobs, o.weight_version, o.finish_reason) for o in out] == [
        ([5, 6], [-0.5, -1.25], "3", "length"),
        ([7], [-2.0], "4", "length"),
    ]
    with pytest.raises(ValueError, match="1 answers for a batch of 2"):
        _parse_generations(batch(generate_item([5], [-0.5])), 2)
    with pytest.raises(ValueError, match="do not match"):
        _parse_generations(batch(generate_item([5, 6], [-0.5])), 1)
    with pytest.raises(ValueError, match="<= 0"):
        _parse_generations(batch(generate_item([5], [0.7])), 1)
    with pytest.raises(ValueError, match="not a list of GenerateResponse"):
        _parse_generations(httpx.Response(200, json=[{"text": 1}]), 1)
    with pytest.raises(ValueError, match="not a list of GenerateResponse"):
        _parse_generations(httpx.Response(200, json=generate_item([5], [-0.5])), 1)  # a single, unbatched answer


def test_chunk_by_size_keeps_order_and_the_limit():
    from services.rollout.batching import chunk_by_size

    # sizes 3,3,2 | 5 | 9 (alone: larger than the limit) | 1 ; limit 8
    assert chunk_by_size([3, 3, 2, 5, 9, 1], lambda n: n, 8) == [[3, 3, 2], [5], [9], [1]]
    assert chunk_by_size([], lambda n: n, 8) == []
