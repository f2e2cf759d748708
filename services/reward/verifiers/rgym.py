"""`reasoning_gym` verifier: a reasoning-gym item scored by its dataset's own `score_answer`.

The spec names the item (`proto.reasoning_gym`); a worker process regenerates the entry and
scores it (`rgym_worker.py`), under the same deadline-and-kill regime as math-verify
(`pool.WorkerPool`): reasoning-gym's scorers run arbitrary Python (sympy, regexes, game
simulators) with no timeout of their own.

The answer is what reasoning-gym's own `extract_answer` takes from the completion (the last
`<answer>…</answer>`, stripped), so the reward equals what reasoning-gym's training code
would compute; `boxed_fallback` adds the last `\\boxed{}` when there is no tag. `formatted`
says whether there was such an answer (a tag, or the box under the fallback). The score is
passed through unchanged, partial credit included (gsm_symbolic pays 0.01 for a well-formed
wrong number; the base scorer pays len(gold)/len(answer) when the gold is a substring).

Not a 0 when it cannot judge: a config the dataset refuses and an entry that regenerates
differently are `invalid_input`; a generator or scorer that raises, or a score that is not
a finite number, is `error` (`rg_generate_error`, `rg_score_error`); a scorer past the
deadline is `timeout`. All are counted in `asyncrl_reward_verifier_failures_total` (errors,
timeouts) and `asyncrl_reward_items_total` (every status).
"""

from __future__ import annotations

from pathlib import Path

from asyncrl.proto.reasoning_gym import ReasoningGymSpec
from asyncrl.proto.records import RewardStatus
from asyncrl.services.reward.metrics import RGYM_WORKER_RESTARTS
from asyncrl.services.reward.verifiers.base import Verdict
from asyncrl.services.reward.verifiers.math import BOXED, last_boxed
from asyncrl.services.reward.verifiers.pool import PooledVerifier, WorkerCrashed, WorkerTimeout

WORKER = Path(__file__).with_name("rgym_worker.py")


def boxed_content(completion: str, max_chars: int) -> str | None:
    """The inside of the last `\\boxed{…}`, stripped, else None."""
    boxed = last_boxed(completion, max_chars)
    return None if boxed is None else boxed[len(BOXED) + 1 : -1].strip()


class ReasoningGymVerifier(PooledVerifier):
    name = "reasoning_gym"
    description = (
        "A reasoning-gym item (dataset, config, index) regenerated and scored by the dataset's own "
        "score_answer on the completion's last <answer>…</answer> (optionally its last \\boxed{}); "
        "the dataset's score, partial credit included."
    )
    Spec = ReasoningGymSpec

    def __init__(self, *, workers: int, timeout_s: float, max_chars: int, memory_mb: int):
        super().__init__(
            WORKER, workers=workers, timeout_s=timeout_s, memory_mb=memory_mb, restarts=RGYM_WORKER_RESTARTS
        )
        self.max_chars = max_chars

    async def verify(self, spec: ReasoningGymSpec, prompt: str, completion: str) -> Verdict:
        request = {
            "dataset": spec.dataset,
            "config": spec.config,
            "index": spec.index,
            "entry_sha256": spec.entry_sha256,
            # the answer tag is searched in the tail only: the last tag is what counts
            "completion": completion[-self.max_chars :],
            "boxed": boxed_content(completion, self.max_chars) if spec.boxed_fallback else None,
        }
        try:
            reply = await self.pool.request(request)
        except WorkerTimeout as exc:
            return Verdict.failed(RewardStatus.timeout, "rg_timeout", error=str(exc))
        except WorkerCrashed as exc:
            return Verdict.failed(RewardStatus.error, "rg_worker_crashed", error=str(exc))
        if "invalid" in reply:
            return Verdict.failed(RewardStatus.invalid_input, reply["invalid"], error=reply["error"])
        if "error" in reply:
            stage = reply.get("stage")
            reason = {"generate": "rg_generate_error", "score": "rg_score_error"}.get(
                stage, "rg_worker_error"
            )
            return Verdict.failed(RewardStatus.error, reason, error=reply["error"])
        return Verdict.scored(
            reply["score"],
            formatted=reply["answer"] is not None,
            answer=reply["answer"],
            source=reply["source"],
            truncated=len(completion) > self.max_chars,
        )
