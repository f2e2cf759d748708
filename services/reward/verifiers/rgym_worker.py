"""One reasoning-gym worker process: JSON lines in on stdin, JSON lines out on stdout.

Started by `services.reward.verifiers.rgym.ReasoningGymVerifier`'s pool as
`python -I rgym_worker.py MEMORY_MB`. It regenerates the named entry and scores the answer
with the dataset's own `score_answer`; the pool kills it past the item deadline.

Request: `{"dataset", "config", "index", "entry_sha256", "completion", "boxed"}` (`boxed`:
the content of the completion's last `\\boxed{}` when the spec asks for that fallback, else
null). Reply: `{"score": float, "answer": str|null, "source": "answer_tag"|"boxed"|null}`, or
`{"invalid": reason, "error": str}` (the spec names no entry this release can build), or
`{"error": str, "stage": "generate"|"score"}` (reasoning-gym itself failed).

The protocol has its own file descriptor: fd 1 is pointed at stderr before reasoning-gym is
imported, so a generator that prints cannot put a stray line in the reply stream.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from collections import OrderedDict

CACHED_DATASETS = 16  # dataset objects kept per worker: building one can take a while
ERROR_CHARS = 500
ECHO_CHARS = 200  # how much of the extracted answer is echoed back in `details`


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]


def main() -> int:
    memory_mb = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if memory_mb:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # one scorer per process: no BLAS thread pool
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    import reasoning_gym
    from reasoning_gym.utils import extract_answer

    from asyncrl.proto.reasoning_gym import entry_digest

    datasets: OrderedDict[str, object] = OrderedDict()

    def dataset(name: str, config: dict):
        key = json.dumps([name, config], sort_keys=True)
        if key in datasets:
            datasets.move_to_end(key)
            return datasets[key]
        built = reasoning_gym.create_dataset(name, **config)
        datasets[key] = built
        if len(datasets) > CACHED_DATASETS:
            datasets.popitem(last=False)
        return built

    def handle(request: dict) -> dict:
        try:
            data = dataset(request["dataset"], request["config"])
        except Exception as exc:  # noqa: BLE001 -- the config dataclass or its validate() refused it
            return {"invalid": "dataset_config_invalid", "error": _error(exc)}
        try:
            entry = data[request["index"]]
        except Exception as exc:  # noqa: BLE001 -- the generator itself failed on this index
            return {"error": _error(exc), "stage": "generate"}
        expected = request.get("entry_sha256")
        if expected is not None and entry_digest(entry) != expected:
            return {
                "invalid": "entry_mismatch",
                "error": "the regenerated entry differs from the submitted one",
            }
        answer, source = extract_answer(request["completion"]), "answer_tag"
        if answer is None and request.get("boxed") is not None:
            answer, source = request["boxed"], "boxed"
        try:
            score = data.score_answer(answer, entry)
        except Exception as exc:  # noqa: BLE001 -- reported: an `error` verdict, never a silent 0
            return {"error": _error(exc), "stage": "score"}
        if isinstance(score, bool) or not isinstance(score, (int, float)) or not math.isfinite(score):
            return {"error": f"score_answer returned {score!r}"[:ERROR_CHARS], "stage": "score"}
        return {
            "score": float(score),
            "answer": None if answer is None else answer[:ECHO_CHARS],
            "source": None if answer is None else source,
        }

    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            reply = handle(json.loads(line))
        except Exception as exc:  # noqa: BLE001 -- a malformed request: reported, the worker lives on
            reply = {"error": _error(exc), "stage": "request"}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
