"""One math-verify worker process: JSON lines in on stdin, JSON lines out on stdout.

Started by `services.reward.verifiers.math.MathPool` as `python -I math_worker.py MEMORY_MB`.
It has no timeout of its own (math-verify's uses `signal.alarm`); the pool kills it when a
request runs past the deadline. Request `{"gold": str, "pred": str}`; reply
`{"gold_ok": bool, "pred_ok": bool, "equal": bool, "gold_extracted": [...], "pred_extracted": [...]}`
or `{"error": str}` (`pred_ok`: math-verify read at least one answer out of `pred`). Only
extracted *strings* are returned: printing sympy objects can itself hang.
"""

from __future__ import annotations

import json
import logging
import resource
import sys

EXTRACTED_CHARS = 200  # how much of each extracted answer is echoed back in `details`


def _strings(parsed: list) -> list[str]:
    return [item[:EXTRACTED_CHARS] for item in parsed if isinstance(item, str)]


def _parse_gold(parse, gold: str) -> list:
    """A gold answer parses when math-verify yields at least one sympy object (not only the
    raw-string fallback). A bare gold (`2\\sqrt2`, `(1, 2]`) is read as LaTeX first: unwrapped,
    the plain-expression extractor would stop at its first number."""
    bare = "$" not in gold and "\\boxed" not in gold
    for text in (f"${gold}$", gold) if bare else (gold,):
        parsed = parse(text, parsing_timeout=None)
        if any(not isinstance(item, str) for item in parsed):
            return parsed
    return []


def main() -> int:
    memory_mb = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    if memory_mb:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    logging.disable(logging.WARNING)  # math-verify warns on every call without its own timeout
    from math_verify import parse, verify

    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            gold = _parse_gold(parse, request["gold"])
            if not gold:
                reply = {
                    "gold_ok": False,
                    "pred_ok": False,
                    "equal": False,
                    "gold_extracted": [],
                    "pred_extracted": [],
                }
            else:
                pred = parse(request["pred"], parsing_timeout=None)
                equal = bool(pred) and verify(gold, pred, timeout_seconds=None)
                reply = {
                    "gold_ok": True,
                    "pred_ok": bool(pred),
                    "equal": bool(equal),
                    "gold_extracted": _strings(gold),
                    "pred_extracted": _strings(pred),
                }
        except Exception as exc:  # noqa: BLE001 -- reported to the pool, which makes it an `error` verdict
            reply = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        out.write(json.dumps(reply) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
