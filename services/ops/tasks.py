"""Prompt sets generated on the fly (nothing is downloaded): what `asyncrl demo` trains on.

* `reverse`: the tiny model's task, `<bos>abc>` → `cba` (the `reverse` verifier).
* `math`: arithmetic for a small chat model: sums, differences and products (`easy`: one
  operation on numbers up to 30; `hard`: two-digit operands and three-number expressions), and
  one-sentence word problems, asked as chat `messages` with a system prompt
  that asks for the final answer in `\\boxed{}`, scored by the `math` verifier (math-verify).

The held-out sets of a math task are pure functions of their seeds and sizes, and training
prompts never repeat one of their problems: `MathTask.train_prompts` rejects any problem text
that a held-out set holds, so evaluation measures generalisation, not recall. A held-out set
may ask its problems after one worked example (`worked_example`): a user turn and an
assistant turn that answers in `\\boxed{}`. SmolLM2-135M-Instruct boxes almost no answer
from the system prompt alone and almost every answer after the example, so a set asked that
way measures arithmetic with the format already given (docs/architecture.md, evaluations).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SYSTEM_PROMPT = (
    "You are a helpful math assistant. Solve the problem, then give the final answer in \\boxed{}."
)

NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Maya", "Omar", "Zoe", "Leo", "Nina")
ITEMS = ("apples", "books", "marbles", "stickers", "pencils", "cookies", "coins", "cards")


def _arith(rng: random.Random) -> tuple[str, int]:
    kind = rng.choice(("add", "sub", "mul", "add3", "mix3"))
    if kind == "add":
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        return f"What is {a} + {b}?", a + b
    if kind == "sub":
        a, b = sorted((rng.randint(10, 99), rng.randint(10, 99)), reverse=True)
        return f"What is {a} - {b}?", a - b
    if kind == "mul":
        a, b = rng.randint(2, 12), rng.randint(3, 25)
        return f"What is {a} * {b}?", a * b
    if kind == "add3":
        a, b, c = (rng.randint(2, 60) for _ in range(3))
        return f"What is {a} + {b} + {c}?", a + b + c
    a, b, c = rng.randint(20, 90), rng.randint(2, 30), rng.randint(2, 19)
    return f"What is {a} + {b} - {c}?", a + b - c


def _word(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(("more", "give", "both", "each"))
    if kind == "more":
        a, b = rng.randint(3, 40), rng.randint(2, 30)
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    if kind == "give":
        a = rng.randint(10, 60)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    if kind == "both":
        a, b, c = rng.randint(5, 40), rng.randint(2, 20), rng.randint(1, 9)
        question = (
            f"{name} has {a} {item}, buys {b} more and then loses {c}. How many {item} does {name} have?"
        )
        return question, a + b - c
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    return f"{name} has {a} bags with {b} {item} in each bag. How many {item} are there in total?", a * b


def _arith_easy(rng: random.Random) -> tuple[str, int]:
    kind = rng.choice(("add", "sub", "mul"))
    if kind == "add":
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        return f"What is {a} + {b}?", a + b
    if kind == "sub":
        a, b = sorted((rng.randint(2, 30), rng.randint(2, 30)), reverse=True)
        return f"What is {a} - {b}?", a - b
    a, b = rng.randint(2, 9), rng.randint(2, 9)
    return f"What is {a} * {b}?", a * b


def _word_easy(rng: random.Random) -> tuple[str, int]:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(("more", "give", "each"))
    if kind == "more":
        a, b = rng.randint(2, 20), rng.randint(2, 20)
        return f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", a + b
    if kind == "give":
        a = rng.randint(5, 20)
        b = rng.randint(1, a - 1)
        return f"{name} has {a} {item} and gives away {b}. How many {item} are left?", a - b
    a, b = rng.randint(2, 6), rng.randint(2, 6)
    return f"{name} has {a} bags with {b} {item} in each bag. How many {item} are there in total?", a * b


# easy: numbers up to 30, one operation (SmolLM2-135M greedy: ~29% correct, 24% sampled at T=0.7);
# hard: two-digit operands and three-number expressions (~9-17% greedy).
LEVELS = {"easy": (_arith_easy, _word_easy), "hard": (_arith, _word)}


def math_problem(rng: random.Random, word_fraction: float = 0.4, level: str = "easy") -> tuple[str, int]:
    """One problem and its integer answer."""
    arith, word = LEVELS[level]
    return word(rng) if rng.random() < word_fraction else arith(rng)


# One worked exchange in the answer format, asked before a `worked_example` set's problem (never
# a problem of the hard level, whose sums have two-digit operands or three terms).
WORKED_EXAMPLE = ("What is 3 + 4?", "3 + 4 = 7.\n\n\\boxed{7}")


def math_prompt(
    question: str, answer: int, prompt_id: str | None = None, worked_example: bool = False
) -> dict:
    """A `/v1/rollouts` prompt: chat messages with the system prompt (and, with `worked_example`,
    one worked exchange), scored by `math`."""
    example = [
        {"role": "user", "content": WORKED_EXAMPLE[0]},
        {"role": "assistant", "content": WORKED_EXAMPLE[1]},
    ]
    prompt = {
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            *(example if worked_example else []),
            {"role": "user", "content": question},
        ],
        "reward_spec": {"verifier": "math", "answer": str(answer)},
    }
    if prompt_id is not None:
        prompt["prompt_id"] = prompt_id
    return prompt


@dataclass(frozen=True)
class HeldoutSet:
    """`size` distinct problems of `level`, fixed by `seed`, asked as `math_prompt` asks them."""

    seed: int = 1234
    size: int = 200
    word_fraction: float = 0.4
    level: str = "easy"
    worked_example: bool = False

    def problems(self) -> list[tuple[str, int]]:
        rng, seen, out = random.Random(self.seed), set(), []
        while len(out) < self.size:
            q, a = math_problem(rng, self.word_fraction, self.level)
            if q not in seen:
                seen.add(q)
                out.append((q, a))
        return out

    def prompts(self, name: str) -> list[dict]:
        """Prompt ids `<name>-<i>`."""
        return [
            math_prompt(q, a, prompt_id=f"{name}-{i}", worked_example=self.worked_example)
            for i, (q, a) in enumerate(self.problems())
        ]


@dataclass
class MathTask:
    """A training stream and held-out sets, all reproducible from their seeds: the main one
    (`eval_seed`, `eval_size`, the training level) and `more_heldout` by name."""

    eval_seed: int = 1234
    eval_size: int = 200
    word_fraction: float = 0.4
    level: str = "easy"
    more_heldout: dict[str, HeldoutSet] = field(default_factory=dict)
    worked_example: bool = False  # training and the main held-out set: after one worked exchange
    _held: set[str] = field(default_factory=set, init=False, repr=False)

    @property
    def main_heldout(self) -> HeldoutSet:
        return HeldoutSet(self.eval_seed, self.eval_size, self.word_fraction, self.level, self.worked_example)

    def heldout(self) -> list[tuple[str, int]]:
        """The main held-out set: `eval_size` distinct problems fixed by `eval_seed`."""
        return self.main_heldout.problems()

    def heldout_prompts(self) -> list[dict]:
        return self.main_heldout.prompts("heldout")

    def train_prompts(self, n: int, rng: random.Random) -> list[dict]:
        """`n` training prompts from `rng`, none of them a problem of any held-out set."""
        if not self._held:
            for held in (self.main_heldout, *self.more_heldout.values()):
                self._held.update(q for q, _ in held.problems())
        out = []
        while len(out) < n:
            q, a = math_problem(rng, self.word_fraction, self.level)
            if q not in self._held:
                out.append(math_prompt(q, a, worked_example=self.worked_example))
        return out


def reverse_prompts(n: int, letters: str, length: int, rng: random.Random) -> list[dict]:
    """`<bos>` + letters + `>`, each with its target: the letters reversed. (The tiny tokenizer,
    like Qwen2's, adds no BOS itself; a fixed first token gives the model a place to anchor
    its attention, and without it the recipe learns far more slowly.)"""
    prompts = []
    for _ in range(n):
        word = "".join(rng.choice(letters) for _ in range(length))
        prompts.append(
            {"text": f"<bos>{word}>", "reward_spec": {"verifier": "reverse", "target": word[::-1]}}
        )
    return prompts
