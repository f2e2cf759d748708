"""`judge` verifier: an LLM grades the completion against a rubric over any OpenAI-compatible
`/v1/chat/completions` endpoint (SGLang, the reference engine, a hosted API).

The judge is asked to end with `Score: N`; `parse_score` also accepts a JSON object with a
`score` key, whichever comes last. The score is normalised to [0, 1] with the spec's scale.
Retries (exponential backoff) cover transport errors, timeouts and the statuses
services/runtime/retry.py names for a third-party server (`JUDGE_RETRY_STATUSES`); other
answers are not retried. An unparseable, out-of-range or failed judgment is `error`, never a 0 reward.
"""

from __future__ import annotations

import json
import math
import re

import httpx

from asyncrl.proto.openai import ChatRequest
from asyncrl.proto.records import RewardStatus
from asyncrl.proto.verifiers import JudgeSpec
from asyncrl.services.reward.metrics import JUDGE_CALLS
from asyncrl.services.reward.verifiers.base import Verdict, Verifier
from asyncrl.services.runtime.retry import JUDGE_RETRY_STATUSES, Retryable, may_retry, with_retries

RAW_CHARS = 500  # judge output echoed in details
RETRY_JITTER = 0.25  # each retry delay lengthened by up to this fraction, so judges' retries spread out
NUMBER = r"[-+]?\d+(?:\.\d+)?"
SCORE_LINE = re.compile(
    rf"score\W{{0,6}}?\s*(?:is|of|=|:)\s*\W{{0,4}}?({NUMBER})(?:\s*(?:/|out of)\s*({NUMBER}))?", re.IGNORECASE
)
JSON_OBJECT = re.compile(r"\{[^{}]*\}")
THINK_BLOCK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)

SYSTEM_PROMPT = (
    "You are a strict, impartial grader. Judge the response only by the rubric. "
    "Think briefly, then end your answer with a line of the form `Score: N`."
)


class ScoreParseError(ValueError):
    pass


def parse_score(text: str, scale: tuple[float, float]) -> float:
    """The judge's score on `scale`, from the last `Score: N` (or `N/M`, M = scale max) or the
    last JSON object with a numeric `score`; raises ScoreParseError if there is none or it is
    outside the scale."""
    text = THINK_BLOCK.sub(" ", text)
    candidates: list[tuple[int, float]] = []
    for match in SCORE_LINE.finditer(text):
        value, denominator = float(match.group(1)), match.group(2)
        if denominator is not None and float(denominator) != scale[1]:
            continue  # "7/5" on a 0–10 scale is ambiguous: not a score we can place
        candidates.append((match.end(), value))
    for match in JSON_OBJECT.finditer(text):
        try:
            obj = json.loads(match.group(0))
        except ValueError:
            continue
        value = obj.get("score") if isinstance(obj, dict) else None
        if isinstance(value, str) and re.fullmatch(NUMBER, value.strip()):
            value = float(value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            candidates.append((match.end(), float(value)))
    if not candidates:
        raise ScoreParseError("no `Score: N` line or JSON score in the judgment")
    score = max(candidates)[1]
    low, high = scale
    if not math.isfinite(score) or not low <= score <= high:
        raise ScoreParseError(f"score {score:g} is outside the scale [{low:g}, {high:g}]")
    return score


def judge_messages(rubric: str, question: str, response: str, reference: str | None, scale) -> list[dict]:
    parts = [f"## Rubric\n{rubric}", f"## Question\n{question}"]
    if reference is not None:
        parts.append(f"## Reference answer\n{reference}")
    parts.append(f"## Response to grade\n{response}")
    parts.append(f"Grade the response from {scale[0]:g} (worst) to {scale[1]:g} (best). End with `Score: N`.")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(parts)}]


class JudgeFailure(Exception):
    def __init__(self, reason: str, **details):
        super().__init__(reason)
        self.reason = reason
        self.details = details


class JudgeVerifier(Verifier):
    name = "judge"
    description = (
        "An LLM judge grades the completion (with the prompt as the question) by `rubric`, "
        "optionally against `reference`; the score on `scale` is normalised to [0, 1]."
    )
    Spec = JudgeSpec

    def __init__(
        self,
        *,
        base_url: str,
        model: str,
        api_key: str | None,
        concurrency: int,
        request_timeout_s: float,
        item_timeout_s: float,
        max_retries: int,
        backoff_s: float,
        max_tokens: int,
        temperature: float,
        max_chars: int,
    ):
        super().__init__(concurrency=concurrency, timeout_s=item_timeout_s)
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.request_timeout_s = request_timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.max_chars = max_chars
        self.client: httpx.AsyncClient | None = None

    def uses_prompt(self, spec: JudgeSpec) -> bool:
        return True

    async def start(self) -> None:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self.client = httpx.AsyncClient(
            timeout=self.request_timeout_s,
            headers=headers,
            limits=httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency),
        )

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()

    async def verify(self, spec: JudgeSpec, prompt: str, completion: str) -> Verdict:
        response = (
            completion
            if len(completion) <= self.max_chars
            else completion[: self.max_chars] + "\n[truncated]"
        )
        request = ChatRequest(
            model=self.model,
            messages=judge_messages(spec.rubric, prompt, response, spec.reference, spec.scale),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            stream=False,
        )
        body = request.model_dump(mode="json", exclude_unset=True)  # what was set, nothing else
        try:
            content, attempts = await self._complete(body)
        except JudgeFailure as exc:
            return Verdict.failed(RewardStatus.error, exc.reason, **exc.details)
        try:
            score = parse_score(content, spec.scale)
        except ScoreParseError as exc:
            return Verdict.failed(
                RewardStatus.error, "unparseable_score", error=str(exc), raw=content[-RAW_CHARS:]
            )
        low, high = spec.scale
        return Verdict.scored(
            (score - low) / (high - low),
            score=score,
            scale=[low, high],
            attempts=attempts,
            raw=content[-RAW_CHARS:],
        )

    async def _complete(self, body: dict) -> tuple[str, int]:
        """POST with retries; the assistant message text and the number of attempts made."""
        assert self.client is not None, "JudgeVerifier.start() was not called"
        client, url = self.client, f"{self.base_url}/chat/completions"

        async def attempt(n: int) -> tuple[str, int]:
            if n:
                JUDGE_CALLS.labels("retried").inc()
            try:
                reply = await client.post(url, json=body)
            except httpx.TransportError as exc:  # includes connect/read timeouts
                JUDGE_CALLS.labels("transport_error").inc()
                raise Retryable(f"{type(exc).__name__}: {exc}") from None
            if may_retry(reply.status_code, JUDGE_RETRY_STATUSES, any_5xx=False):
                JUDGE_CALLS.labels("http_error").inc()
                raise Retryable(f"HTTP {reply.status_code}: {reply.text[:200]}")
            if reply.status_code != 200:
                JUDGE_CALLS.labels("http_error").inc()
                raise JudgeFailure(
                    "judge_http_error", status_code=reply.status_code, body=reply.text[:RAW_CHARS]
                )
            try:
                content = reply.json()["choices"][0]["message"]["content"]
                if not isinstance(content, str):
                    raise TypeError(f"message content is {type(content).__name__}")
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                JUDGE_CALLS.labels("bad_response").inc()
                raise JudgeFailure(
                    "judge_bad_response", error=str(exc)[:200], body=reply.text[:RAW_CHARS]
                ) from None
            JUDGE_CALLS.labels("ok").inc()
            return content, n + 1

        try:
            return await with_retries(attempt, self.max_retries, first_s=self.backoff_s, jitter=RETRY_JITTER)
        except Retryable as exc:
            raise JudgeFailure(
                "judge_unavailable", attempts=self.max_retries + 1, last_error=str(exc)
            ) from None
