"""`math` verifier: final-answer equivalence with math-verify, in a pool of worker processes.

math-verify's own timeout relies on `signal.alarm` (main thread only) and raises a
`BaseException`, so it is switched off; instead each request has a deadline here and a
worker that runs past it is SIGKILLed and replaced (`pool.WorkerPool`). Inputs are capped
before parsing: the last `\\boxed{…}` is cut out of the completion (else its last
`max_chars` characters are parsed). A gold answer that does not parse is `invalid_input`,
never a 0 reward.

Strict mode (`MathSpec.strict`, else the server's `math_strict`) pays only a marked final
answer: the last `\\boxed{…}`, else the last `<answer>…</answer>` (reasoning-gym's tag), else
the last line that starts with `####` (GSM8K's marker) or `Answer:` / `Final answer:`
(markdown bold allowed). An unmarked completion scores 0
(`details.unmarked`): its text never reaches math-verify's extractor, which would find "14"
in "maybe 14" and pay it (the gold is still parsed, so a bad gold stays `invalid_input`).

`formatted` (on every scored verdict): the answer came from a final-answer mark this mode
reads, and math-verify read an answer out of it. Strict: any of the marks above; lenient: a
`\\boxed{…}` (an unboxed completion is formatted False even when its tail is paid). An empty
or unreadable mark (`\\boxed{}`) is not formatted. So a strict reward of 1 implies formatted,
and strict accuracy = format rate × accuracy among formatted answers.
"""

from __future__ import annotations

import re
from pathlib import Path

from asyncrl.proto.records import RewardStatus
from asyncrl.proto.verifiers import MathSpec
from asyncrl.services.reward.metrics import MATH_WORKER_RESTARTS
from asyncrl.services.reward.verifiers.base import Verdict
from asyncrl.services.reward.verifiers.pool import PooledVerifier, WorkerCrashed, WorkerTimeout

WORKER = Path(__file__).with_name("math_worker.py")
BOXED = "\\boxed"


def last_boxed(text: str, max_chars: int) -> str | None:
    """The last `\\boxed{…}` of `text` (braces balanced, at most `max_chars`), else None."""
    start = text.rfind(BOXED + "{")
    if start < 0:
        return None
    depth = 0
    end_limit = min(len(text), start + max_chars)
    for i in range(start + len(BOXED), end_limit):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    return None


def answer_region(completion: str, max_chars: int) -> tuple[str, bool]:
    """The text handed to the parser and whether the completion was cut to produce it."""
    boxed = last_boxed(completion, max_chars)
    if boxed is not None:
        return boxed, False
    return completion[-max_chars:], len(completion) > max_chars


ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"  # reasoning-gym's (and DeepSeek-R1's) answer tags
# A strict answer line: `#### 14`, `Answer: 14`, `Final answer: 14`, `**Final Answer:** 14`.
MARKED_LINE = re.compile(r"\s*(?:####|\**\s*(?:final\s+)?answer\s*:)(.*)", re.IGNORECASE)


def marked_answer(completion: str, max_chars: int) -> str | None:
    """Strict mode's answer: the last `\\boxed{…}`, else (in the last `max_chars` characters)
    the last `<answer>…</answer>`, else the value of the last marked line; None when the
    completion marks no answer."""
    boxed = last_boxed(completion, max_chars)
    if boxed is not None:
        return boxed
    tail = completion[-max_chars:]
    close = tail.rfind(ANSWER_CLOSE)
    open_ = tail.rfind(ANSWER_OPEN, 0, max(close, 0))
    if close >= 0 and open_ >= 0 and tail[open_ + len(ANSWER_OPEN) : close].strip():
        return _as_math(tail[open_ + len(ANSWER_OPEN) : close].strip())
    for line in reversed(tail.splitlines()):
        match = MARKED_LINE.match(line)
        value = match.group(1).strip().strip("*").strip() if match else ""
        if value:
            return _as_math(value)
    return None


def _as_math(value: str) -> str:
    """A marked value as math-verify reads it: bare LaTeX does not parse as text, `$…$` does."""
    return f"${value}$" if "\\" in value and "$" not in value else value


class MathVerifier(PooledVerifier):
    name = "math"
    description = (
        "Final-answer equivalence with math-verify: the last \\boxed{} of the completion (else its "
        "tail; strict: else an <answer> tag or a `####`/`Answer:` line, else 0) against `answer`. 1 if equivalent, "
        "0 if not; a gold that does not parse is invalid_input."
    )
    Spec = MathSpec

    def __init__(
        self, *, workers: int, timeout_s: float, max_chars: int, memory_mb: int, strict: bool = False
    ):
        super().__init__(
            WORKER, workers=workers, timeout_s=timeout_s, memory_mb=memory_mb, restarts=MATH_WORKER_RESTARTS
        )
        self.max_chars = max_chars
        self.strict = strict  # for specs that leave `strict` unset

    async def verify(self, spec: MathSpec, prompt: str, completion: str) -> Verdict:
        if len(spec.answer) > self.max_chars:
            return Verdict.failed(RewardStatus.invalid_input, "gold_too_long", max_chars=self.max_chars)
        strict = self.strict if spec.strict is None else spec.strict
        if strict:
            marked, truncated = marked_answer(completion, self.max_chars), False
            pred = "" if marked is None else marked  # still sent: the gold is checked all the same
        else:
            marked = last_boxed(completion, self.max_chars)  # the one mark lenient mode reads
            pred, truncated = answer_region(completion, self.max_chars)
        try:
            reply = await self.pool.request({"gold": spec.answer, "pred": pred})
        except WorkerTimeout as exc:
            return Verdict.failed(RewardStatus.timeout, "math_timeout", error=str(exc))
        except WorkerCrashed as exc:
            return Verdict.failed(RewardStatus.error, "math_worker_crashed", error=str(exc))
        if "error" in reply:
            return Verdict.failed(RewardStatus.error, "math_verify_error", error=reply["error"])
        if not reply["gold_ok"]:
            return Verdict.failed(RewardStatus.invalid_input, "gold_unparseable", gold=spec.answer[:200])
        return Verdict.scored(
            1.0 if reply["equal"] else 0.0,
            formatted=marked is not None and reply["pred_ok"],
            gold=reply["gold_extracted"],
            extracted=reply["pred_extracted"],
            truncated=truncated,
            strict=strict,
            **({"unmarked": True} if strict and not pred else {}),
        )
