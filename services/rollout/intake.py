"""From a `RolloutRequest` to the `GroupJob`s of the jobs stream: tokenization, chat templates,
limits, reward specs, deterministic ids.

Everything a client can get wrong is refused here with a `BadRequest` (→ 4xx) naming the
prompt and the limit, before anything is queued. Ids are deterministic for an idempotency
key, so a replayed request enqueues the same group ids (a no-op in the buffer).
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from pathlib import Path

from proto import GroupJob
from proto.rollout import RolloutPrompt, RolloutRequest
from proto.sglang import SamplingParams
from services.rollout.config import RolloutSettings

MAX_REPORTED = 5  # offending prompt indices named in one error message
UNBOUNDED_TOKENIZER_LENGTH = (
    10**7
)  # HF's "no limit" sentinel is ~1e30; anything above this is not a real limit


class BadRequest(Exception):
    def __init__(self, message: str, status: int = 400, reason: str = "invalid_input"):
        super().__init__(message)
        self.status, self.reason = status, reason


def resolve_context_length(settings: RolloutSettings, tokenizer) -> int:
    if settings.context_length:
        return settings.context_length
    config = Path(settings.tokenizer) / "config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("max_position_embeddings")
        if isinstance(value, int) and value > 1:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 1 < limit < UNBOUNDED_TOKENIZER_LENGTH:
        return limit
    raise ValueError("cannot tell the model's context length; set context_length")


def job_id_for(run: str, request: RolloutRequest) -> str:
    if request.idempotency_key is None:
        return f"j{uuid.uuid4().hex[:20]}"
    return "j" + hashlib.sha256(f"{run}\0{request.idempotency_key}".encode()).hexdigest()[:20]


def body_hash(request: RolloutRequest) -> str:
    """What the idempotency key promises stays the same: the body without the key."""
    return hashlib.sha256(request.model_dump_json(exclude={"idempotency_key"}).encode()).hexdigest()[:32]


class Intake:
    def __init__(self, settings: RolloutSettings, tokenizer, context_length: int):
        self.settings = settings
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.vocab_size = len(tokenizer)

    def sampling_params(self, request: RolloutRequest) -> dict:
        params = request.sampling_params or SamplingParams()
        out = params.model_dump(exclude_unset=True, exclude_none=True, by_alias=False)
        out["max_new_tokens"] = (
            params.max_new_tokens if "max_new_tokens" in out else self.settings.default_max_new_tokens
        )
        if out["max_new_tokens"] > self.settings.max_new_tokens_cap:
            raise BadRequest(
                f"max_new_tokens {out['max_new_tokens']} exceeds the cap {self.settings.max_new_tokens_cap}"
            )
        if out["max_new_tokens"] < 1:
            raise BadRequest("max_new_tokens must be at least 1")
        return out

    def tokenize(self, prompt: RolloutPrompt) -> tuple[list[int], str]:
        """Prompt token ids and the prompt text the reward service sees."""
        tok = self.tokenizer
        if prompt.input_ids is not None:
            bad = [t for t in prompt.input_ids if t >= self.vocab_size]
            if bad:
                raise BadRequest(
                    f"input_ids {bad[:MAX_REPORTED]} are outside the vocabulary [0, {self.vocab_size})"
                )
            return list(prompt.input_ids), tok.decode(prompt.input_ids, skip_special_tokens=True)
        if prompt.messages is not None:
            if not getattr(tok, "chat_template", None):
                raise BadRequest("the model's tokenizer has no chat template; send text or input_ids")
            text = tok.apply_chat_template(
                [t.model_dump() for t in prompt.messages], add_generation_prompt=True, tokenize=False
            )
            return list(tok(text, add_special_tokens=False)["input_ids"]), text
        assert prompt.text is not None
        return list(tok(prompt.text)["input_ids"]), prompt.text

    def build(self, request: RolloutRequest, job_id: str, verifiers: frozenset[str]) -> list[GroupJob]:
        params = self.sampling_params(request)
        group_size = request.group_size or self.settings.default_group_size
        now = time.time()
        jobs, too_long, unknown = [], [], set()
        for i, prompt in enumerate(request.prompts):
            ids, text = self.tokenize(prompt)
            if not ids:
                raise BadRequest(f"prompt {i} is empty after tokenization")
            if len(ids) >= self.context_length:
                too_long.append(f"prompt {i} has {len(ids)} tokens")
                continue
            spec = (prompt.reward_spec or request.reward_spec).model_dump()  # type: ignore[union-attr]
            if spec["verifier"] not in verifiers:
                unknown.add(spec["verifier"])
            jobs.append(
                GroupJob(
                    job_id=job_id,
                    group_id=f"{job_id}-{i:06d}",
                    prompt_id=prompt.prompt_id or f"{job_id}-p{i}",
                    prompt_ids=ids,
                    prompt_text=text,
                    group_size=group_size,
                    sampling_params=params,
                    reward_spec=spec,
                    submitted_at=now,
                )
            )
        if too_long:
            raise BadRequest(
                f"{len(too_long)} prompts do not fit the context length {self.context_length} "
                f"(a prompt needs at least one token of room): {'; '.join(too_long[:MAX_REPORTED])}"
            )
        if unknown:
            raise BadRequest(
                f"unknown verifier(s) {sorted(unknown)}; the reward service serves {sorted(verifiers)}",
                reason="unknown_verifier",
            )
        return jobs
