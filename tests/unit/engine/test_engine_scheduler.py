"""The scheduler's loop, driven inline on a tiny model: admission cadence, slot reuse when
requests finish at different times, and results independent of batching."""

from __future__ import annotations

import pytest
import torch

from asyncrl.services.engine.model_runner import ModelRunner
from asyncrl.services.engine.sampling import RowSampling
from asyncrl.services.engine.scheduler import Request, Scheduler
from asyncrl.services.ops.tinymodel import build_tiny_model

torch.set_num_threads(1)
GREEDY = RowSampling(0.0, 1.0, -1, 0.0)


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path = tmp_path_factory.mktemp("sched_model")
    build_tiny_model(path, seed=5)
    return ModelRunner(str(path), slots=4, context_length=128, device="cpu", dtype="float32")


def request(rid: str, prompt: list[int], n: int, done: list) -> Request:
    return Request(rid, prompt, n, frozenset(), GREEDY, 0, on_finish=done.append)


def step(s: Scheduler) -> None:
    admitted = s._admit()
    if admitted:
        s._prefill(admitted)
    if s.running:
        s._decode()


def run(s: Scheduler) -> None:
    while s.running or s.waiting:
        step(s)


def test_results_do_not_depend_on_batch_mates_or_slots(runner):
    prompts = {f"r{i}": [1, 5 + i, 6, 7 + 2 * i] for i in range(6)}
    lengths = {f"r{i}": 3 + 4 * i for i in range(6)}  # finish at different steps: slots get reused
    solo = {}
    for rid, prompt in prompts.items():
        done: list[Request] = []
        s = Scheduler(runner, max_running=4, max_prefill_tokens=4096, weight_version="0")
        s.waiting.append(request(rid, prompt, lengths[rid], done))
        run(s)
        solo[rid] = done[0]
    done = []
    s = Scheduler(runner, max_running=4, max_prefill_tokens=4096, weight_version="0")
    for rid, prompt in prompts.items():  # 6 requests through 4 slots
        s.waiting.append(request(rid, prompt, lengths[rid], done))
    run(s)
    assert sorted(r.rid for r in done) == sorted(prompts)
    for r in done:
        assert r.output_ids == solo[r.rid].output_ids
        assert r.output_logprobs == pytest.approx(solo[r.rid].output_logprobs, abs=1e-5)
        assert r.finish_reason == {"type": "length", "length": lengths[r.rid]}
    assert s.stats["max_decode_batch"] == 4


def test_continuous_decode_steps_spaces_admissions(runner):
    done: list[Request] = []
    s = Scheduler(
        runner, max_running=4, max_prefill_tokens=4096, weight_version="0", continuous_decode_steps=3
    )
    s.waiting.append(request("a", [1, 5, 6], 20, done))
    step(s)  # nothing running: admitted at once
    assert [r.rid for r in s.running] == ["a"]
    s.waiting.append(request("b", [1, 7, 8], 5, done))
    step(s)
    step(s)
    assert [r.rid for r in s.running] == ["a"]  # two more decode steps before the next admission
    step(s)
    assert [r.rid for r in s.running] == ["a", "b"]


def test_requests_finishing_together_free_their_slots_without_moving_kv(runner, monkeypatch):
    """Four requests finish at the same step: their slots are freed from the last one down, so
    no cache row is moved; a request that keeps running is moved into a freed slot with its KV,
    and its tokens are those it gets alone."""
    moves: list[tuple[int, int]] = []
    real_move = runner.cache.move
    monkeypatch.setattr(
        runner.cache, "move", lambda src, dst, n: (moves.append((src, dst)), real_move(src, dst, n))
    )
    done: list[Request] = []
    s = Scheduler(runner, max_running=4, max_prefill_tokens=4096, weight_version="0")
    for i in range(4):
        s.waiting.append(request(f"r{i}", [1, 5 + i, 6], 3, done))
    run(s)
    assert sorted(r.rid for r in done) == ["r0", "r1", "r2", "r3"] and moves == []
    alone: list[Request] = []
    s.waiting.append(request("long", [1, 9, 9, 9], 6, alone))
    run(s)
    done.clear()
    # slots 0, 2, 3 finish together: 3 and 2 are the tail (no move), then the long request in
    # slot 1 moves into slot 0 with its KV
    s.waiting.append(request("s0", [1, 5, 6], 2, done))
    s.waiting.append(request("long", [1, 9, 9, 9], 6, done))
    s.waiting.append(request("s1", [1, 6, 6], 2, done))
    s.waiting.append(request("s2", [1, 7, 6], 2, done))
    run(s)
    assert moves == [(1, 0)]
    (long,) = [r for r in done if r.rid == "long"]
    assert long.output_ids == alone[0].output_ids
    assert long.output_logprobs == pytest.approx(alone[0].output_logprobs, abs=1e-5)


@pytest.mark.parametrize("std", [0.0, 0.5, 2.0])
def test_injected_logit_noise_changes_logprobs_by_the_configured_amount(runner, std):
    """`logit_noise_std` (a study's controlled mismatch, off by default): each sampled token's
    reported logprob is exactly that of the model's logits plus std × the noise the engine's
    seeded generator drew, step by step; with 0 it is the model's own."""
    from transformers import AutoModelForCausalLM

    from asyncrl.services.engine.config import EngineSettings

    assert EngineSettings(model="m").logit_noise_std == 0.0  # off by default
    prompt, n = [1, 5, 6, 7], 12
    done: list[Request] = []
    s = Scheduler(
        runner, max_running=4, max_prefill_tokens=4096, weight_version="0", logit_noise_std=std, seed=3
    )
    s.waiting.append(Request("r", prompt, n, frozenset(), RowSampling(1.0, 1.0, -1, 0.0), 11,
                             on_finish=done.append))  # fmt: skip
    run(s)
    out = done[0]
    model = AutoModelForCausalLM.from_pretrained(runner.model_path).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.output_ids])).logits[0, len(prompt) - 1 : -1].float()
    noise = torch.Generator().manual_seed(3)
    want, shift = [], []
    for t, tok in enumerate(out.output_ids):
        z = torch.randn((1, logits.shape[-1]), generator=noise, dtype=torch.float32)[0] if std else 0.0
        lp = torch.log_softmax(logits[t] + std * z, -1)
        want.append(float(lp[tok]))
        shift.append(float(lp[tok] - torch.log_softmax(logits[t], -1)[tok]))
    assert out.output_logprobs == pytest.approx(want, abs=1e-4)
    if std == 0.0:
        assert max(abs(x) for x in shift) < 1e-4
    else:  # the reported logprobs differ from the model's by about the noise's size
        assert 0.2 * std < (sum(x * x for x in shift) / n) ** 0.5 < 3 * std
