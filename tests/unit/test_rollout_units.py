"""Pure pieces of the rollout service: request intake, settings, response checks, the
all-or-nothing gather. No network, no Redis (the integration tests cover those)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import ValidationError

from asyncrl.proto.rollout import RolloutRequest
from asyncrl.services.ops.tinymodel import build_char_tokenizer
from asyncrl.services.rollout.clients.engine import _parse_generations
from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.services.rollout.intake import BadRequest, Intake, body_hash, job_id_for


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
        _parse_generations(
            httpx.Response(200, json=generate_item([5], [-0.5])), 1
        )  # a single, unbatched answer


def test_chunk_by_size_keeps_order_and_the_limit():
    from asyncrl.services.runtime.coalescer import chunk_by_size

    # sizes 3,3,2 | 5 | 9 (alone: larger than the limit) | 1 ; limit 8
    assert chunk_by_size([3, 3, 2, 5, 9, 1], lambda n: n, 8) == [[3, 3, 2], [5], [9], [1]]
    assert chunk_by_size([], lambda n: n, 8) == []


class Refused(Exception):
    pass


def coalesce(callers: list[tuple[str, list[str]]], *, max_items: int = 1024):
    """Submit every (key, items) at once to a Coalescer whose send upper-cases the items and
    refuses any batch holding "bad"; each caller's answer or exception, the sends, the splits."""
    from asyncrl.services.runtime.coalescer import Coalescer

    sends, splits = [], []

    async def send(key: str, items: list[str]) -> list[str]:
        sends.append((key, items))
        if "bad" in items:
            raise Refused("bad")
        if "boom" in items:
            raise RuntimeError("boom")
        return [x.upper() for x in items]

    async def go():
        c = Coalescer(send, split_on=Refused, on_split=lambda: splits.append(1), max_items=max_items)
        return await asyncio.gather(*(c.submit(k, items) for k, items in callers), return_exceptions=True)

    return asyncio.run(go()), sends, splits


def test_coalescer_sends_concurrent_calls_of_a_key_together_and_answers_each_its_own():
    answers, sends, splits = coalesce([("k", ["a", "b"]), ("j", ["c"]), ("k", ["d"])])
    assert answers == [["A", "B"], ["C"], ["D"]]
    assert sorted(sends) == [("j", ["c"]), ("k", ["a", "b", "d"])] and splits == []
    # at most max_items per call; a caller's items are never split across calls
    answers, sends, _ = coalesce([("k", ["a", "b"]), ("k", ["c", "d"]), ("k", ["e"])], max_items=3)
    assert answers == [["A", "B"], ["C", "D"], ["E"]]
    assert sorted(sends) == [("k", ["a", "b"]), ("k", ["c", "d", "e"])]


def test_coalescer_resends_a_refused_merged_call_caller_by_caller():
    answers, sends, splits = coalesce([("k", ["a"]), ("k", ["bad"]), ("k", ["c"])])
    assert answers[0] == ["A"] and isinstance(answers[1], Refused) and answers[2] == ["C"]
    assert len(sends) == 4 and splits == [1]  # the merged call, then one per caller
    # any other failure goes to every caller of the call, with no resend
    answers, sends, splits = coalesce([("k", ["a"]), ("k", ["boom"])])
    assert [type(a) for a in answers] == [RuntimeError, RuntimeError] and len(sends) == 1 and splits == []


def test_group_commit_sends_at_once_when_idle_and_batches_what_arrives_meanwhile():
    """The first item goes out alone, at once; the four that arrive while that call runs go out
    together in the next; each caller gets its own answer; one call at a time."""
    from asyncrl.services.runtime.coalescer import GroupCommit

    sends, running, batches = [], [], []

    async def send(items: list[str]) -> list[str]:
        running.append(1)
        assert len(running) == 1, "one call at a time"
        sends.append(list(items))
        await asyncio.sleep(0.01)
        running.pop()
        if "bad" in items:
            raise Refused("bad")
        if "boom" in items:
            raise RuntimeError("boom")
        return [x.upper() for x in items]

    async def go(later: list[str]):
        c = GroupCommit(send, split_on=Refused, on_batch=batches.append)
        first = asyncio.ensure_future(c.submit("a"))
        await asyncio.sleep(0)  # the first call is under way
        rest = [asyncio.ensure_future(c.submit(x)) for x in later]
        return await asyncio.gather(first, *rest, return_exceptions=True)

    assert asyncio.run(go(["b", "c", "d", "e"])) == ["A", "B", "C", "D", "E"]
    assert sends == [["a"], ["b", "c", "d", "e"]] and batches == [1, 4]
    sends.clear()
    answers = asyncio.run(go(["b", "bad", "c"]))  # refused batch: each item again alone
    assert answers[:2] == ["A", "B"] and isinstance(answers[2], Refused) and answers[3] == "C"
    assert sends == [["a"], ["b", "bad", "c"], ["b"], ["bad"], ["c"]]
    sends.clear()
    answers = asyncio.run(go(["b", "boom"]))  # any other failure: every item of that batch
    assert answers[0] == "A" and [type(a) for a in answers[1:]] == [RuntimeError, RuntimeError]
    assert sends == [["a"], ["b", "boom"]]


def test_retries_back_off_and_stop_at_the_first_error_that_is_not_retryable(monkeypatch):
    import types

    from asyncrl.services.runtime import retry
    from asyncrl.services.runtime.retry import Retryable, with_retries

    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    # Only the retry module's sleep: servers other tests left running in this process (session
    # fixtures) sleep through the same asyncio module, and a global patch turned their 0.1 s ticks
    # into a busy loop appending to `slept`.
    monkeypatch.setattr(retry, "asyncio", types.SimpleNamespace(sleep=sleep))

    def run(outcomes: list, retries: int, **backoff):
        tried = []

        async def attempt(n: int) -> str:
            tried.append(n)
            if isinstance(outcomes[n], Exception):
                raise outcomes[n]
            return outcomes[n]

        slept.clear()
        return asyncio.run(with_retries(attempt, retries, **backoff)), tried

    fails = [Retryable(str(n)) for n in range(4)]
    assert run([*fails, "ok"], retries=5, first_s=0.5, max_s=1.5) == ("ok", [0, 1, 2, 3, 4])
    assert slept == [0.5, 1.0, 1.5, 1.5]  # doubling, capped
    run([*fails, "ok"], retries=5, first_s=1.0, jitter=0.25)
    assert all(1.0 <= d / b <= 1.25 for d, b in zip(slept, [1, 2, 4, 8]))
    with pytest.raises(Retryable, match="1"):  # out of retries: the last problem
        run([*fails, "ok"], retries=1, first_s=0.5)
    with pytest.raises(Refused):  # not retryable: ends at once
        run([Refused(), "ok"], retries=5, first_s=0.5)


# --------------------------------------------------------------------------------- submission checks


def reverse_schema() -> dict:
    from asyncrl.proto.verifiers import ReverseSpec

    return ReverseSpec.model_json_schema()


def test_reward_spec_arguments_are_checked_with_the_verifiers_own_model(intake):
    from asyncrl.proto.verifiers import ArithSpec

    served = {"reverse": reverse_schema(), "arith": ArithSpec.model_json_schema()}
    bad = request(
        prompts=[
            {"text": "ab"},
            {"text": "ab", "reward_spec": {"verifier": "reverse", "target": 5, "colour": "red"}},
        ]
    )
    with pytest.raises(BadRequest) as caught:
        intake.build(bad, "j", served)
    assert (caught.value.status, caught.value.reason) == (422, "invalid_reward_spec")
    assert str(caught.value) == (
        "invalid reward_spec: prompts.1.reward_spec.target: Input should be a valid string (reverse); "
        "prompts.1.reward_spec.colour: Extra inputs are not permitted (reverse)"
    )
    # the job-level spec is named as such; an arith answer that is no integer fails its own validator
    with pytest.raises(
        BadRequest, match=r"^invalid reward_spec: reward_spec\.answer: Value error, answer must be"
    ):
        intake.build(
            request(prompts=[{"text": "ab"}], reward_spec={"verifier": "arith", "answer": "x"}), "j", served
        )
    ok = request(prompts=[{"text": "ab", "reward_spec": {"verifier": "arith", "answer": 12}}, {"text": "ba"}])
    assert [j.reward_spec for j in intake.build(ok, "j", served)] == [
        {"verifier": "arith", "answer": 12},  # sent as given; the reward service parses it again
        {"verifier": "reverse"},
    ]


def test_reward_spec_refusals_are_bounded_and_never_echo_the_input(intake):
    served = {"reverse": reverse_schema()}
    huge_key, huge_value = "k" * 100_000, "v" * 100_000
    prompts = [
        {"text": "ab", "reward_spec": {"verifier": "reverse", huge_key: 1, "target": [huge_value]}}
    ] * 50
    with pytest.raises(BadRequest) as caught:
        intake.build(request(prompts=prompts), "j", served)
    message = str(caught.value)
    assert len(message) < 2_000 and huge_value[:300] not in message
    assert message.startswith(
        "invalid reward_spec: prompts.0.reward_spec.target: Input should be a valid string"
    )
    assert message.endswith("(50 invalid specs in all)")


def test_verifiers_unknown_here_or_of_another_version_are_checked_by_name_only(intake):
    spec = {"verifier": "reverse", "target": 5}
    other_version = {**reverse_schema(), "title": "ReverseSpecV2"}
    for served in ({"reverse": other_version}, frozenset({"reverse"})):
        assert len(intake.build(request(prompts=[{"text": "ab", "reward_spec": spec}]), "j", served)) == 1
    custom = request(prompts=[{"text": "ab", "reward_spec": {"verifier": "custom", "anything": [1]}}])
    assert len(intake.build(custom, "j", {"custom": {"type": "object"}, "reverse": reverse_schema()})) == 1
    with pytest.raises(BadRequest, match=r"unknown verifier\(s\) \['custom'\]") as caught:
        intake.build(custom, "j", {"reverse": reverse_schema()})
    assert (caught.value.status, caught.value.reason) == (400, "unknown_verifier")


def test_sampling_params_the_reference_engine_refuses_are_refused_at_the_door(intake):
    from asyncrl.proto.sglang import REFERENCE_ENGINE_REFUSES, GenerateItem, SamplingParams
    from asyncrl.services.engine.engine import InferenceEngine, InvalidRequest
    from asyncrl.services.rollout.intake import check_engine_support

    refused = {
        "stop": ["\n"], "min_new_tokens": 2, "frequency_penalty": 0.5, "presence_penalty": 0.5,
        "repetition_penalty": 1.1, "regex": "a+", "json_schema": "{}", "ebnf": "root ::= 'a'",
        "logit_bias": {"5": 1.0},
    }  # fmt: skip
    allowed = {
        "stop_token_ids": [5], "ignore_eos": True, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "min_p": 0.1,
        "sampling_seed": 3, "skip_special_tokens": False, "no_stop_trim": True, "max_new_tokens": 4,
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
    req = request(prompts=[{"text": "ab"}], sampling_params={"stop": ["x"], "logit_bias": {"1": 2.0}})
    with pytest.raises(BadRequest, match="^sampling_params stop, logit_bias: not supported"):
        intake.build(req, "j", frozenset({"reverse"}), "reference")


def test_a_job_level_reward_spec_is_checked_only_when_a_prompt_uses_it():
    from asyncrl.proto.verifiers import SPECS
    from asyncrl.services.rollout.intake import check_reward_specs

    served = {name: SPECS[name].model_json_schema() for name in ("math", "reverse")}  # as published
    bad_default = {"verifier": "math"}  # math needs an `answer`
    own = [{"text": "2+3?", "reward_spec": {"verifier": "math", "answer": "5"}}]
    req = RolloutRequest.model_validate({"prompts": own, "reward_spec": bad_default})
    check_reward_specs(req.prompts, req.reward_spec, served)  # every prompt brings its own: fine
    req = RolloutRequest.model_validate({"prompts": [*own, {"text": "1+1?"}], "reward_spec": bad_default})
    with pytest.raises(BadRequest) as err:
        check_reward_specs(req.prompts, req.reward_spec, served)
    assert err.value.status == 422 and str(err.value).startswith("invalid reward_spec: reward_spec.answer:")
