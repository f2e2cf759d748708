"""The `reasoning_gym` verifier's spec: which reasoning-gym item a completion answers.

An item is named, not carried: `dataset`, the dataset's `config` (its config dataclass's
fields, `seed` and `size` among them) and `index`. The reward service's worker regenerates
the entry (`reasoning_gym.create_dataset(dataset, **config)[index]`) and scores with that
dataset's own `score_answer(answer, entry)`, so a spec stays small whatever the entry's
metadata holds (grids, graphs, tuples a JSON round trip would turn into lists).

Regeneration trusts the generator to be a pure function of (config, index) under the same
reasoning-gym release on both sides. `entry_sha256` (what `asyncrl submit --reasoning-gym`
always sends) makes that checked rather than trusted: a regenerated entry whose question and
answer hash differently is `invalid_input` (`entry_mismatch`), never scored against the
wrong gold.

Checked against **reasoning-gym 0.1.25** (PyPI): `DATASETS` is its registry's names
(`reasoning_gym.factory.DATASETS`), held to the installed package by a unit test, so the
rollout service, which does not install reasoning-gym, refuses an unknown dataset at
submission (422). A bad `config` is only found where the package is installed: by
`asyncrl submit` when it builds the jobs, else by the reward worker (`invalid_input`).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

RELEASE = "0.1.25"
MAX_CONFIG_CHARS = 10_000  # a config is a handful of scalars; `composite` lists a few datasets
MAX_SIZE = 1_000_000  # some generators build `size` items at construction

DATASETS = frozenset(
    """
    ab acre advanced_geometry aiw arc_1d arc_agi base_conversion basic_arithmetic bf
    binary_alternation binary_matrix bitwise_arithmetic boxnet caesar_cipher calendar_arithmetic
    chain_sum circuit_logic codeio coin_flip color_cube_rotation complex_arithmetic composite
    count_bits count_primes countdown course_schedule cryptarithm decimal_arithmetic
    decimal_chain_sum dice emoji_mystery family_relationships figlet_font fraction_simplification
    futoshiki game_of_life game_of_life_halting gcd graph_color group_anagrams gsm_symbolic
    intermediate_integration isomorphic_strings jugs kakurasu knight_swap knights_knaves
    largest_island lcm leg_counting letter_counting letter_jumble list_functions mahjong_puzzle
    manipulate_matrix maze mini_sudoku modulo_grid n_queens needle_haystack number_filtering
    number_format number_sequence number_sorting palindrome_generation palindrome_partitioning
    path_star polynomial_equations polynomial_multiplication pool_matrix power_function
    prime_factorization products propositional_logic puzzle24 quantum_lock ransom_note rearc
    rectangle_count rotate_matrix rotten_oranges rubiks_cube rush_hour self_reference
    sentence_reordering shortest_path simple_equations simple_geometry simple_integration sokoban
    spell_backward spiral_matrix string_insertion string_manipulation string_splitting
    string_synthesis sudoku survo syllogism time_intervals tower_of_hanoi tsumego word_ladder
    word_sequence_reversal word_sorting zebra_puzzles
    """.split()  # noqa: SIM905 -- 106 names read better as a block than one per line
)


def entry_digest(entry: dict[str, Any]) -> str:
    """sha256 of an entry's question and answer: what both sides compare after regenerating it."""
    text = json.dumps([entry.get("question"), entry.get("answer")], ensure_ascii=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


class ReasoningGymSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    dataset: str = Field(description=f"a reasoning-gym {RELEASE} dataset name, e.g. gsm_symbolic")
    config: dict[str, Any] = Field(
        description="the dataset's config fields as passed to create_dataset; `seed` and `size` required"
    )
    index: int = Field(ge=0, description="the entry's index in the dataset (below config.size)")
    entry_sha256: str | None = Field(
        None,
        pattern="^[0-9a-f]{64}$",
        description="sha256 of the entry's [question, answer] as JSON; a regenerated entry that differs is refused",
    )
    boxed_fallback: bool = Field(
        False,
        description="no <answer> tag: score the last \\boxed{} instead (reasoning-gym itself would score None)",
    )

    @field_validator("dataset")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in DATASETS:
            raise ValueError(f"unknown reasoning-gym {RELEASE} dataset {name[:100]!r}")
        return name

    @field_validator("config")
    @classmethod
    def _bounded(cls, config: dict[str, Any]) -> dict[str, Any]:
        if len(json.dumps(config, default=str)) > MAX_CONFIG_CHARS:
            raise ValueError(f"config longer than {MAX_CONFIG_CHARS} characters as JSON")
        for key in ("seed", "size"):
            value = config.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"config.{key} must be a non-negative integer (the item is regenerated)")
        if not 1 <= config["size"] <= MAX_SIZE:
            raise ValueError(f"config.size must be between 1 and {MAX_SIZE}")
        return config

    @model_validator(mode="after")
    def _in_range(self) -> ReasoningGymSpec:
        if self.index >= self.config["size"]:
            raise ValueError(f"index {self.index} is not below config.size {self.config['size']}")
        return self
