"""Prompt sets generated on the fly (nothing is downloaded): what `asyncrl demo` trains on.

* `reverse`: the tiny model's task, `<bos>abc>` → `cba` (the `reverse` verifier).
* `math`: arithmetic for a small chat model: sums, differences and products (`easy`: one
  operation on numbers up to 30; `hard`: two-digit operands and three-number expressions), and
  one-sentence word problems, asked as chat `messages` with a system prompt
  that asks for the final answer in `\\boxed{}`, scored by the `math` verifier (math-verify).

The held-out set of a math task is a pure function of its seed and size, and training prompts
never repeat one of its problems: `MathTask.train_prompts` rejects any problem text that the
held-out set holds, so evaluation measures generalisation, not recall.
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


def math_prompt(question: str, answer: int, prompt_id: str | None = None) -> dict:
    """A `/v1/rollouts` prompt: chat messages with the system prompt, scored by `math`."""
    prompt = {
        "messages": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        "reward_spec": {"verifier": "math", "answer": str(answer)},
    }
    if prompt_id is not None:
        prompt["prompt_id"] = prompt_id
    return prompt


@dataclass
class MathTask:
    """A training stream and a held-out set, both reproducible from their seeds."""

    eval_seed: int = 1234
    eval_size: int = 200
    word_fraction: float = 0.4
    level: str = "easy"
    _heldout: list[tuple[str, int]] = field(default_factory=list, init=False, repr=False)

    def heldout(self) -> list[tuple[str, int]]:
        """`eval_size` distinct problems fixed by `eval_seed`."""
        if not self._heldout:
            rng, seen = random.Random(self.eval_seed), set()
            while len(self._heldout) < self.eval_size:
                q, a = math_problem(rng, self.word_fraction, self.level)
                if q not in seen:
                    seen.add(q)
                    self._heldout.append((q, a))
        return self._heldout

    def heldout_prompts(self) -> list[dict]:
        return [math_prompt(q, a, prompt_id=f"heldout-{i}") for i, (q, a) in enumerate(self.heldout())]

    def train_prompts(self, n: int, rng: random.Random) -> list[dict]:
        """`n` training prompts from `rng`, none of them a held-out problem."""
        held = {q for q, _ in self.heldout()}
        out = []
        while len(out) < n:
            q, a = math_problem(rng, self.word_fraction, self.level)
            if q not in held:
                out.append(math_prompt(q, a))
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
