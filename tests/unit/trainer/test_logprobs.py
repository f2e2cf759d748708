"""Log-probs and entropy from hidden states (trainer/logprobs.py), packed micro-batches and
activation checkpointing: each must give today's unchunked, padded, uncheckpointed result.

Single process on plain (unsharded) tiny models; the same equivalences under FSDP2 on 2 gloo
ranks are in tests/integration/trainer/test_parity.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from factories import make_sample

from asyncrl.proto import Group
from asyncrl.trainer.batch import (
    build_rows,
    collate,
    collate_packed,
    collate_shared,
    micro_batches,
    token_logprobs,
)
from asyncrl.trainer.logprobs import check_linear_head, head_logprobs
from asyncrl.trainer.losses import LossConfig, aggregate, entropy_bonus, kl_penalty, policy_loss
from asyncrl.trainer.step import StepConfig, policy_step, recompute_logprobs

CPU = torch.device("cpu")


def _head_case(seed=0, k=37, d=16, v=50, bias=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(k, d, generator=g, dtype=dtype)
    w = torch.randn(v, d, generator=g, dtype=dtype) / d**0.5
    b = torch.randn(v, generator=g, dtype=dtype) if bias else None
    y = torch.randint(0, v, (k,), generator=g)
    return h, w, b, y


def _grads(h, w, b, y, chunk, temperature, weights):
    leaves = [t.clone().requires_grad_(True) for t in (h, w) + ((b,) if b is not None else ())]
    lp, ent = head_logprobs(
        leaves[0], leaves[1], leaves[2] if b is not None else None, y, temperature, chunk, True
    )
    loss = (lp * weights[0]).sum() + (ent * weights[1]).sum()
    loss.backward()
    return lp.detach(), ent.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("chunk", [1, 5, 16, 37, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_head_equals_full_logits_values_and_grads(chunk, bias):
    h, w, b, y = _head_case(bias=bias)
    g = torch.Generator().manual_seed(1)
    weights = (torch.randn(37, generator=g), torch.randn(37, generator=g))
    lp0, ent0, grads0 = _grads(h, w, b, y, 0, 0.7, weights)
    lp1, ent1, grads1 = _grads(h, w, b, y, chunk, 0.7, weights)
    torch.testing.assert_close(lp1, lp0, rtol=0, atol=1e-5)
    torch.testing.assert_close(ent1, ent0, rtol=0, atol=1e-5)
    for a, c in zip(grads1, grads0):
        assert c.abs().max() > 1e-3  # the gradient is not trivially zero
        torch.testing.assert_close(a, c, rtol=0, atol=1e-5)


def test_chunked_head_matches_a_float64_reference():
    """Not just self-consistent: the fp32 chunked values and grads are the float64 softmax's."""
    h, w, _, y = _head_case(seed=3, k=20, v=300)
    weights = (torch.ones(20), torch.full((20,), 0.3))
    lp, ent, (gh, gw) = _grads(h, w, None, y, 6, 1.3, weights)
    h64, w64 = h.double().requires_grad_(True), w.double().requires_grad_(True)
    logp = torch.log_softmax(h64 @ w64.t() / 1.3, -1)
    lp64, ent64 = logp.gather(-1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    (lp64.sum() + 0.3 * ent64.sum()).backward()
    torch.testing.assert_close(lp.double(), lp64.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(ent.double(), ent64.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(gh.double(), h64.grad, rtol=0, atol=1e-5)
    torch.testing.assert_close(gw.double(), w64.grad, rtol=0, atol=1e-5)


def test_chunked_head_entropy_only_or_logprob_only_gradients():
    h, w, _, y = _head_case(seed=2)
    for weights in ((torch.ones(37), torch.zeros(37)), (torch.zeros(37), torch.ones(37))):
        _, _, g0 = _grads(h, w, None, y, 0, 1.0, weights)
        _, _, g1 = _grads(h, w, None, y, 7, 1.0, weights)
        for a, c in zip(g1, g0):
            torch.testing.assert_close(a, c, rtol=0, atol=1e-5)
    # no entropy asked: None, and the log-prob gradient alone
    hh = h.clone().requires_grad_(True)
    lp, ent = head_logprobs(hh, w, None, y, 1.0, 7, False)
    assert ent is None
    lp.sum().backward()
    _, _, (gh, _) = _grads(h, w, None, y, 0, 1.0, (torch.ones(37), torch.zeros(37)))
    torch.testing.assert_close(hh.grad, gh, rtol=0, atol=1e-5)


def test_an_unused_entropy_costs_no_backward_and_changes_nothing():
    """Asked for but not in the loss: its gradient is None (not zeros) and dh, dW are log-prob's."""
    h, w, _, y = _head_case(seed=5)
    grads = []
    for with_entropy in (True, False):
        hh, ww = h.clone().requires_grad_(True), w.clone().requires_grad_(True)
        lp, _ = head_logprobs(hh, ww, None, y, 1.0, 6, with_entropy)
        (lp * torch.linspace(-1, 1, 37)).sum().backward()
        grads.append((hh.grad, ww.grad))
    for a, c in zip(*grads):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_empty_selection_gives_empty_outputs_and_zero_grads():
    h, w, _, y = _head_case()
    hh, ww = h[:0].clone().requires_grad_(True), w.clone().requires_grad_(True)
    lp, ent = head_logprobs(hh, ww, None, y[:0], 1.0, 4, True)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()
    assert ww.grad is not None and float(ww.grad.abs().max()) == 0.0


def test_bf16_compute_keeps_fp32_softmax_and_matches_fp32_within_bf16_error():
    """The documented numeric path: matmul in the compute dtype, log-softmax and entropy in fp32."""
    h, w, _, y = _head_case(seed=4, k=24, d=32, v=500)
    lp32, ent32 = head_logprobs(h, w, None, y, 1.0, 0, True)
    hb, wb = h.bfloat16(), w.bfloat16()
    full = head_logprobs(hb, wb, None, y, 1.0, 0, True)
    chunked = head_logprobs(hb, wb, None, y, 1.0, 5, True)
    for lp, ent in (full, chunked):
        assert lp.dtype == ent.dtype == torch.float32
        torch.testing.assert_close(lp, lp32, rtol=0, atol=0.1)  # bf16 logits: ~3 significant digits
        torch.testing.assert_close(ent, ent32, rtol=0, atol=0.1)
    torch.testing.assert_close(chunked[0], full[0], rtol=0, atol=1e-5)  # chunking changes nothing
    assert float((full[0] - lp32).abs().max()) > 0  # it really ran in bf16
    hb.requires_grad_(True)
    head_logprobs(hb, wb.requires_grad_(True), None, y, 1.0, 5, True)[0].sum().backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16


def test_models_with_a_non_linear_head_are_refused(tiny):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    check_linear_head(model)
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        check_linear_head(model)
    model.config.final_logit_softcapping = None
    model.config.scale_width = True  # MiniCPM scales the hidden state before its head
    with pytest.raises(ValueError, match="scale_width"):
        check_linear_head(model)


# ---------------------------------------------------------------- whole model: losses, packing, checkpointing
def _groups(seed=0, n_groups=3, n=4) -> list[Group]:
    """Groups of varied prompt and answer lengths (what packing and padding must agree on)."""
    rng = np.random.default_rng(seed)
    groups = []
    for gi in range(n_groups):
        prompt = np.array([1, *rng.integers(3, 40, int(rng.integers(2, 9)))], np.int32)
        samples = [make_sample(f"p{gi}", i, n_tokens=int(rng.integers(1, 12)), reward=float(rng.integers(0, 3)),
                               seed=seed * 100 + gi * 10 + i) for i in range(n)]  # fmt: skip
        groups.append(Group.build(group_id=f"g{gi}", job_id="j", prompt_tokens=prompt, reward_spec={"verifier": "reverse"},
                                  samples=samples, submit_version=0))  # fmt: skip
    return groups


def _model(path, checkpointing=False):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if checkpointing:
        from asyncrl.trainer.model import enable_activation_checkpointing

        enable_activation_checkpointing(model)
    model.train()
    return model


def _param_grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


LOSSES = [LossConfig(kind="ppo"), LossConfig(kind="gspo", agg="seq_mean_token_mean"), LossConfig(kind="cispo"),
          LossConfig(kind="ppo", agg="seq_mean_token_sum_norm", max_tokens=16, is_correction="geo_mask")]  # fmt: skip


@pytest.mark.parametrize("loss_cfg", LOSSES, ids=lambda c: f"{c.kind}-{c.agg}")
def test_every_loss_term_has_the_unchunked_gradient(tiny, loss_cfg):
    """Policy loss + entropy bonus + KL to a reference model, chunked vs all logits at once."""
    rows = build_rows(_groups(), "grpo").rows
    batch = collate(rows, pad_id=0)
    ref_lp, _ = token_logprobs(_model(tiny), batch)  # a "reference model": the same weights, detached
    ref_lp = ref_lp.detach() - 0.05
    out = []
    for chunk in (0, 7):
        model = _model(tiny)
        lp, ent = token_logprobs(model, batch, 0.9, with_entropy=True, chunk_tokens=chunk)
        loss, _ = policy_loss(
            lp, lp.detach() + 0.1, batch.behavior_logprobs, batch.advantages, batch.mask, loss_cfg
        )
        loss = loss + entropy_bonus(ent, batch.mask, 0.01) + 0.1 * aggregate(kl_penalty(lp, ref_lp, batch.mask),
                                                                               batch.mask, "token_mean")  # fmt: skip
        loss.backward()
        out.append((float(loss.detach()), _param_grads(model)))
    assert out[0][0] == pytest.approx(out[1][0], abs=1e-6)
    assert out[0][1].keys() == out[1][1].keys()
    for name, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][name], g, rtol=0, atol=1e-5, msg=name)
    assert max(float(g.abs().max()) for g in out[0][1].values()) > 1e-3


def _step(path, micro, loss_cfg, checkpointing=False, chunk=0):
    torch.manual_seed(0)
    model = _model(path, checkpointing)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = StepConfig(loss=loss_cfg, grad_clip=1e9, entropy_coef=0.01, chunk_tokens=chunk)
    stats = policy_step(model, opt, micro, [None] * len(micro), [None] * len(micro), cfg, CPU)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), stats


AGGS = [LossConfig(agg="token_mean"), LossConfig(agg="seq_mean_token_mean"),
        LossConfig(agg="seq_mean_token_sum_norm", max_tokens=12), LossConfig(kind="gspo")]  # fmt: skip


@pytest.mark.parametrize("loss_cfg", AGGS, ids=lambda c: f"{c.kind}-{c.agg}")
def test_packed_micro_batches_give_the_padded_update(tiny, loss_cfg):
    rows = build_rows(_groups(seed=5), "grpo").rows
    padded = micro_batches(rows, 0, 1, 1, 4, 0, CPU)
    base, stats0 = _step(tiny, padded, loss_cfg)
    before = torch.cat([p.detach().flatten() for p in _model(tiny).parameters()])
    assert (base - before).abs().max() > 1e-4  # the step moved the weights
    for budget in (24, 64, 10_000):
        packed = micro_batches(rows, 0, 1, 1, 4, 0, CPU, max_tokens=budget)
        assert all(b.packed and b.input_ids.shape[0] == 1 for b in packed)
        assert sum(b.real_rows for b in packed) == len(rows)
        after, stats1 = _step(tiny, packed, loss_cfg)
        torch.testing.assert_close(after, base, rtol=0, atol=1e-5)
        assert stats1["loss"] == pytest.approx(stats0["loss"], abs=1e-6)
        assert stats1["entropy"] == pytest.approx(stats0["entropy"], abs=1e-5)
    assert len(micro_batches(rows, 0, 1, 1, 4, 0, CPU, max_tokens=24)) > len(
        padded
    )  # small budgets: more bins


@pytest.mark.parametrize("loss_cfg", AGGS, ids=lambda c: f"{c.kind}-{c.agg}")
def test_shared_prompt_micro_batches_give_the_padded_update(tiny, loss_cfg):
    """One row per prompt, completions under a tree mask: the padded layout's update, loss and
    entropy, with fewer positions computed (each prompt once, no last completion token)."""
    rows = build_rows(_groups(seed=5, n_groups=4, n=5), "grpo").rows
    base, stats0 = _step(tiny, micro_batches(rows, 0, 1, 1, 6, 0, CPU), loss_cfg)
    for micro in (3, 6, 100):  # groups split across micro-batches, and all in one
        shared = micro_batches(rows, 0, 1, 1, micro, 0, CPU, share_prompts=True)
        assert sum(b.real_rows for b in shared) == len(rows)
        assert all(b.attention_mask.dim() == 4 for b in shared)
        after, stats1 = _step(tiny, shared, loss_cfg)
        torch.testing.assert_close(after, base, rtol=0, atol=1e-5)
        assert stats1["loss"] == pytest.approx(stats0["loss"], abs=1e-6)
        assert stats1["entropy"] == pytest.approx(stats0["entropy"], abs=1e-5)
    [whole] = micro_batches(rows, 0, 1, 1, 100, 0, CPU, share_prompts=True)
    assert whole.input_ids.shape[0] == 4  # one row per group
    computed = sum(len(r.prompt_tokens) + len(r.completion_ids) for r in rows)
    assert whole.input_ids.shape[1] * 4 < computed


def test_shared_prompt_rows_give_each_sample_its_own_logprobs(tiny):
    """A sample's log-probs and entropy in a shared row are its own alone, whatever shares the
    prompt with it (including a one-token answer, an empty tree of rank filler, and two groups
    of one prompt)."""
    groups = _groups(seed=6, n_groups=3, n=4)
    groups[2] = Group.build(group_id="twin", job_id="j", prompt_tokens=groups[0].prompt_tokens,
                            reward_spec={"verifier": "reverse"}, samples=groups[2].samples, submit_version=0)  # fmt: skip
    rows = build_rows(groups, "grpo").rows
    rows[1].completion_ids = rows[1].completion_ids[:1]
    rows[1].behavior_logprobs = rows[1].behavior_logprobs[:1]
    model = _model(tiny)
    alone = [token_logprobs(model, collate([r], 0), with_entropy=True) for r in rows]
    batch = collate_shared([*rows, None], 0)
    assert batch.input_ids.shape[0] == 3 and batch.real_rows == len(rows)  # 2 prompts + the filler
    lp, ent = token_logprobs(model, batch, with_entropy=True)
    for i, (want_lp, want_ent) in enumerate(alone):
        n = len(rows[i].completion_ids)
        torch.testing.assert_close(lp[i, :n], want_lp[0, :n], rtol=0, atol=1e-5)
        torch.testing.assert_close(ent[i, :n], want_ent[0, :n], rtol=0, atol=1e-5)
        assert not batch.present[i, n:].any()


def test_share_prompts_and_packing_are_exclusive():
    from pydantic import ValidationError

    from asyncrl.trainer.config import TrainerSettings

    assert TrainerSettings(run="r", model_path="m", share_prompts=True).share_prompts
    with pytest.raises(ValidationError, match="set one of share_prompts, max_tokens_per_micro_batch"):
        TrainerSettings(run="r", model_path="m", share_prompts=True, max_tokens_per_micro_batch=64)


def test_packed_minibatches_each_hold_their_own_rows(tiny):
    """minibatches > 1 with uneven bins: every minibatch gets as many (empty-padded) bins, so each
    optimizer step trains exactly its rows, as the padded layout does."""
    rows = build_rows(_groups(seed=5), "grpo").rows
    for budget in (18, 30):
        packed = micro_batches(rows, 0, 1, 2, 4, 0, CPU, max_tokens=budget)
        half = len(packed) // 2
        assert len(packed) % 2 == 0
        assert (
            sum(b.real_rows for b in packed[:half])
            == sum(b.real_rows for b in packed[half:])
            == len(rows) // 2
        )
        for cfg_minibatches in (2,):
            base, _ = _step_mb(tiny, micro_batches(rows, 0, 1, 2, 4, 0, CPU), cfg_minibatches)
            after, _ = _step_mb(tiny, packed, cfg_minibatches)
            torch.testing.assert_close(after, base, rtol=0, atol=1e-5)
    one = micro_batches(rows[:1], 0, 1, 2, 4, 0, CPU, max_tokens=64)  # one row, two minibatches
    assert len(one) == 2 and [b.real_rows for b in one] == [1, 0]
    with pytest.raises(ValueError, match="equal minibatches"):
        _step_mb(tiny, one[:1] + one, 2)


def _step_mb(path, micro, minibatches):
    torch.manual_seed(0)
    model = _model(path)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    cfg = StepConfig(loss=LossConfig(), grad_clip=1e9, minibatches=minibatches, chunk_tokens=5)
    old = recompute_logprobs(model, micro, 1.0, 5)
    stats = policy_step(model, opt, micro, old, [None] * len(micro), cfg, CPU)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), stats


def test_packed_attention_never_crosses_samples(tiny):
    """A sample's log-probs in a pack are its log-probs alone, whatever is packed before it."""
    rows = build_rows(_groups(seed=6), "grpo").rows
    model = _model(tiny)
    alone = [token_logprobs(model, collate([r], 0))[0][0] for r in rows[:4]]
    packed, _ = token_logprobs(model, collate_packed(rows[:4], 0))
    for i, lp in enumerate(alone):
        torch.testing.assert_close(packed[i, : len(lp)], lp, rtol=0, atol=1e-5)
    shuffled, _ = token_logprobs(model, collate_packed(rows[:4][::-1], 0))
    torch.testing.assert_close(shuffled.flip(0), packed, rtol=0, atol=1e-5)


def test_activation_checkpointing_gives_the_same_update(tiny):
    rows = build_rows(_groups(seed=7), "grpo").rows
    for layout in (
        micro_batches(rows, 0, 1, 1, 5, 0, CPU),
        micro_batches(rows, 0, 1, 1, 5, 0, CPU, max_tokens=40),
    ):
        base, _ = _step(tiny, layout, LossConfig(), chunk=4)
        after, _ = _step(tiny, layout, LossConfig(), checkpointing=True, chunk=4)
        torch.testing.assert_close(after, base, rtol=0, atol=1e-6)
    calls = {}
    for checkpointing in (False, True):  # the recompute really runs: a layer's MLP twice per micro-batch
        model = _model(tiny, checkpointing)
        mlp, calls[checkpointing] = model.model.layers[0].mlp, 0
        forward = mlp.forward  # (module hooks do not fire in a checkpoint's recompute: count the calls)

        def counted(*args, _forward=forward, _key=checkpointing, **kwargs):
            calls[_key] += 1
            return _forward(*args, **kwargs)

        mlp.forward = counted
        lp, _ = token_logprobs(model, collate(rows, 0), chunk_tokens=4)
        lp.sum().backward()
    assert calls == {False: 1, True: 2}


def test_segment_attention_is_causal_attention_within_each_sample():
    from asyncrl.trainer.attention import segment_attention, segment_bounds

    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert segment_bounds(positions[0]) == [(0, 3), (3, 5), (5, 9)]
    g = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, h, 9, 8, generator=g) for h in (4, 2, 2)
    )  # GQA: 4 query heads, 2 key/value heads
    out, _ = segment_attention(torch.nn.Module(), q, k, v, None, scaling=0.3, position_ids=positions)
    assert out.shape == (1, 9, 4, 8)
    for s, e in segment_bounds(positions[0]):  # eager reference, one sample at a time
        kk, vv = k[0, :, s:e].repeat_interleave(2, 0), v[0, :, s:e].repeat_interleave(2, 0)
        scores = q[0, :, s:e] @ kk.transpose(-1, -2) * 0.3
        scores = scores.masked_fill(torch.ones(e - s, e - s, dtype=torch.bool).triu(1), float("-inf"))
        want = torch.softmax(scores, -1) @ vv
        torch.testing.assert_close(out[0, s:e].transpose(0, 1), want, rtol=0, atol=1e-5)


def test_segment_attention_model_gives_each_sample_its_own_logprobs(tiny):
    from asyncrl.trainer.attention import NAME, use_segment_attention

    rows = build_rows(_groups(seed=8), "grpo").rows
    plain, seg = _model(tiny), _model(tiny)
    use_segment_attention(seg)
    assert seg.config._attn_implementation == NAME and plain.config._attn_implementation == "sdpa"
    want, _ = token_logprobs(plain, collate(rows, 0))
    torch.testing.assert_close(token_logprobs(seg, collate_packed(rows, 0))[0], want, rtol=0, atol=1e-5)
    torch.testing.assert_close(
        token_logprobs(seg, collate(rows, 0))[0], want, rtol=0, atol=1e-5
    )  # padded: SDPA


def test_sliding_window_stays_inside_each_packed_sample(tmp_path):
    """A sliding-window model (Mistral) packed: each sample sees only its own last `window` keys."""
    from transformers import MistralConfig, MistralForCausalLM

    from asyncrl.trainer.attention import use_segment_attention

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=8, sliding_window=3, max_position_embeddings=64)  # fmt: skip
    MistralForCausalLM(cfg).save_pretrained(tmp_path)
    plain, seg = _model(tmp_path), _model(tmp_path)
    use_segment_attention(seg)
    rows = [
        r
        for r in build_rows(_groups(seed=9), "grpo").rows
        if len(r.prompt_tokens) + len(r.completion_ids) > 6
    ]
    assert len(rows) >= 3
    want = torch.cat(
        [token_logprobs(plain, collate([r], 0))[0] for r in rows[:1]]
    )  # alone: transformers' own window
    got, _ = token_logprobs(seg, collate_packed(rows, 0))
    torch.testing.assert_close(got[0, : want.shape[1]], want[0], rtol=0, atol=1e-5)
    for i, r in enumerate(rows):
        alone, _ = token_logprobs(plain, collate([r], 0))
        torch.testing.assert_close(got[i, : alone.shape[1]], alone[0], rtol=0, atol=1e-5)
    seg.config.sliding_window = 10_000  # the window mattered: without it the log-probs differ
    assert (token_logprobs(seg, collate_packed(rows, 0))[0] - got).abs().max() > 1e-3
