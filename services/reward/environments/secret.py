"""`secret`: the CPU demo's environment, where the tool is worth something.

The episode's secret is `length` letters drawn from `letters` by `random.Random(seed)`, so the
request's seed alone determines it (no state). The one tool, `lookup`, answers the secret
itself; the final answer scores the fraction of the secret's positions it gets right. A policy
that learns to call the tool and copy its answer scores 1; one that guesses scores about
1 / len(letters).
"""

from __future__ import annotations

import random

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.proto.environments import StepRequest, StepResponse, ToolCall
from asyncrl.services.reward.environments.base import Environment, function, reply

MAX_LENGTH = 256


class SecretArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    letters: str = Field(
        "abcdefghij", min_length=1, max_length=1024, description="the alphabet of the secret"
    )
    length: int = Field(3, ge=1, le=MAX_LENGTH, description="letters in the secret")


def secret_word(seed: int, letters: str, length: int) -> str:
    rng = random.Random(seed)
    return "".join(rng.choice(letters) for _ in range(length))


def secret_reward(secret: str, text: str) -> float:
    """Fraction of the secret's positions the answer has right (missing positions are wrong,
    characters past the secret's length are ignored)."""
    return sum(got == want for got, want in zip(text, secret)) / len(secret)


class SecretEnvironment(Environment):
    name = "secret"
    description = (
        "Guess a secret word of `length` letters from `letters` (the seed picks it). The tool "
        "`lookup` tells the secret; the final answer earns the fraction of positions it gets right."
    )
    tools = [function("lookup", "Tell the secret word.")]
    judges = True
    Args = SecretArgs

    async def call(self, args: SecretArgs, req: StepRequest, call: ToolCall) -> StepResponse:
        # `lookup` takes no arguments; whatever a small model writes after the tool's name is ignored
        return reply(secret_word(req.seed, args.letters, args.length), reward=0.0)

    async def answer(self, args: SecretArgs, req: StepRequest, text: str) -> StepResponse:
        secret = secret_word(req.seed, args.letters, args.length)
        return reply(reward=secret_reward(secret, text), done=True)
