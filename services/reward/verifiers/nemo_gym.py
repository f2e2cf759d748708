"""`nemo_gym` verifier: a NeMo Gym resources server's `/verify` as the reward of one completion.

Per sample, against the server the spec names (configured as `[reward.nemo_gym.<name>]`; a spec
never carries a URL):

    POST /seed_session  {**task, responses_create_params}             → Set-Cookie (the session)
    POST /verify        {**task, responses_create_params, response}   → {reward, …}   (same cookie)
    POST <close_path>   {}                                             (same cookie; only if configured)

`response` is a Responses API object built from the completion text: the text as one assistant
`message` with `output_text` content, and each Hermes `<tool_call>{"name", "arguments"}</tool_call>`
as a `function_call` item, in order. `responses_create_params` is the spec's, or the prompt as the
one user input. The server keeps its state per session cookie, so each sample has a cookie jar of
its own and the shared client stores none (one sample's session never leaks into another's).

The answer maps onto a `Verdict`:
* `reward` (finite) → `scored`; `reward_components` and `failure_reason` go into `details`;
* `mask_sample: true` → `error` with reason `masked` and the `failure_kind`: the trainer masks a
  sample that is not `scored` out of the loss; the reward the server reported is kept in
  `details`, never used;
* `_ng_failure_class` (NeMo Gym's `judge_failsafe`: a judge call failed, reward 0.0 stamped on)
  → `error` with that class as the failure kind, never a 0;
* a transport error, a timeout or a 5xx/429 on seed_session or verify → the whole sequence again
  in a new session (at most `max_retries` times), then `error` `nemo_gym_unavailable`; another
  4xx or an answer without a finite `reward` → `error` at once.
A close that fails is counted and leaves the verdict as it was. Failure kinds become a metric
label only from KNOWN_FAILURE_KINDS (others: `other`).

Not a NeMo Gym agent: one completion, one verify; multi-step environments (a server's own tool
routes, `/step`) and NeMo Gym's model and agent servers are not driven from here.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from http.cookiejar import CookieJar, DefaultCookiePolicy
from typing import Any

import httpx

from asyncrl.proto.records import RewardStatus
from asyncrl.proto.verifiers import NemoGymSpec, SpecError
from asyncrl.services.reward.metrics import NEMO_GYM_CALLS, NEMO_GYM_FAILURES, NEMO_GYM_VERDICTS
from asyncrl.services.reward.verifiers.base import Verdict, Verifier
from asyncrl.services.runtime.retry import Retryable, may_retry, with_retries

RAW_CHARS = 500  # answer text echoed in details
REASON_CHARS = 300  # a server's failure_reason kept in details
RETRY_JITTER = 0.25  # retries of many samples spread out
MODEL = "asyncrl-policy"  # `response.model` when responses_create_params names none
# failure_kind / _ng_failure_class values counted under their own label (NeMo Gym's
# judge_failsafe class, the osworld agent's setup failures, our environments' kinds).
KNOWN_FAILURE_KINDS = frozenset(
    {"judge_failed", "timeout", "sandbox", "queue_timeout", "crash", "setup_error", "proxy_setup_error"}
)
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def failure_label(kind: object) -> str:
    """A failure kind as a bounded metric label."""
    if kind is None or kind == "":
        return "unspecified"
    return kind if isinstance(kind, str) and kind in KNOWN_FAILURE_KINDS else "other"


def response_output(completion: str) -> list[dict[str, Any]]:
    """The completion as Responses API output items: text as assistant messages, each Hermes
    tool call (a JSON object with a string `name`) as a `function_call`; a block that is not one
    stays text."""
    items: list[dict[str, Any]] = []
    text: list[str] = []

    def flush() -> None:
        joined = "".join(text).strip()
        text.clear()
        if joined:
            items.append(_message(joined, len(items)))

    position = 0
    for match in TOOL_CALL.finditer(completion):
        call = _tool_call(match.group(1), len(items) + 1)
        if call is None:
            continue
        text.append(completion[position : match.start()])
        flush()
        items.append(call)
        position = match.end()
    text.append(completion[position:])
    flush()
    return items or [_message("", 0)]


def _message(text: str, n: int) -> dict[str, Any]:
    return {
        "id": f"msg_{n}",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": text, "annotations": []}],
    }


def _tool_call(body: str, n: int) -> dict[str, Any] | None:
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    return {
        "id": f"fc_{n}",
        "type": "function_call",
        "call_id": f"call_{n}",
        "name": call["name"],
        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        "status": "completed",
    }


def build_response(completion: str, params: dict[str, Any]) -> dict[str, Any]:
    """A Responses API `response` object (the fields openai's `Response` requires) for `completion`."""
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": time.time(),
        "model": params.get("model") or MODEL,
        "status": "completed",
        "output": response_output(completion),
        "parallel_tool_calls": params.get("parallel_tool_calls", True),
        "tool_choice": params.get("tool_choice", "auto"),
        "tools": params.get("tools", []),
    }


class NemoGymFailure(Exception):
    """The sample could not be verified: `reason` is the verdict's, `kind` the failure label."""

    def __init__(self, reason: str, kind: str, **details: Any):
        super().__init__(reason)
        self.reason, self.kind, self.details = reason, kind, details


class NemoGymVerifier(Verifier):
    name = "nemo_gym"
    description = (
        "A configured NeMo Gym resources server scores the completion: seed_session, then /verify "
        "with the completion as a Responses API response, in one session; mask_sample → masked."
    )
    Spec = NemoGymSpec

    def __init__(
        self,
        servers: dict[str, Any],
        *,
        concurrency: int,
        request_timeout_s: float,
        item_timeout_s: float,
        max_retries: int,
        backoff_s: float,
    ):
        """`servers`: name → a `NemoGymServer` (its `url` and `close_path`)."""
        super().__init__(concurrency=concurrency, timeout_s=item_timeout_s)
        self.servers = dict(servers)
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.client: httpx.AsyncClient | None = None

    def parse_spec(self, args: dict[str, Any]) -> NemoGymSpec:
        spec = super().parse_spec(args)
        if spec.server not in self.servers:
            known = ", ".join(sorted(self.servers)) or "none"
            raise SpecError(
                f"server: {spec.server!r} is not a configured NeMo Gym server (configured: {known})"
            )
        return spec

    def uses_prompt(self, spec: NemoGymSpec) -> bool:
        return spec.responses_create_params is None  # then the prompt is the request's input

    async def start(self) -> None:
        # The shared client must keep no cookies: each sample's session lives in its own jar.
        no_cookies = CookieJar(policy=DefaultCookiePolicy(allowed_domains=[]))
        self.client = httpx.AsyncClient(
            timeout=self.request_timeout_s,
            cookies=no_cookies,
            limits=httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency),
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def verify(self, spec: NemoGymSpec, prompt: str, completion: str) -> Verdict:
        server = spec.server
        params = spec.responses_create_params or {
            "input": [{"role": "user", "content": prompt, "type": "message"}]
        }
        seed = {**spec.task, "responses_create_params": params}
        body = {**seed, "response": build_response(completion, params)}
        try:
            answer, attempts = await self._session(server, seed, body)
            verdict = self._verdict(server, answer, attempts)
        except NemoGymFailure as exc:
            verdict = Verdict.failed(
                RewardStatus.error, exc.reason, server=server, failure_kind=exc.kind, **exc.details
            )
        outcome = (
            "scored"
            if verdict.status is RewardStatus.scored
            else ("masked" if verdict.details.get("reason") == "masked" else "failed")
        )
        NEMO_GYM_VERDICTS.labels(server, outcome).inc()
        if outcome != "scored":
            NEMO_GYM_FAILURES.labels(server, verdict.details["failure_kind"]).inc()
        return verdict

    async def _session(self, server: str, seed: dict, body: dict) -> tuple[dict, int]:
        """seed_session then verify in one fresh session per attempt (a retried sample starts a
        new one: a half-used session's state is the server's, not ours to reuse); the verify
        answer and the attempts made. The session is closed after each attempt that seeded it."""

        async def attempt(n: int) -> tuple[dict, int]:
            jar = httpx.Cookies()
            if n:
                NEMO_GYM_CALLS.labels(server, "seed_session", "retried").inc()  # a session begun again
            try:
                await self._call(server, "/seed_session", seed, jar)
                reply = await self._call(server, "/verify", body, jar)
            finally:
                if jar:  # the server opened a session: release it, whatever verify said
                    await self._close(server, jar)
            return reply, n + 1

        try:
            return await with_retries(attempt, self.max_retries, first_s=self.backoff_s, jitter=RETRY_JITTER)
        except Retryable as exc:
            raise NemoGymFailure(
                "nemo_gym_unavailable", "unavailable", attempts=self.max_retries + 1, last_error=str(exc)
            ) from None

    async def _call(self, server: str, route: str, payload: dict, jar: httpx.Cookies) -> dict:
        """POST `payload` with the session's cookies, keep what the answer sets; its JSON object."""
        assert self.client is not None, "NemoGymVerifier.start() was not called"
        label = route.strip("/")
        try:
            reply = await self.client.post(
                self.servers[server].url + route, json=payload, headers=_cookie_header(jar)
            )
        except httpx.TransportError as exc:  # connect and read timeouts included
            NEMO_GYM_CALLS.labels(server, label, "transport_error").inc()
            raise Retryable(f"{route}: {type(exc).__name__}: {exc}") from None
        jar.update(reply.cookies)
        if reply.status_code != 200:
            NEMO_GYM_CALLS.labels(server, label, "http_error").inc()
            if may_retry(reply.status_code):
                raise Retryable(f"{route}: HTTP {reply.status_code}: {reply.text[:200]}")
            raise NemoGymFailure(
                "nemo_gym_http_error",
                "http_error",
                route=route,
                status_code=reply.status_code,
                body=reply.text[:RAW_CHARS],
            )
        try:
            answer = reply.json()
            if not isinstance(answer, dict):
                raise TypeError(f"the answer is a JSON {type(answer).__name__}, not an object")
        except (ValueError, TypeError) as exc:
            NEMO_GYM_CALLS.labels(server, label, "bad_response").inc()
            raise NemoGymFailure(
                "nemo_gym_bad_response",
                "bad_response",
                route=route,
                error=str(exc)[:200],
                body=reply.text[:RAW_CHARS],
            ) from None
        NEMO_GYM_CALLS.labels(server, label, "ok").inc()
        return answer

    async def _close(self, server: str, jar: httpx.Cookies) -> None:
        """POST the configured close route; a failure is counted, not the sample's."""
        path = self.servers[server].close_path
        if path is None:
            return
        assert self.client is not None
        try:
            reply = await self.client.post(
                self.servers[server].url + path, json={}, headers=_cookie_header(jar)
            )
            outcome = "ok" if reply.status_code == 200 else "http_error"
        except httpx.TransportError:
            outcome = "transport_error"
        NEMO_GYM_CALLS.labels(server, "close", outcome).inc()

    @staticmethod
    def _verdict(server: str, answer: dict, attempts: int) -> Verdict:
        """The verify answer as a Verdict (module docstring: the mapping)."""
        reward = answer.get("reward")
        reason = answer.get("failure_reason")
        common: dict[str, Any] = {"server": server, "attempts": attempts}
        if reason is not None:
            common["failure_reason"] = str(reason)[:REASON_CHARS]
        failure_class = answer.get("_ng_failure_class")
        if failure_class is not None:
            return Verdict.failed(
                RewardStatus.error,
                "judge_failed" if failure_class == "judge_failed" else "nemo_gym_failure",
                failure_kind=failure_label(failure_class),
                error=str(answer.get("_ng_failure_judge_error", ""))[:REASON_CHARS],
                **common,
            )
        if answer.get("mask_sample") is True:
            return Verdict.failed(
                RewardStatus.error,
                "masked",
                failure_kind=failure_label(answer.get("failure_kind")),
                reported_kind=str(answer.get("failure_kind", ""))[:64],
                reported_reward=reward if isinstance(reward, (int, float)) else None,
                **common,
            )
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise NemoGymFailure(
                "nemo_gym_bad_response",
                "bad_response",
                error=f"verify answered reward={reward!r}, not a finite number",
            )
        components = answer.get("reward_components")
        if isinstance(components, dict):
            common["reward_components"] = {
                str(k)[:64]: float(v)
                for k, v in components.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            }
        return Verdict.scored(float(reward), **common)


def _cookie_header(jar: httpx.Cookies) -> dict[str, str]:
    return {"Cookie": "; ".join(f"{name}={value}" for name, value in jar.items())} if jar else {}
