"""Episodes in the records and the trainer: loss masks, turns, pieces of a session.

A loss computed by hand over the policy's tokens only equals the trainer's; environment tokens
change neither the loss, the importance weights nor the entropy; pieces of one episode share
its advantage and keep their own prompts; the codec carries every new column.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncrl.proto import Group, Sample, Samples, decode, encode
from asyncrl.trainer.batch import build_rows, collate, token_logprobs
from asyncrl.trainer.loss_config import LossConfig
from asyncrl.trainer.losses import policy_loss

torch.set_num_threads(1)


def episode_sample(index: int, reward: float, ids, mask, versions, seed: int = 0, **fields) -> Sample:
    rng = np.random.default_rng(seed + index)
    lps = np.where(np.asarray(mask) == 1, -rng.random(len(ids)) - 0.1, 0.0).astype(np.float32)
    return Sample(prompt_id="p", index=index, completion_ids=ids, behavior_logprobs=lps, versions=versions,
                  finish_reason="stop", reward=reward, reward_status="scored", loss_mask=mask, **fields)  # fmt: skip


def test_loss_mask_rules_and_min_version_over_policy_tokens():
    s = episode_sample(0, 1.0, [5, 6, 7, 8, 9], [1, 1, 0, 0, 1], [4, 4, 4, 4, 7], turn_starts=[0, 4],
                       turn_rewards=[0.0, 1.0])  # fmt: skip
    assert s.min_version == 4 and s.policy_mask.tolist() == [1, 1, 0, 0, 1]
    old_env_token = episode_sample(
        0, 1.0, [5, 6, 7], [1, 0, 1], [5, 2, 6]
    )  # an env token's version does not count
    assert old_env_token.min_version == 5
    with pytest.raises(ValueError, match="loss_mask entries"):
        Sample(prompt_id="p", index=0, completion_ids=[5, 6], behavior_logprobs=[-1.0, 0.0], versions=[0, 0],
               finish_reason="stop", loss_mask=[1, 0, 1])  # fmt: skip
    with pytest.raises(ValueError, match="0 or 1"):
        episode_sample(0, 1.0, [5, 6], [1, 2], [0, 0])
    with pytest.raises(ValueError, match="behaviour logprob 0"):
        Sample(prompt_id="p", index=0, completion_ids=[5, 6], behavior_logprobs=[-1.0, -0.5], versions=[0, 0],
               finish_reason="stop", loss_mask=[1, 0])  # fmt: skip
    with pytest.raises(ValueError, match="turn_starts must ascend"):
        episode_sample(0, 1.0, [5, 6, 7], [1, 0, 1], [0, 0, 0], turn_starts=[2, 1])
    with pytest.raises(ValueError, match="turn_rewards"):
        episode_sample(0, 1.0, [5, 6, 7], [1, 0, 1], [0, 0, 0], turn_starts=[0, 2], turn_rewards=[1.0])


def test_codec_carries_episode_columns_and_pieces():
    a = episode_sample(
        0, 1.0, [5, 6, 7, 8], [1, 0, 0, 1], [3, 3, 3, 4], turn_starts=[0, 3], turn_rewards=[0.0, 1.0]
    )
    b = episode_sample(
        1, 1.0, [9, 10], [1, 1], [5, 5], prompt_ids=[1, 2, 3], episode=0
    )  # a second piece of episode 0
    c = Sample(prompt_id="p", index=2, completion_ids=[11], behavior_logprobs=[-0.3], versions=[2], finish_reason="stop",
               reward=0.0, reward_status="scored")  # a one-turn sample  # fmt: skip
    g = Group.build(
        group_id="g", job_id="j", prompt_tokens=[1, 2], reward_spec={}, samples=[a, b, c], submit_version=1
    )
    back = decode(encode(g))
    assert back == g and back.min_version == 2
    s = back.samples
    assert s.loss_mask.tolist() == [1, 0, 0, 1, 1, 1, 1] and s.prompt_lengths == [0, 3, 0]
    assert s.episode == [None, 0, None] and s.turn_starts == [[0, 3], [], []]
    assert s[1].prompt_ids.tolist() == [1, 2, 3] and s[1].episode == 0 and s[0].turn_rewards == [0.0, 1.0]
    with pytest.raises(ValueError, match="carry its reward"):
        Samples.of([a, episode_sample(1, 0.5, [9], [1], [5], episode=0)])
    with pytest.raises(ValueError, match="first piece"):
        Samples.of([a, episode_sample(1, 1.0, [9], [1], [5], episode=2)])


def test_pieces_share_their_episodes_advantage_and_keep_their_prompts():
    a = episode_sample(0, 1.0, [5, 6], [1, 1], [0, 0])
    b = episode_sample(1, 1.0, [7], [1], [0], prompt_ids=[1, 9], episode=0)
    c = episode_sample(2, 0.0, [8, 9], [1, 1], [0, 0])
    g = Group.build(
        group_id="g", job_id="j", prompt_tokens=[1, 2], reward_spec={}, samples=[a, b, c], submit_version=0
    )
    rows = build_rows([g], "dr_grpo")
    # two episodes, rewards 1 and 0: Dr. GRPO's r − mean gives ±0.5, the piece takes its episode's
    assert [r.advantage for r in rows.rows] == [0.5, 0.5, -0.5] and rows.rewards == [1.0, 0.0]
    assert [r.prompt_tokens.tolist() for r in rows.rows] == [[1, 2], [1, 9], [1, 2]]


def test_loss_over_policy_tokens_equals_a_hand_computation(tmp_path):
    """Policy tokens with random behaviour logprobs, environment tokens in between (loss mask 0):
    the trainer's loss, IS weights and entropy equal a hand computation over policy tokens only."""
    from transformers import AutoModelForCausalLM

    from asyncrl.services.ops.tinymodel import build_tiny_model

    build_tiny_model(tmp_path, seed=0, hidden_size=32, num_layers=1)
    model = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    prompt = [1, 5, 6]
    samples = [
        episode_sample(0, 1.0, [7, 8, 9, 10, 11, 12], [1, 1, 0, 0, 1, 1], [0] * 6, turn_starts=[0, 4]),
        episode_sample(1, 0.0, [13, 14, 15, 16], [1, 0, 0, 1], [0] * 4, turn_starts=[0, 3]),
        episode_sample(2, 0.5, [17, 18, 19], [1, 1, 1], [0] * 3),
    ]
    g = Group.build(
        group_id="g", job_id="j", prompt_tokens=prompt, reward_spec={}, samples=samples, submit_version=0
    )
    batch = collate(build_rows([g], "dr_grpo").rows, pad_id=0)
    cfg = LossConfig(kind="ppo", agg="token_mean", is_correction="tis", is_high=1.5)
    logprobs, entropy = token_logprobs(model, batch, with_entropy=True)
    # decoupled, π_old = π_θ now: the PPO ratio is 1 and the TIS weight min(π/μ, 1.5) carries the test
    loss, stats = policy_loss(logprobs, logprobs.detach(), batch.behavior_logprobs, batch.advantages,
                              batch.mask, cfg)  # fmt: skip

    mean = (1.0 + 0.0 + 0.5) / 3
    terms, weights, entropies = [], [], []
    for s in samples:
        ids = s.completion_ids.tolist()
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        ent = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
        for t in range(len(ids)):
            if not s.loss_mask[t]:
                continue
            w = min(float(torch.exp(lp[t] - float(s.behavior_logprobs[t]))), 1.5)  # TIS on π_old/μ
            terms.append(-w * (s.reward - mean))  # PPO ratio 1: −w·A
            weights.append(w)
            entropies.append(float(ent[t]))
    assert float(loss.detach()) == pytest.approx(sum(terms) / len(terms), rel=1e-5, abs=1e-6)
    assert stats["tokens"] == len(terms) == 4 + 2 + 3
    assert stats["is_weight_mean"] == pytest.approx(sum(weights) / len(weights), rel=1e-5)
    got_entropy = float((entropy.detach() * batch.mask).sum() / batch.mask.sum())
    assert got_entropy == pytest.approx(sum(entropies) / len(entropies), rel=1e-5)
