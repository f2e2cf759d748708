"""Pure pieces of the rollout service: request intake, settings, response checks, the
all-or-nothing gather. No network, no Redis (the integration tests cover those)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import ValidationError

from proto.rollout import RolloutRequest
from services.common.tinymodel import build_char_tokenizer
from services.rollout.config import RolloutSettings
from services.rollout.engine_client import _parse_generation
from services.rollout.intake import BadRequest, Intake, body_hash, job_id_for
from services.rollout.scheduler import _all_or_nothing


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
    assert jobs[0].prompt_ids.tolist() == [1, 3, 4, 5]  # <bos> a b c in the char vocabulary
    assert jobs[0].reward_spec == {"verifier": "reverse"}
    assert jobs[1].reward_spec == {"verifier": "arith", "answer": "3"}
    assert {j.group_size for j in jobs} == {3}


def test_build_refuses_long_prompts_and_unknown_verifiers(intake):
    with pytest.raises(BadRequest, match="prompt 1 has 10 tokens"):
        intake.build(request(prompts=[{"text": "ab"}, {"text": "abcdefghi"}]), "j", frozenset({"reverse"}))
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


def generate_response(output_ids, logprobs, version="3") -> httpx.Response:
    body = {
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
    return httpx.Response(200, json=body)


def test_generation_answers_are_checked():
    out = _parse_generation(generate_response([5, 6], [-0.5, -1.25]))
    assert (out.output_ids, out.logprobs, out.weight_version, out.finish_reason) == (
        [5, 6],
        [-0.5, -1.25],
        "3",
        "length",
    )
    with pytest.raises(ValueError, match="do not match"):
        _parse_generation(generate_response([5, 6], [-0.5]))
    with pytest.raises(ValueError, match="<= 0"):
        _parse_generation(generate_response([5], [0.7]))
    with pytest.raises(ValueError, match="not a GenerateResponse"):
        _parse_generation(httpx.Response(200, json={"text": 1}))


def test_all_or_nothing_cancels_the_rest_on_the_first_error():
    cancelled = []

    async def slow(i):
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise

    async def boom():
        await asyncio.sleep(0.01)
        raise RuntimeError("engine gone")

    async def main():
        with pytest.raises(RuntimeError, match="engine gone"):
            await _all_or_nothing([slow(0), boom(), slow(2)])
        return await _all_or_nothing([asyncio.sleep(0, result=i) for i in range(3)])

    assert asyncio.run(main()) == [0, 1, 2]
    assert sorted(cancelled) == [0, 2]
