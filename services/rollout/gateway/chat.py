"""The OpenAI-compatible gateway (docs/architecture.md §12): any agent that speaks the OpenAI chat API can be
trained, unmodified, by pointing its client at the rollout service.

    POST /v1/sessions                  {group_id?, group_size, prompt_id?, reward_spec?} → session
    POST /v1/chat/completions          OpenAI body; session from `X-AsyncRL-Session` or `session_id`
    POST /v1/sessions/{id}/v1/chat/completions   the same, the session in the URL (base_url alone
                                       suffices), created on first use: group `X-AsyncRL-Group`
                                       of `X-AsyncRL-Group-Size` (default: its own group of 1)
    POST /v1/sessions/{id}/reward      {reward} (or the session's reward_spec scores it) → closed
    DELETE /v1/sessions/{id}           abandon: the session's whole group is dropped, its slot freed
    GET /v1/models                     the policy, in OpenAI's list shape (also under the session URL)

A chat call renders the messages with the policy's chat template, generates on an engine
through the rollout's `EngineClient` (partial rollouts across weight updates, as the scheduler's
groups) and answers a `chat.completion` (hermes `<tool_call>` text becomes `tool_calls`).
`tool_choice` required (or LangChain's any) and a named function are forced without constrained
decoding: the assistant turn is prefilled with the hermes opening (and the function's name), as
part of the prompt, so the model's own tokens are still what is recorded and the prefill is never
trained on (it was not sampled: it has no behaviour logprob). `response_format` json_object /
json_schema becomes SGLang's `sampling_params.json_schema`; an engine that cannot constrain (the
reference engine) refuses it, answered as a 400. With a session, the call is recorded exactly as sampled: prompt ids, completion ids, behaviour
logprobs, the policy version of every token. Without one the gateway is a plain proxy.

When every session of a group is closed, the group is built (`gateway.samples.build_group`) and put in
the buffer under the same rules as the scheduler's groups: a new group takes an admission slot
when its first session is created (its `submit_version` is the trainer version then), the put
moves the slot to `accepted`, `min_version` comes from the policy's tokens. A session whose
calls extend each other exactly (each prompt = the previous prompt + completion + new tokens)
is one sample: the new tokens (template glue, tool results, user turns) have `loss_mask` 0,
behaviour logprob 0 and the version of the policy token before them, and `turn_starts` marks
where each call's completion begins. A call whose prompt is not such an extension (a template
that rewrites history, e.g. drops earlier reasoning) starts a new piece with its own
`prompt_ids`; the later pieces name the first in `episode`, and all carry the session's reward.

State lives in Redis (buffer/sessions.py: the keys, the scripts that move a group from open to
put), so any replica serves any session and a replica that dies loses nothing: a group it
closed but did not put is put by another replica's reaper after `gateway_put_lease_s`. A group
with no activity for `gateway_session_ttl_s` expires: its admission slot is given back and its
calls dropped (counted). A client that gives up on a session (its agent crashed) deletes it:
its whole group is dropped at once (no partial group is ever put), the slot given back, the
siblings' later calls and closes refused with 409 `group_abandoned`. The HTTP bodies and the stored `Call` are in proto/gateway.py.

Not guaranteed: a session's calls are recorded in the order they finish, so concurrent calls
in one session may split it; a complete group whose keys expire before any reaper runs (every
replica down for `KEY_TTL_FACTOR` × the TTL, buffer/sessions.py) is lost, its admission slot
given back when a reaper next runs.
Not a security boundary: a session id is a bearer of its session (random, 128 bits).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import redis

from asyncrl.buffer import AdmissionControl, Buffer, Groups, PolicyVersions, SessionStore
from asyncrl.proto import FinishReason, RewardStatus
from asyncrl.proto.gateway import (
    ID_PATTERN,
    Call,
    SessionAbandoned,
    SessionClosed,
    SessionCreated,
    SessionRequest,
    SessionReward,
)
from asyncrl.proto.openai import (
    ROLES,
    AssistantMessage,
    ChatCompletion,
    ChatCompletionUsage,
    Choice,
    ChoiceLogprobs,
    FunctionCall,
    GatewayChatRequest,
    GatewayMessage,
    ModelCard,
    ModelList,
    NamedToolChoice,
    TokenLogprob,
    ToolCallOut,
)
from asyncrl.proto.rewards import RewardItem, RewardSpec
from asyncrl.proto.states import Admission
from asyncrl.services.rollout import metrics as m
from asyncrl.services.rollout.clients.engine import EngineClient, EngineFailure, EngineRejected
from asyncrl.services.rollout.clients.rewards import RewardClient, VerifiersUnavailable
from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.services.rollout.gateway.samples import build_group
from asyncrl.services.rollout.intake import BadRequest, check_reward_specs
from asyncrl.services.rollout.segments import Draft, TooManyAborts, generate_resuming, moved_seed, sample_text
from asyncrl.services.rollout.toolcalls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    BadToolCall,
    ToolFormat,
    parse_tool_call,
)
from asyncrl.services.runtime.logging import log_event

log = logging.getLogger(__name__)

REAP_BATCH = 100  # groups one reaper pass handles
_ID = re.compile(ID_PATTERN)
HERMES = ToolFormat("hermes", HERMES_OPEN, HERMES_CLOSE)
# OpenAI request fields that do not change what is generated (anything else must be unset).
HARMLESS_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
    }
)


class GatewayError(Exception):
    """A refused or failed gateway request: HTTP `status`, a message, and the `reason` it is
    counted under (`asyncrl_rollout_gateway_errors_total`)."""

    def __init__(
        self,
        status: int,
        message: str,
        reason: str,
        retry_after: float | None = None,
        param: str | None = None,
    ):
        super().__init__(message)
        self.status, self.reason, self.retry_after, self.param = status, reason, retry_after, param


# --- the gateway ------------------------------------------------------------------------------


@dataclass
class Completion:
    """A generated answer: what the engine said, and what it means in OpenAI's terms."""

    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    lineage: dict[int, int]
    finish_reason: str  # stop | length (the engine's)
    text: str
    engine: int
    started: float
    finished: float


class Gateway:
    """Sessions, chat calls and groups of the gateway; one per rollout replica (state in Redis)."""

    def __init__(
        self,
        settings: RolloutSettings,
        buf: Buffer,
        engines: EngineClient,
        rewards: RewardClient,
        tokenizer,
        context_length: int,
    ):
        self.settings = settings
        self.store = SessionStore(buf, settings.gateway_session_ttl_s, settings.gateway_put_lease_s)
        self.groups, self.admission, self.versions = Groups(buf), AdmissionControl(buf), PolicyVersions(buf)
        self.engines, self.rewards = engines, rewards
        self.tokenizer, self.context_length = tokenizer, context_length
        self.weights = None  # the replica's WeightSync, when it follows weights: no call starts mid-update
        self.model_name = settings.tokenizer.rstrip("/").rsplit("/", 1)[-1]
        self.created = int(time.time())  # `created` of the model in /v1/models

    # --- sessions -----------------------------------------------------------------------------

    async def open_session(self, body: SessionRequest, verifiers, sid: str | None = None) -> SessionCreated:
        """A new session in `body.group_id` (a new group: after it is admitted). `verifiers`:
        an awaitable of the reward service's verifiers, asked only for a reward spec. `sid`: the
        client's own id (create-on-first-use), else a random one."""
        spec = ""
        if body.reward_spec is not None:
            try:
                served = await verifiers()
            except VerifiersUnavailable as exc:
                raise GatewayError(503, str(exc), "reward_unavailable") from exc
            try:  # a session's spec is checked as a job's own (the message names `reward_spec`)
                check_reward_specs([_UsesDefault()], body.reward_spec, served)  # type: ignore[list-item]
            except BadRequest as exc:
                raise GatewayError(400, str(exc), exc.reason) from exc
            spec = json.dumps(body.reward_spec.model_dump(), sort_keys=True)
        gid = body.group_id or f"g{uuid.uuid4().hex}"
        sid = sid or f"s{uuid.uuid4().hex}"
        submit_version = 0
        if not await asyncio.to_thread(self.store.group_exists, gid):
            submit_version = await self.admit(gid)
        answer = await asyncio.to_thread(
            self.store.open, sid, gid, body.group_size, body.prompt_id or "", spec, submit_version
        )
        outcome = answer[0]
        if outcome == "exists":  # a concurrent first call created it: that one is used
            return SessionCreated(session_id=sid, group_id=gid, index=-1)
        if outcome != "ok":
            messages = {
                "complete": f"group {gid!r} is {answer[-1]}"
                + (
                    ": one of its sessions was deleted"
                    if answer[-1] == "abandoned"
                    else ": it has all its sessions closed"
                ),
                "size": f"group {gid!r} has group_size {answer[-1]}, not {body.group_size}",
                "prompt_id": f"group {gid!r} has prompt_id {answer[-1]!r}",
                "spec": f"group {gid!r} has another reward_spec: {answer[-1] or 'none'}",
                "full": f"group {gid!r} has its {answer[-1]} sessions already",
            }
            raise GatewayError(409, messages[outcome], f"group_{outcome}")
        m.GATEWAY_SESSIONS.labels("opened").inc()
        return SessionCreated(session_id=sid, group_id=gid, index=int(answer[1]))

    async def admit(self, gid: str) -> int:
        """Take the new group's admission slot (buffer/admission.py, the scheduler's rule),
        waiting up to `gateway_admission_wait_s`; the trainer version at admission."""
        deadline = time.monotonic() + self.settings.gateway_admission_wait_s
        while True:
            admission = await asyncio.to_thread(self.admission.try_admit, gid)
            if admission.go:
                m.GROUPS_ADMITTED.inc()
                return await asyncio.to_thread(self.versions.version)
            if admission is Admission.duplicate:
                raise GatewayError(409, f"group {gid!r} is in the buffer already", "group_complete")
            m.ADMISSION_WAITS.inc()
            if time.monotonic() >= deadline:
                raise GatewayError(
                    429,
                    "the buffer is full (admission): the trainer is behind; retry later",
                    "admission_full",
                    retry_after=max(1.0, self.settings.admission_poll_s),
                )
            await asyncio.sleep(self.settings.admission_poll_s)

    async def ensure_session(self, sid: str, gid: str | None, size: int) -> None:
        """Create-on-first-use: a session named in the URL that the gateway does not know is
        opened in `gid`'s group of `size` (default: a group of one, named after the session).
        A known session is left as it is (its own checks refuse a closed one)."""
        if not _ID.match(sid):
            raise GatewayError(400, f"session id {sid[:128]!r} must match {ID_PATTERN}", "invalid_session_id")
        if await asyncio.to_thread(self.store.session, sid):
            return
        body = SessionRequest(group_id=gid or sid, group_size=size)
        await self.open_session(body, _no_verifiers, sid=sid)
        m.GATEWAY_SESSIONS.labels("created_on_use").inc()

    async def close_session(self, sid: str, body: SessionReward) -> SessionClosed:
        """Close with the reward given, or the one the session's verifier gives its last answer;
        the close that completes the group puts it in the buffer."""
        info = await self._session(sid)
        gid = info["group_id"]
        if body.reward is not None:
            result = {
                "reward": body.reward,
                "status": RewardStatus.scored.value,
                "details": {"source": "client"},
            }
        else:
            meta = await asyncio.to_thread(self.store.spec, gid)
            if not meta:
                raise GatewayError(
                    400, "give a reward: the session was created without a reward_spec", "no_reward"
                )
            last = await asyncio.to_thread(self.store.last_call, sid)
            if last is None:
                raise GatewayError(400, f"session {sid} made no chat call: nothing to score", "empty_session")
            spec = RewardSpec.model_validate_json(meta)
            prompt = await asyncio.to_thread(self.tokenizer.decode, last.arrays()[0])
            [scored] = await self.rewards.score(
                [RewardItem(id=sid, prompt=prompt, completion=last.text, spec=spec)]
            )
            result = {"reward": scored.reward, "status": scored.status.value, "details": scored.details}
        answer = await asyncio.to_thread(self.store.close, sid, result)
        self._refuse_session(sid, answer[0], allow=("complete", "open"))
        m.GATEWAY_SESSIONS.labels("closed").inc()
        group = "open"
        if answer[0] == "complete":
            group = await self.put_group(gid)
        return SessionClosed(
            session_id=sid,
            group_id=gid,
            reward=result["reward"],
            reward_status=RewardStatus(result["status"]),
            group=group,
        )

    async def _session(self, sid: str) -> dict[str, str]:
        """An open session's hash; 404 / 409 otherwise."""
        info = await asyncio.to_thread(self.store.session, sid) if _ID.match(sid) else {}
        self._refuse_session(sid, info.get("state", "unknown"), allow=("open",))
        return info

    @staticmethod
    def _refuse_session(sid: str, state: str, allow: tuple[str, ...]) -> None:
        if state in allow:
            return
        if state == "unknown":
            raise GatewayError(
                404, f"no session {sid[:128]!r} (never created, or expired)", "unknown_session"
            )
        if state == "empty":
            raise GatewayError(
                400,
                f"session {sid} made no chat call: nothing to train on (DELETE /v1/sessions/{sid} "
                "abandons it and its group)",
                "empty_session",
            )
        if state == "abandoned":
            raise GatewayError(
                409,
                f"session {sid}'s group was abandoned (a session of it was deleted): its calls are "
                "dropped; start a new group",
                "group_abandoned",
            )
        raise GatewayError(409, f"session {sid} is {state}", "session_closed")

    async def abandon_session(self, sid: str) -> SessionAbandoned:
        """Fail `sid`'s whole group now: its sessions' calls are deleted, its admission slot
        given back; a repeated abandon (or a sibling's) answers `again`. A group that is complete
        (being put) or put is not abandoned (409)."""
        answer = await asyncio.to_thread(self.store.abandon, sid) if _ID.match(sid) else ["unknown"]
        outcome = answer[0]
        if outcome == "again":
            return SessionAbandoned(session_id=sid, group_id=answer[1], sessions_open=0, again=True)
        if outcome in ("complete", "put"):
            raise GatewayError(
                409,
                f"session {sid}'s group {answer[1]!r} has all its sessions closed: it is "
                + ("being put in" if outcome == "complete" else "in")
                + " the buffer, too late to abandon",
                "group_complete",
            )
        if outcome != "abandoned":
            self._refuse_session(sid, outcome, allow=())
        gid, opened, closed = answer[1], int(answer[2]), int(answer[3])
        m.GATEWAY_GROUPS.labels("abandoned").inc()
        m.GATEWAY_SESSIONS.labels("abandoned").inc(opened - closed)
        log_event(log, "gateway group abandoned", group_id=gid, session_id=sid, sessions_open=opened - closed)
        return SessionAbandoned(session_id=sid, group_id=gid, sessions_open=opened - closed, again=False)

    def models(self) -> ModelList:
        return ModelList(data=[ModelCard(id=self.model_name, created=self.created, owned_by="asyncrl")])

    async def put_group(self, gid: str) -> Literal["buffered", "duplicate", "failed"]:
        """Build the complete group and put it (idempotent); a group that cannot be built (a bug:
        the records refuse it) is dropped, its slot given back, counted."""
        try:
            meta, sessions = await asyncio.to_thread(self.store.group, gid)
            group, splits = build_group(gid, meta, sessions)
        except (ValueError, KeyError, msgspec.DecodeError) as exc:
            log_event(
                log,
                "gateway group could not be built",
                logging.ERROR,
                group_id=gid,
                error=f"{type(exc).__name__}: {exc}",
            )
            lease = self.store.new_lease()
            await asyncio.to_thread(self.store.lease, gid, lease)
            await asyncio.to_thread(self.store.drop, gid, lease)
            m.GATEWAY_GROUPS.labels("failed").inc()
            return "failed"
        [new] = await asyncio.to_thread(self.groups.put, [group])
        version = await asyncio.to_thread(self.versions.version)
        await asyncio.to_thread(self.store.finish, gid)
        m.STALENESS_AT_WRITE.observe(max(version - group.min_version, 0))
        m.GATEWAY_SESSIONS.labels("split").inc(splits)
        m.GATEWAY_GROUPS.labels("put" if new else "duplicate").inc()
        log_event(log, "gateway group buffered", group_id=gid, samples=len(group.samples), new=new)
        return "buffered" if new else "duplicate"

    async def reap(self) -> None:
        """Run forever: expire groups idle past the TTL; put complete groups whose putter died."""
        while True:
            await asyncio.sleep(self.settings.gateway_reap_interval_s)
            try:
                await self.reap_once()
            except redis.RedisError as exc:
                m.GATEWAY_ERRORS.labels("reaper", "redis").inc()
                log_event(log, "gateway reaper pass failed", logging.WARNING, error=str(exc))

    async def reap_once(self) -> int:
        """One pass; returns how many groups it handled."""
        claimed, lease = await asyncio.to_thread(self.store.claim, REAP_BATCH)
        for gid, state in claimed:
            if state == "complete":
                await self.put_group(gid)
                continue
            dropped = await asyncio.to_thread(self.store.drop, gid, lease)
            if dropped is None:
                continue  # a call or close moved its deadline since the claim
            opened, closed = dropped
            m.GATEWAY_SESSIONS.labels("expired").inc(opened - closed)
            m.GATEWAY_GROUPS.labels("expired").inc()
            log_event(
                log, "gateway group expired", group_id=gid, sessions_open=opened - closed, closed=closed
            )
        return len(claimed)

    # --- chat calls ---------------------------------------------------------------------------

    async def complete(self, body: GatewayChatRequest, session_id: str | None) -> tuple[ChatCompletion, bool]:
        """Answer one chat call; with a session, record it. Returns (answer, recorded)."""
        info = await self._session(session_id) if session_id is not None else None
        forced = forced_tool(body)
        tools = body.tools if body.tool_choice != "none" else None
        prefill = _prefill(forced)
        messages = _template_messages(body.messages)
        prompt = await asyncio.to_thread(
            self._render, messages, [t.model_dump(exclude_none=True) for t in tools or []], prefill
        )
        room = self.context_length - len(prompt)
        if room <= 0:
            raise GatewayError(
                400,
                f"the rendered prompt has {len(prompt)} tokens: no room left in the context "
                f"length {self.context_length}",
                "context_length",
            )
        asked = body.max_completion_tokens or body.max_tokens
        if asked is not None and asked > self.settings.max_new_tokens_cap:
            raise GatewayError(
                400, f"max_tokens {asked} exceeds the cap {self.settings.max_new_tokens_cap}", "max_tokens"
            )
        params: dict[str, Any] = {
            "max_new_tokens": min(asked or self.settings.max_new_tokens_cap, room),
            "temperature": body.temperature,
            "top_p": body.top_p,
        }
        if body.seed is not None:
            params["sampling_seed"] = body.seed
        if body.stop:
            params["stop"] = body.stop
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(body, name):
                params[name] = getattr(body, name)
        if (schema := _json_schema(body)) is not None:
            params["json_schema"] = schema
        preferred = int(info["engine"]) if info and info.get("engine") else None
        done = await self._generate(prompt, params, preferred)
        m.GATEWAY_COMPLETIONS.labels("session" if info else "proxy").inc()
        m.GENERATED_TOKENS.inc(len(done.tokens))
        if info is not None:
            assert session_id is not None
            call = Call.of(
                done.prompt,
                done.tokens,
                done.logprobs,
                done.versions,
                lineage=done.lineage,
                finish_reason=FinishReason(done.finish_reason),
                text=done.text,
                started=done.started,
                finished=done.finished,
            )
            state = await asyncio.to_thread(self.store.record, session_id, call, done.engine)
            self._refuse_session(session_id, state, allow=("ok",))
        answer = await asyncio.to_thread(self._answer, body, done, tools is not None, forced, prefill)
        return answer, info is not None

    def _render(self, messages: list[dict], tools: list[dict], prefill: str = "") -> list[int]:
        tok = self.tokenizer
        if not getattr(tok, "chat_template", None):
            raise GatewayError(400, "the model's tokenizer has no chat template", "no_chat_template")
        try:
            text = tok.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # noqa: BLE001 — a template refusing the conversation (jinja's raise_exception, a TypeError on odd content) is the client's error
            raise GatewayError(
                400,
                f"the chat template refused the messages: {type(exc).__name__}: {exc}"[:500],
                "chat_template",
            ) from None
        ids = list(tok(text + prefill, add_special_tokens=False)["input_ids"])
        if not ids:
            raise GatewayError(400, "the messages render to an empty prompt", "empty_prompt")
        return ids

    async def _generate(self, prompt: list[int], params: dict, preferred: int | None) -> Completion:
        """The completion of `prompt` on one engine (the session's last, while it is healthy);
        a sample aborted by a weight update goes on as prompt + tokens so far (its tokens keep
        the version that sampled each)."""
        engines = self.engines.engines
        if preferred is not None and preferred < len(engines) and engines[preferred].healthy:
            engine = engines[preferred]
        else:
            try:
                engine = await asyncio.wait_for(self.engines.pick(), self.settings.gateway_engine_wait_s)
            except TimeoutError:
                raise GatewayError(
                    503,
                    f"no healthy engine within {self.settings.gateway_engine_wait_s} s",
                    "no_engine",
                    retry_after=self.settings.engine_probe_s,
                ) from None
        started = time.time()
        d = Draft(0, submitted=started)
        rids: set[str] = set()

        def params_for(_: Draft, segment: int) -> dict:
            if "sampling_seed" not in params or not segment:
                return params
            return {**params, "sampling_seed": moved_seed(params["sampling_seed"], segment)}

        try:
            await generate_resuming(
                self.engines,
                engine,
                self.weights,
                [prompt],
                [d],
                [params["max_new_tokens"]],
                params_for,
                rids=rids,
                max_resubmits=self.settings.max_resubmits,
                context_length=self.context_length,
                initial_version=self.settings.initial_weight_version,
            )
        except TooManyAborts:
            raise GatewayError(
                502, f"the call was aborted {self.settings.max_resubmits + 1} times", "aborted"
            ) from None
        except EngineRejected as exc:
            param = "response_format" if "json_schema" in params and "json_schema" in str(exc) else None
            raise GatewayError(
                400, f"the engine refused the request: {exc}", "engine_rejected", param=param
            ) from None
        except EngineFailure as exc:
            raise GatewayError(502, f"engine failure: {exc}", "engine_failure") from None
        except asyncio.CancelledError:  # the client went away: stop what still runs for it
            await asyncio.gather(*(self.engines.abort(engine, rid) for rid in rids))
            raise
        # (several engine answers: the tokens are decoded, off the event loop)
        text = (
            d.engine_text
            if d.segments == 1
            else await asyncio.to_thread(sample_text, self.tokenizer, d, params)
        )
        return Completion(
            prompt,
            d.tokens,
            d.logprobs,
            d.versions,
            d.lineage,
            d.finish_reason,
            text,
            engine.index,
            started,
            time.time(),
        )

    def _answer(
        self, body: GatewayChatRequest, done: Completion, tools: bool, forced: str | None, prefill: str
    ) -> ChatCompletion:
        if forced is None:
            content, calls = _tool_calls(done.text) if tools else (done.text, [])
        else:
            content, calls = _forced_calls(prefill + done.text, forced)
        finish = "length" if done.finish_reason == "length" else ("tool_calls" if calls else "stop")
        logprobs = None
        if body.logprobs:
            texts = self.tokenizer.batch_decode([[t] for t in done.tokens], skip_special_tokens=False)
            logprobs = ChoiceLogprobs(
                content=[
                    TokenLogprob(token=t, logprob=lp, bytes=list(t.encode("utf-8", "replace")))
                    for t, lp in zip(texts, done.logprobs)
                ]
            )
        return ChatCompletion(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(done.started),
            model=body.model or self.model_name,
            choices=[
                Choice(
                    message=AssistantMessage(content=content, tool_calls=calls or None),
                    finish_reason=finish,
                    logprobs=logprobs,
                )
            ],
            usage=ChatCompletionUsage(
                prompt_tokens=len(done.prompt),
                completion_tokens=len(done.tokens),
                total_tokens=len(done.prompt) + len(done.tokens),
            ),
        )


def forced_tool(body: GatewayChatRequest) -> str | None:
    """The tool call `tool_choice` forces: a function's name, "" for any of `tools` (required,
    LangChain's any; with one tool offered, that one), None for none forced. A named function
    not in `tools`, or a forced call without tools, is refused (400)."""
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
        return None
    names = [t.function.name for t in body.tools or []]
    if not names:
        raise GatewayError(
            400, f"tool_choice {_choice_text(choice)} needs tools", "tool_choice", param="tool_choice"
        )
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise GatewayError(
                400,
                f"tool_choice names function {choice.function.name!r}, which is not in tools {names[:20]}",
                "tool_choice",
                param="tool_choice",
            )
        return choice.function.name
    return names[0] if len(names) == 1 else ""


def _choice_text(choice) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def _prefill(forced: str | None) -> str:
    """The start of the assistant turn that forces the call: hermes' opening, and the name
    when one function is forced (the JSON as Qwen's templates write a tool call)."""
    if forced is None:
        return ""
    if not forced:
        return HERMES_OPEN + "\n"
    return HERMES_OPEN + "\n" + '{"name": ' + json.dumps(forced, ensure_ascii=False) + ', "arguments": '


def _forced_calls(text: str, forced: str) -> tuple[str | None, list[ToolCallOut]]:
    """The answer of a forced call: `text` is the prefill + the model's text. A call that parses
    is that call (and any further ones); when the name was forced, a call that does not parse
    still names it, its arguments the model's text up to the closing tag (then not JSON: OpenAI's
    own arguments may not be either); a required call that does not parse stays text (counted)."""
    content, calls = _tool_calls(text)
    if calls and (not forced or calls[0].function.name == forced):
        return content, calls
    if not forced:
        m.GATEWAY_ERRORS.labels("chat", "tool_choice_unmet").inc()
        return text, []
    head = _prefill(forced)
    raw = text[len(head) :]
    end = raw.find(HERMES_CLOSE)
    rest = raw[end + len(HERMES_CLOSE) :] if end >= 0 else ""
    raw = (raw[:end] if end >= 0 else raw).strip()
    if raw.endswith("}"):  # the call object's own closing brace
        inner = raw[:-1].rstrip()
        try:
            json.loads(inner)
            raw = inner
        except json.JSONDecodeError:
            pass
    call = ToolCallOut(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=forced, arguments=raw))
    return (rest.strip() or None), [call]


def _json_schema(body: GatewayChatRequest) -> str | None:
    """`response_format` as SGLang's `sampling_params.json_schema` (a JSON string): json_object
    is any object; text is no constraint."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    assert fmt.json_schema is not None  # (the model's own check)
    return json.dumps(fmt.json_schema.json_schema or {"type": "object"}, sort_keys=True)


async def _no_verifiers():  # a session created on first use has no reward_spec: never asked
    raise AssertionError("no reward_spec")


class _UsesDefault:
    """A prompt without its own spec, so `check_reward_specs` checks the default it is given."""

    reward_spec = None


def check_request(body: GatewayChatRequest) -> None:
    """What the models cannot say: unsupported fields set, text that is not Unicode."""
    extra = {
        k: v
        for k, v in (body.model_extra or {}).items()
        if k not in HARMLESS_FIELDS and v not in (None, 0, 0.0, False, [], {}, "", {"type": "text"})
    }
    if extra:
        raise GatewayError(400, f"not supported by the gateway: {sorted(extra)[:10]}", "unsupported_field")
    for i, message in enumerate(body.messages):
        if message.role not in ROLES:
            roles = ", ".join(repr(r) for r in ROLES[:-1]) + f" or {ROLES[-1]!r}"
            raise GatewayError(
                400, f"invalid request body: messages.{i}.role: Input should be {roles}", "invalid_body"
            )
    _check_unicode(body.model_dump(exclude_unset=True))


def _check_unicode(value: Any) -> None:
    """Refuse a lone UTF-16 surrogate (a JSON "\\ud800" escape): the tokenizer cannot take it."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise GatewayError(
                    400,
                    "the body contains a lone UTF-16 surrogate, which is not valid Unicode",
                    "invalid_unicode",
                ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_unicode(k)
            _check_unicode(v)
    elif isinstance(value, list):
        for v in value:
            _check_unicode(v)


def _template_messages(messages: list[GatewayMessage]) -> list[dict]:
    """OpenAI messages as chat templates read them (Hugging Face's conventions): content as one
    string (text parts joined by newlines), `developer` as `system`, tool call arguments as
    objects when they are JSON."""
    out = []
    for msg in messages:
        d: dict[str, Any] = {
            **(msg.model_extra or {}),
            "role": "system" if msg.role == "developer" else msg.role,
        }
        content = msg.content
        d["content"] = "\n".join(p.text for p in content) if isinstance(content, list) else (content or "")
        if msg.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in msg.tool_calls
            ]
        if msg.tool_call_id is not None:
            d["tool_call_id"] = msg.tool_call_id
        if msg.name is not None:
            d["name"] = msg.name
        out.append(d)
    return out


def _arguments(raw: str) -> Any:
    try:
        return json.loads(raw) if raw else {}
    except json.JSONDecodeError:
        return raw


def _tool_calls(text: str) -> tuple[str | None, list[ToolCallOut]]:
    """The hermes tool calls in `text` and the content around them (None when only calls). A
    block that does not parse stays in the content, as the model wrote it."""
    calls: list[ToolCallOut] = []
    content, pos = [], 0
    while (start := text.find(HERMES_OPEN, pos)) >= 0:
        end = text.find(HERMES_CLOSE, start)
        if end < 0:
            break
        end += len(HERMES_CLOSE)
        try:
            call = parse_tool_call(text[start:end], HERMES)
        except BadToolCall:
            call = None
        if call is not None:
            args = (
                call.arguments
                if isinstance(call.arguments, str)
                else json.dumps(call.arguments, ensure_ascii=False)
            )
            calls.append(
                ToolCallOut(
                    id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=call.name, arguments=args)
                )
            )
            content.append(text[pos:start])
        else:
            content.append(text[pos:end])
        pos = end
    content.append(text[pos:])
    joined = "".join(content)
    if not calls:
        return text, []
    return (joined.strip() or None), calls


def sse_chunks(answer: ChatCompletion, include_usage: bool) -> list[str]:
    """A finished answer as OpenAI's stream: the role, the content (with its logprobs), each
    tool call, the finish reason, the usage when asked, then `[DONE]` (the engine does not
    stream: the chunks come once the answer is complete)."""
    choice = answer.choices[0]
    head = {
        "id": answer.id,
        "object": "chat.completion.chunk",
        "created": answer.created,
        "model": answer.model,
    }

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None) -> str:
        body = {
            **head,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs}],
        }
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    out = [chunk({"role": "assistant", "content": ""})]
    if choice.message.content or choice.logprobs:
        out.append(
            chunk(
                {"content": choice.message.content or ""},
                logprobs=choice.logprobs.model_dump() if choice.logprobs else None,
            )
        )
    for i, call in enumerate(choice.message.tool_calls or []):
        out.append(chunk({"tool_calls": [{"index": i, **call.model_dump()}]}))
    out.append(chunk({}, choice.finish_reason))
    if include_usage:
        usage = {**head, "choices": [], "usage": answer.usage.model_dump()}
        out.append(f"data: {json.dumps(usage)}\n\n")
    out.append("data: [DONE]\n\n")
    return out
