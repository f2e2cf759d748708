"""From a `RolloutRequest` to the `GroupJob`s of the jobs stream: tokenization, chat templates,
limits, reward specs, sampling params the engine would refuse, deterministic ids.

Everything a client can get wrong is refused here with a `BadRequest` (→ 4xx) naming the
prompt and the limit, before anything is queued. Ids are deterministic for an idempotency
key, so a replayed request enqueues the same group ids (a no-op in the buffer).

Reward specs: the verifier must be one the reward service lists (`GET /v1/verifiers`), and
its arguments are validated with the verifier's own spec model
(`proto.verifiers.SPECS`, the model the reward service parses them with) when
this build defines that verifier and the reward service publishes the same JSON schema for
it. A verifier this build does not define (a custom one), or one whose published schema
differs (another version), is checked by name only: the reward service judges its arguments
when it scores, and a job whose every group comes back unscored reads `failed`. Limits that
are the reward server's own settings (e.g. the code verifier's `max_tests`) are checked there.

Sampling params: the reference engine (`services/engine`) refuses some of SGLang's
(`proto.sglang.REFERENCE_ENGINE_REFUSES`); when the rollout's engines are reference engines (see
`RolloutService.engine_kind`), those are refused here, at the door, instead of failing every
group at the engine. A real SGLang gets them as sent.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections.abc import Collection, Mapping
from pathlib import Path

from asyncrl.proto import GroupJob
from asyncrl.proto.rewards import RewardSpec
from asyncrl.proto.rollout import RolloutPrompt, RolloutRequest
from asyncrl.proto.sglang import SamplingParams, refused_by_reference_engine
from asyncrl.proto.verifiers import SPECS, SpecError, validate_spec
from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.services.runtime.logging import log_event

log = logging.getLogger(__name__)

MAX_REPORTED = 5  # offending prompt indices named in one error message
REFERENCE_ENGINE = "reference"
SGLANG_ENGINE = "sglang"

# Sampling params the reference engine answers 400 for: `proto.sglang.REFERENCE_ENGINE_REFUSES`,
# the list the engine itself refuses by. `n > 1` is refused for every engine by `RolloutRequest`
# itself: the group size is ours.
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

    def sampling_params(self, request: RolloutRequest, engine_kind: str | None = None) -> dict:
        params = request.sampling_params or SamplingParams()
        check_engine_support(params, engine_kind)
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

    def tokenize(
        self, prompt: RolloutPrompt, tools: list[dict] | None = None, episode: bool = False
    ) -> tuple[list[int], str]:
        """Prompt token ids and the prompt text the reward service sees. `tools` (OpenAI
        function schemas, an episode's environment's) go to the chat template with `messages`.
        An `episode`'s chat is rendered without the generation prompt: the episode appends the
        environment's first observation as a user message, then the assistant header."""
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
                [t.model_dump() for t in prompt.messages],
                tools=tools or None,
                add_generation_prompt=not episode,
                tokenize=False,
            )
            return list(tok(text, add_special_tokens=False)["input_ids"]), text
        assert prompt.text is not None
        return list(tok(prompt.text)["input_ids"]), prompt.text

    def build(
        self,
        request: RolloutRequest,
        job_id: str,
        verifiers: Mapping[str, dict | None] | Collection[str],
        engine_kind: str | None = None,
        tools: list[dict] | None = None,
    ) -> list[GroupJob]:
        """The job's group jobs. `verifiers`: what the reward service serves, name → JSON schema
        of its spec arguments (a bare collection of names: names are checked, not arguments);
        `engine_kind`: `reference`, `sglang` or None (unknown: nothing refused for the engine)."""
        params = self.sampling_params(request, engine_kind)
        check_reward_specs(request.prompts, request.reward_spec, verifiers)
        group_size = request.group_size or self.settings.default_group_size
        now = time.time()
        jobs, too_long = [], []
        for i, prompt in enumerate(request.prompts):
            ids, text = self.tokenize(prompt, tools, episode=request.episode is not None)
            if not ids:
                raise BadRequest(f"prompt {i} is empty after tokenization")
            if len(ids) >= self.context_length:
                too_long.append(f"prompt {i} has {len(ids)} tokens")
                continue
            spec = prompt.reward_spec or request.reward_spec
            spec = spec.model_dump() if spec is not None else {}  # (none: an environment judges the episodes)
            jobs.append(
                GroupJob(
                    job_id=job_id,
                    group_id=f"{job_id}-{i:06d}",
                    prompt_id=prompt.prompt_id or f"{job_id}-p{i}",
                    prompt_tokens=ids,
                    prompt_text=text,
                    group_size=group_size,
                    sampling_params=params,
                    reward_spec=spec,
                    submitted_at=now,
                    episode=request.episode.model_dump() if request.episode is not None else {},
                    chat=request.episode is not None and prompt.messages is not None,
                )
            )
        if too_long:
            raise BadRequest(
                f"{len(too_long)} prompts do not fit the context length {self.context_length} "
                f"(a prompt needs at least one token of room): {'; '.join(too_long[:MAX_REPORTED])}"
            )
        return jobs


def check_engine_support(params: SamplingParams, engine_kind: str | None) -> None:
    """`BadRequest` (400, `unsupported_sampling_params`) naming each set param the engine refuses."""
    if engine_kind != REFERENCE_ENGINE:
        return
    refused = list(refused_by_reference_engine(params))
    if refused:
        raise BadRequest(
            f"sampling_params {', '.join(refused)}: not supported by the reference engine serving this "
            "rollout service (stop strings: use stop_token_ids; a real SGLang engine accepts them)",
            reason="unsupported_sampling_params",
        )


def check_reward_specs(
    prompts: list[RolloutPrompt],
    default: RewardSpec | None,
    verifiers: Mapping[str, dict | None] | Collection[str],
) -> None:
    """`BadRequest` for a verifier the reward service does not serve (400, `unknown_verifier`) or
    arguments its spec model refuses (422, `invalid_reward_spec`, naming prompt and field)."""
    served: Mapping[str, dict | None] = (
        verifiers if isinstance(verifiers, Mapping) else dict.fromkeys(verifiers)
    )
    # A prompt's own spec replaces the job's whole: the job's is checked only if a prompt uses it.
    uses_default = default is not None and any(p.reward_spec is None for p in prompts)
    named = ([("reward_spec", default)] if uses_default else []) + [
        (f"prompts.{i}.reward_spec", p.reward_spec)
        for i, p in enumerate(prompts)
        if p.reward_spec is not None
    ]
    unknown = sorted({spec.verifier for _, spec in named} - set(served))
    if unknown:
        raise BadRequest(
            f"unknown verifier(s) {unknown[:MAX_REPORTED]}; the reward service serves {sorted(served)}",
            reason="unknown_verifier",
        )
    models = {name: _spec_model(name, served[name]) for name in {spec.verifier for _, spec in named}}
    problems: list[str] = []
    bad = 0
    for where, spec in named:
        model = models[spec.verifier]
        if model is None:
            continue
        try:
            validate_spec(model, spec.args())
        except SpecError as exc:
            bad += 1
            if len(problems) < MAX_REPORTED:
                problems += [f"{where}.{field}: {msg} ({spec.verifier})" for field, msg in exc.problems]
    if bad:
        more = f" ({bad} invalid specs in all)" if bad > 1 else ""
        raise BadRequest(
            f"invalid reward_spec: {'; '.join(problems[:MAX_REPORTED])}{more}",
            status=422,
            reason="invalid_reward_spec",
        )


_skewed: set[str] = set()  # verifiers whose published schema differs from ours, logged once each


def _spec_model(name: str, published: dict | None):
    """The spec model to check `name`'s arguments with here, or None (checked by name only)."""
    model = SPECS.get(name)
    if model is None or published is None:
        return None
    if model.model_json_schema() != published:
        if name not in _skewed:
            _skewed.add(name)
            log_event(
                log,
                "reward service publishes another spec schema; its arguments are checked when scored",
                logging.WARNING,
                verifier=name,
            )
        return None
    return model
