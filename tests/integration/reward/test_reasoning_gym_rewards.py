"""reasoning-gym items through the real reward service (uvicorn on loopback, worker processes)
with the real reasoning-gym 0.1.25: the `reasoning_gym` verifier's rewards equal the dataset's
own `score_answer(extract_answer(completion), entry)`, computed here in the test's process on
entries it generates itself, while the service's workers regenerate them from the spec.

The same hand-made completions go through `math` (strict and lenient): strict refuses the
unmarked ones that lenient math-verify pays. The table of all three verdicts in
docs/reasoning-gym.md is rendered from these results and must equal them.
"""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import pytest
import reasoning_gym
from engine_server import free_port
from prometheus_client.parser import text_string_to_metric_families
from reasoning_gym.utils import extract_answer

from asyncrl.proto.reasoning_gym import entry_digest
from asyncrl.services.runtime.serving import serve_app_in_thread

DOC = Path(__file__).resolve().parents[3] / "docs" / "reasoning-gym.md"
TABLE_START, TABLE_END = "<!-- verdicts:start -->", "<!-- verdicts:end -->"

# The items: two numeric datasets and two whose answers are words.
ITEMS = {
    "gsm": ("gsm_symbolic", {"seed": 42, "size": 4}, 0),
    "arith": ("basic_arithmetic", {"seed": 7, "size": 4}, 2),
    "letters": ("letter_counting", {"seed": 3, "size": 4}, 1),
    "words": ("word_sorting", {"seed": 1, "size": 4}, 0),
}


def wrong(item: str, gold: str) -> str:
    """A well-formed wrong answer: the number plus one, the words in the opposite order."""
    if item == "words":
        return ", ".join(reversed(gold.split(", ")))
    return str(int(gold) + 1)


# (case, item, completion template, whether the completion marks an answer for strict math).
# `marked` describes the input, written by hand; every verdict below is computed.
CASES = [
    ("tag", "gsm", "<answer>{gold}</answer>", True),
    ("boxed only", "gsm", "The total is \\boxed{{{gold}}}.", True),
    ("unmarked", "gsm", "maybe {gold}", False),
    ("tag, wrong", "gsm", "<answer>{wrong}</answer>", True),
    ("#### line", "gsm", "12 + 24 = 36.\n#### {gold}", True),
    ("Answer: line", "gsm", "Answer: {gold}", True),
    ("tag with unit", "gsm", "<answer>{gold} students</answer>", True),
    ("tag, decimal", "gsm", "<answer>{gold}.0</answer>", True),
    ("two tags", "gsm", "<answer>{wrong}</answer> no: <answer>{gold}</answer>", True),
    ("box vs tag", "gsm", "\\boxed{{{gold}}} <answer>{wrong}</answer>", True),
    ("empty", "gsm", "", False),
    ("tag", "arith", "<answer>{gold}</answer>", True),
    ("boxed only", "arith", "\\boxed{{{gold}}}", True),
    ("tag with =", "arith", "<answer>= {gold}</answer>", True),
    ("tag, wrong", "arith", "<answer>{wrong}</answer>", True),
    ("tag", "letters", "<answer>{gold}</answer>", True),
    ("tag with unit", "letters", "<answer>{gold} times</answer>", True),
    ("prose", "letters", "It appears {gold} times.", False),
    ("tag", "words", "<answer>{gold}</answer>", True),
    ("tag, wrong", "words", "<answer>{wrong}</answer>", True),
]


@pytest.fixture(scope="module")
def entries():
    """Each item's entry and its dataset, generated in this process."""
    out = {}
    for key, (name, config, index) in ITEMS.items():
        dataset = reasoning_gym.create_dataset(name, **config)
        out[key] = (dataset, dataset[index])
    return out


@pytest.fixture(scope="module")
def service():
    from asyncrl.services.reward.app import build_app
    from asyncrl.services.reward.config import RewardSettings

    settings = RewardSettings(
        code_enabled=False,
        math_workers=1,
        math_timeout_s=10.0,
        math_strict=True,  # the default of specs that leave `strict` unset (the lenient ones say false)
        reasoning_gym_enabled=True,
        reasoning_gym_workers=2,
        reasoning_gym_timeout_s=30.0,  # a loaded 2-core box: generous, nothing here is slow
    )
    http = serve_app_in_thread(build_app(settings), free_port(), "reward")
    with httpx.Client(base_url=http.url, timeout=120) as client:
        yield client
    http.stop()


def metric(client, name: str, **labels) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return 0.0


def rg_spec(key: str, entry: dict, **extra) -> dict:
    name, config, index = ITEMS[key]
    return {"verifier": "reasoning_gym", "dataset": name, "config": config, "index": index,
            "entry_sha256": entry_digest(entry), **extra}  # fmt: skip


def score(client, items: list[dict]) -> dict[str, dict]:
    reply = client.post("/v1/rewards", json={"items": items})
    assert reply.status_code == 200, reply.text
    return {r["id"]: r for r in reply.json()["results"]}


def boxed_inside(completion: str) -> str | None:
    """The test's own reading of `\\boxed{X}` (its completions nest no braces inside)."""
    found = re.findall(r"\\boxed\{([^{}]*)\}", completion)
    return found[-1].strip() if found else None


def verdict(result: dict) -> str:
    return f"{result['reward']:g}" if result["status"] == "scored" else result["status"]


def render(rows: list[tuple[str, str, str, str, str, str]]) -> str:
    lines = [
        "| dataset | case | completion | reasoning_gym | reasoning_gym, boxed_fallback | math strict | math (lenient) |",
        "|---|---|---|---|---|---|---|",
    ]
    for dataset, case, completion, *cells in rows:
        shown = completion.replace("\n", "⏎").replace("|", "\\|") or "(empty)"
        lines.append(f"| {dataset} | {case} | `{shown}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def test_rewards_equal_the_datasets_own_scores_and_the_doc_table(service, entries):
    items, expected, rows = [], {}, []
    for n, (_, key, template, _) in enumerate(CASES):
        dataset, entry = entries[key]
        completion = template.format(gold=entry["answer"], wrong=wrong(key, entry["answer"]))
        answer = extract_answer(completion)
        expected[f"rg{n}"] = dataset.score_answer(answer, entry)
        expected[f"rgbox{n}"] = dataset.score_answer(
            answer if answer is not None else boxed_inside(completion), entry
        )
        items += [
            {"id": f"rg{n}", "completion": completion, "spec": rg_spec(key, entry)},
            {"id": f"rgbox{n}", "completion": completion, "spec": rg_spec(key, entry, boxed_fallback=True)},
            {"id": f"strict{n}", "completion": completion,
             "spec": {"verifier": "math", "answer": entry["answer"], "strict": True}},
            {"id": f"lenient{n}", "completion": completion,
             "spec": {"verifier": "math", "answer": entry["answer"], "strict": False}},
        ]  # fmt: skip
    got = score(service, items)

    for n, (case, key, _, marked) in enumerate(CASES):
        completion = items[4 * n]["completion"]
        tagged = extract_answer(completion) is not None
        # formatted: an answer where the verifier requires one (the tag; or the box, with the fallback)
        has_format = {"rg": tagged, "rgbox": tagged or boxed_inside(completion) is not None}
        for kind in ("rg", "rgbox"):
            result = got[f"{kind}{n}"]
            assert (result["status"], result["reward"], result["formatted"]) == (
                "scored",
                expected[f"{kind}{n}"],
                has_format[kind],
            ), (case, key, result)
        strict = got[f"strict{n}"]
        # formatted for math: marked, and math-verify reads an answer out of the mark (none out of words)
        assert strict["formatted"] is (marked and key != "words"), (case, key, strict)
        if not marked:  # strict mode pays no unmarked answer, whatever lenient math-verify finds in it
            assert (strict["status"], strict["reward"], strict["details"]["unmarked"]) == (
                "scored",
                0.0,
                True,
            )
        name = ITEMS[key][0]
        rows.append(
            (name, case, completion, *(verdict(got[f"{k}{n}"]) for k in ("rg", "rgbox", "strict", "lenient")))
        )

    # The case: lenient math-verify pays "maybe 70", strict does not, reasoning-gym neither.
    unmarked = next(n for n, c in enumerate(CASES) if c[0] == "unmarked")
    assert [got[f"{k}{unmarked}"]["reward"] for k in ("lenient", "strict", "rg")] == [1.0, 0.0, 0.0]
    gsm = entries["gsm"][1]
    default = score(service, [{"id": "d", "completion": f"maybe {gsm['answer']}",
                               "spec": {"verifier": "math", "answer": gsm["answer"]}}])  # fmt: skip
    assert (default["d"]["reward"], default["d"]["details"]["strict"]) == (0.0, True)  # math_strict applies
    # gsm_symbolic's partial credit for a well-formed wrong number passes through unchanged.
    wrong_tag = next(n for n, c in enumerate(CASES) if c[:2] == ("tag, wrong", "gsm"))
    assert got[f"rg{wrong_tag}"]["reward"] == expected[f"rg{wrong_tag}"] > 0

    table = render(rows)
    text = DOC.read_text()
    documented = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert documented == table, f"docs/reasoning-gym.md's table is stale; the computed one:\n{table}"


def test_what_cannot_be_judged_is_a_status_never_a_zero(service, entries):
    gsm = entries["gsm"][1]
    boxnet = reasoning_gym.create_dataset("boxnet", seed=1, size=2)
    failures0 = metric(service, "asyncrl_reward_verifier_failures_total", verifier="reasoning_gym",
                       reason="rg_score_error")  # fmt: skip
    got = score(
        service,
        [
            # boxnet's scorer raises on this answer (TypeError: 'float' object is not iterable)
            {"id": "crash", "completion": "<answer>1e999999</answer>",
             "spec": {"verifier": "reasoning_gym", "dataset": "boxnet", "config": {"seed": 1, "size": 2},
                      "index": 0, "entry_sha256": entry_digest(boxnet[0])}},
            {"id": "mismatch", "completion": "<answer>1</answer>", "spec": rg_spec("gsm", gsm, entry_sha256="0" * 64)},
            {"id": "config", "completion": "<answer>1</answer>",
             "spec": {**rg_spec("gsm", gsm), "config": {"seed": 42, "size": 4, "no_such_field": 1}}},
        ],
    )  # fmt: skip
    with pytest.raises(TypeError):  # the package's own scorer, called directly, raises the same way
        boxnet.score_answer("1e999999", boxnet[0])
    assert (got["crash"]["status"], got["crash"]["details"]["reason"]) == ("error", "rg_score_error")
    assert "TypeError" in got["crash"]["details"]["error"]
    assert (got["mismatch"]["status"], got["mismatch"]["details"]["reason"]) == (
        "invalid_input",
        "entry_mismatch",
    )
    assert (got["config"]["status"], got["config"]["details"]["reason"]) == (
        "invalid_input",
        "dataset_config_invalid",
    )
    assert "no_such_field" in got["config"]["details"]["error"]
    after = metric(
        service, "asyncrl_reward_verifier_failures_total", verifier="reasoning_gym", reason="rg_score_error"
    )
    assert after - failures0 == 1
    # The worker that reported the crash is still serving: the next item is scored.
    again = score(
        service,
        [{"id": "next", "completion": f"<answer>{gsm['answer']}</answer>", "spec": rg_spec("gsm", gsm)}],
    )
    assert (again["next"]["status"], again["next"]["reward"]) == ("scored", 1.0)


def test_an_unknown_dataset_is_refused_with_a_message(service):
    reply = service.post(
        "/v1/rewards",
        json={"items": [{"id": "u", "completion": "x", "spec": {"verifier": "reasoning_gym", "dataset": "gsm_symbolc",
                                                                 "config": {"seed": 0, "size": 1}, "index": 0}}]},
    )  # fmt: skip
    assert reply.status_code == 422
    assert "unknown reasoning-gym 0.1.25 dataset 'gsm_symbolc'" in reply.text
