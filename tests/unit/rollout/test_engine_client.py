"""The engine client's checks of what `/generate` answers (`services/rollout/clients/engine.py`)."""

from __future__ import annotations

import httpx
import pytest

from asyncrl.services.rollout.clients.engine import _parse_generations


def generate_item(output_ids, logprobs, version="3") -> dict:
    return {
        "text": "x",
        "output_ids": output_ids,
        "meta_info": {
            "id": "r",
            "finish_reason": {"type": "length", "length": len(output_ids)},
            "prompt_tokens": 2,
            "completion_tokens": len(output_ids),
            "weight_version": version,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output_ids)],
        },
    }


def batch(*items: dict) -> httpx.Response:
    return httpx.Response(200, json=list(items))


def test_generation_answers_are_checked():
    out = _parse_generations(batch(generate_item([5, 6], [-0.5, -1.25]), generate_item([7], [-2.0], "4")), 2)
    assert [(o.output_ids, o.logprobs, o.weight_version, o.finish_reason) for o in out] == [
        ([5, 6], [-0.5, -1.25], "3", "length"),
        ([7], [-2.0], "4", "length"),
    ]
    with pytest.raises(ValueError, match="1 answers for a batch of 2"):
        _parse_generations(batch(generate_item([5], [-0.5])), 2)
    with pytest.raises(ValueError, match="do not match"):
        _parse_generations(batch(generate_item([5, 6], [-0.5])), 1)
    with pytest.raises(ValueError, match="<= 0"):
        _parse_generations(batch(generate_item([5], [0.7])), 1)
    with pytest.raises(ValueError, match="not a list of GenerateResponse"):
        _parse_generations(httpx.Response(200, json=[{"text": 1}]), 1)
    with pytest.raises(ValueError, match="not a list of GenerateResponse"):
        _parse_generations(
            httpx.Response(200, json=generate_item([5], [-0.5])), 1
        )  # a single, unbatched answer
