"""The rollout's intake (`services/rollout/intake.py`): sampling params, group jobs and their ids,
and what it refuses at the door for the engine it serves."""

from __future__ import annotations

import pytest

from asyncrl.proto.rollout import RolloutRequest
from asyncrl.services.rollout.intake import BadRequest, body_hash, job_id_for


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
    assert jobs[0].prompt_tokens.tolist() == [3, 4, 5]  # a b c in the char vocabulary (no BOS, as Qwen2)
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


def test_sampling_params_the_reference_engine_refuses_are_refused_at_the_door(intake):
    from asyncrl.proto.sglang import REFERENCE_ENGINE_REFUSES, GenerateItem, SamplingParams
    from asyncrl.services.engine.engine import InferenceEngine, InvalidRequest
    from asyncrl.services.rollout.intake import check_engine_support

    refused = {
        "min_new_tokens": 2, "frequency_penalty": 0.5, "presence_penalty": 0.5,
        "repetition_penalty": 1.1, "regex": "a+", "json_schema": "{}", "ebnf": "root ::= 'a'",
        "logit_bias": {"5": 1.0},
    }  # fmt: skip
    allowed = {
        "stop_token_ids": [5], "ignore_eos": True, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "sampling_seed": 3, "skip_special_tokens": False, "no_stop_trim": True, "max_new_tokens": 4,
        "stop": ["\n"],
    }  # fmt: skip
    assert set(refused) == set(REFERENCE_ENGINE_REFUSES)

    def engine_refuses(params: SamplingParams) -> bool:
        item = GenerateItem(text="ab", input_ids=None, sampling_params=params, rid=None, return_logprob=True,
                            logprob_start_len=-1, top_logprobs_num=0)  # fmt: skip
        try:
            InferenceEngine._refuse_unsupported(
                item, InferenceEngine._unsupported(params)
            )  # the engine's own list
        except InvalidRequest:
            return True
        return False

    for name, value in {**refused, **allowed}.items():
        params = SamplingParams.model_validate({name: value})
        assert engine_refuses(params) == (name in refused), name
        if name in refused:
            with pytest.raises(BadRequest, match=rf"^sampling_params {name}: not supported") as caught:
                check_engine_support(params, "reference")
            assert (caught.value.status, caught.value.reason) == (400, "unsupported_sampling_params")
        else:
            check_engine_support(params, "reference")
        check_engine_support(params, "sglang")  # a real SGLang takes them all
        check_engine_support(params, None)  # unknown engine: it judges
    req = request(prompts=[{"text": "ab"}], sampling_params={"regex": "x", "logit_bias": {"1": 2.0}})
    with pytest.raises(BadRequest, match="^sampling_params regex, logit_bias: not supported"):
        intake.build(req, "j", frozenset({"reverse"}), "reference")
