"""Per-token log-probabilities and entropy from the last hidden state, without the full logits.

Every loss in trainer/losses.py, the log π_old recompute and the reference model's KL need, per
completion token t, log π(y_t) = z[y_t] − logsumexp(z) and (bonus and metric) the entropy
H = logsumexp(z) − Σ p·z, with z = h·Wᵀ / τ over the whole vocabulary. Materialising z for a
batch costs K·V floats (Qwen's 151,936 tokens: ~0.6 GB per 1,000 tokens in fp32, and autograd
keeps the softmax too). `head_logprobs(..., chunk_tokens=c)` computes c tokens at a time and
keeps only h, W and the targets for backward, where each chunk's logits are computed again and
turned straight into the gradients of h and W: the logits' peak is c·V, not K·V (the idea of
Liger's fused linear cross-entropy and torchtitan's loss chunking, applied to log-probs and
entropy). `chunk_tokens=0` is the plain autograd path, kept as the reference.

Numerics (both paths, any compute dtype): the h·Wᵀ matmul runs in the compute dtype (bf16 on GPU
under FSDP2 mixed precision, whose master weights stay fp32), everything after it in fp32:
temperature, logsumexp, softmax, entropy. The chunked backward runs dW's GEMM per chunk in the compute dtype and sums
the chunks in an fp32 buffer ([V, d], cast once at the end).

Positions: the model runs over `input_ids` laid out padded ([N, L] with a padding mask) or
packed ([1, ΣL] with position ids restarting at 0 per sample); `flat_index` [K] picks the K
hidden states that predict a completion token (only those reach the LM head, never the prompt
or padding), `targets` [K] are those tokens.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

SUPPORTED_HEAD = "a linear LM head (no logit soft-capping or scaling)"


def _logits(h: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    """fp32 logits / τ of a chunk of hidden states (matmul in the compute dtype)."""
    z = h @ weight.t()
    if bias is not None:
        z += bias
    z = z.float()  # a no-op in fp32
    if temperature != 1.0:
        z /= temperature  # in place: no second [c, V] buffer
    return z


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_j a_ij · b_ij per row as a batched matmul: no [c, V] product in memory."""
    return (a[:, None, :] @ b[:, :, None]).flatten()


def _shifted_softmax(z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(z − max z in place, softmax(z), log Σ e^(z − max z)) with two [c, V] buffers, not four."""
    z -= z.max(dim=-1, keepdim=True).values
    p = z.exp()
    total = p.sum(dim=-1)
    p /= total[:, None]
    return z, p, total.log()


class _ChunkedHead(torch.autograd.Function):
    """(h [K, d], W [V, d], b [V] | None, y [K]) → (log p(y) [K], entropy [K]), c tokens at a time.

    The [c, V] passes are written in place: at a small hidden size they, not the matmuls, are
    most of the head's time."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy):
        k = hidden.shape[0]
        lp = torch.empty(k, dtype=torch.float32, device=hidden.device)
        ent = torch.empty(k if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        for s in range(0, k, chunk):
            z, p, log_sum = _shifted_softmax(_logits(hidden[s : s + chunk], weight, bias, temperature))
            lp[s : s + chunk] = z.gather(-1, targets[s : s + chunk, None])[:, 0] - log_sum
            if with_entropy:  # H = −Σ p·log p = log Σ e^z' − Σ p·z'  (z' = z − max z)
                ent[s : s + chunk] = log_sum - _rowdot(p, z)
            del z, p  # before the next chunk's: never two chunks' logits alive at once
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.temperature, ctx.chunk, ctx.with_entropy = temperature, chunk, with_entropy
        ctx.set_materialize_grads(False)  # an output the loss does not use comes back as None: no work for it
        return lp, ent

    @staticmethod
    def backward(ctx, grad_lp, grad_ent):
        hidden, weight, bias, targets = ctx.saved_tensors
        t, chunk = ctx.temperature, ctx.chunk
        use_ent = ctx.with_entropy and grad_ent is not None
        if grad_lp is None and not use_ent:
            return None, None, None, None, None, None, None
        if grad_lp is None:
            grad_lp = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = (
            torch.zeros(weight.shape[0], dtype=torch.float32, device=weight.device)
            if bias is not None
            else None
        )
        for s in range(0, hidden.shape[0], chunk):
            h, y, g_lp = hidden[s : s + chunk], targets[s : s + chunk, None], grad_lp[s : s + chunk, None]
            logp, p, log_sum = _shifted_softmax(_logits(h, weight, bias, t))
            logp -= log_sum[:, None]
            # dL/dz = g_lp · (onehot(y) − p) + g_H · (−p · (log p + H)), written into logp's memory
            if use_ent:
                entropy = -_rowdot(p, logp)
                g = logp.add_(entropy[:, None]).mul_(p).mul_(-grad_ent[s : s + chunk, None])
                g.addcmul_(p, g_lp, value=-1.0)
            else:
                g = p.mul_(-g_lp)
            g.scatter_add_(-1, y, g_lp)
            g /= t  # z = raw / τ
            grad_h[s : s + chunk] = (g.to(weight.dtype) @ weight).to(hidden.dtype)
            if weight.dtype == torch.float32:
                grad_w.addmm_(g.t(), h)
            else:  # the GEMM in the compute dtype (fp32 accumulation inside it), the chunks summed in fp32
                grad_w += g.to(weight.dtype).t() @ h
            if grad_b is not None:
                grad_b += g.sum(0)
            del logp, p, g
        grad_b = grad_b.to(bias.dtype) if grad_b is not None else None
        return grad_h, grad_w.to(weight.dtype), grad_b, None, None, None, None


def head_logprobs(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_tokens: int = 0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """log π(targets) [K] and, if asked, the entropy [K] of hidden states [K, d] through an LM
    head (W [V, d], optional bias), both fp32. `chunk_tokens` > 0 never holds more than that many
    tokens' logits (forward or backward); 0 builds them all (plain autograd)."""
    if chunk_tokens > 0:
        lp, ent = _ChunkedHead.apply(hidden, weight, bias, targets, temperature, chunk_tokens, with_entropy)
        return lp, (ent if with_entropy else None)
    logp = torch.log_softmax(_logits(hidden, weight, bias, temperature), dim=-1)
    lp = logp.gather(-1, targets[:, None])[:, 0]
    return lp, (-(logp.exp() * logp).sum(-1) if with_entropy else None)


def check_linear_head(model: nn.Module) -> None:
    """Refuse models whose logits are not `lm_head(h)`: computing them from the hidden state
    here would silently drop their soft-capping or scaling."""
    config = getattr(model, "config", None)
    for attr in (
        "final_logit_softcapping",
        "logit_scale",
        "output_multiplier_scale",
        "logits_scaling",
        "lm_head_multiplier",
        "scale_width",
    ):
        value = getattr(config, attr, None)
        if value is True or (value is not None and value is not False and value != 1):  # True == 1 in Python
            raise ValueError(
                f"{type(model).__name__} sets {attr}={value}: the trainer supports {SUPPORTED_HEAD}"
            )
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"{type(model).__name__}'s output embedding is {type(head).__name__}: the trainer supports "
            f"{SUPPORTED_HEAD}"
        )


def policy_logprobs(
    model: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    flat_index: Tensor,
    targets: Tensor,
    temperature: float,
    chunk_tokens: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """The decoder's last hidden state at `flat_index` (into the flattened [rows · L] positions)
    through the LM head. A method of the model under FSDP2 (`install`), so the root's parameters
    (embeddings, final norm, head) are gathered for it like for `forward`."""
    out = model.get_decoder()(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
    )
    hidden = out.last_hidden_state
    picked = hidden.reshape(-1, hidden.shape[-1]).index_select(0, flat_index)
    head = model.get_output_embeddings()
    return head_logprobs(picked, head.weight, head.bias, targets, temperature, chunk_tokens, with_entropy)


METHOD = "asyncrl_logprobs"


def install(model: nn.Module) -> None:
    """Attach `policy_logprobs` as a forward method of `model` (registered with FSDP2 when the
    model is sharded: the root's all-gather and reduce-scatter hooks then run around it)."""
    from torch.distributed.fsdp import register_fsdp_forward_method

    check_linear_head(model)
    setattr(model, METHOD, types.MethodType(policy_logprobs, model))
    register_fsdp_forward_method(model, METHOD)


def model_logprobs(model: nn.Module, *args) -> tuple[Tensor, Tensor | None]:
    """`policy_logprobs` through the model's installed method (FSDP hooks), or directly for a
    plain, unsharded model."""
    method = getattr(model, METHOD, None)
    return method(*args) if method is not None else policy_logprobs(model, *args)
