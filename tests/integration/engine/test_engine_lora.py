"""LoRA in the reference engine over real HTTP (uvicorn on loopback, a tiny Qwen2 built here,
adapters made with PEFT and saved as PEFT saves them): SGLang 0.5.23's `/load_lora_adapter`,
`/unload_lora_adapter` and `/generate`'s `lora_path`.

What is checked: log-probs with an adapter equal a teacher-forced forward of the PEFT-wrapped
model, for two adapters and a base row in one batch; an adapter used by a request in flight
survives newer loads and an explicit unload until that request ends, and serves it; eviction
takes the least recently used adapter that no request uses and is not pinned, and a load with
none is refused; a request naming an adapter the engine lacks is refused before any token; bad
loads are refused, counted and not listed; the endpoints need the engine token."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import httpx
import pytest
import torch
from engine_server import serve_in_thread
from peft_adapters import prompt_logprobs, save_peft_adapter, teacher_forced_logprobs
from safetensors.torch import save_file
from waiting import wait_until

from asyncrl.services.engine.adapters import LORA_DISABLED, REFUSED_ADAPTER_PATH
from asyncrl.services.ops.tinymodel import build_tiny_model

torch.set_num_threads(1)

TOKEN = "Lora-engine-test-token-4hQ8zV"  # strong enough for check_token; never used outside tests
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = [1, 5, 6, 7, 8, 9]
MAX_LOADED = 3
TOLERANCE = 1e-3  # the bound; fp32 on the CPU agrees to ~1e-6
TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict[str, Path]:
    """The model, and `weights_root` with the adapters the tests load (and some they must not)."""
    base = tmp_path_factory.mktemp("lora_engine")
    model = base / "model"
    build_tiny_model(model, seed=3, **TINY)
    root, outside = base / "root", base / "outside"
    root.mkdir()
    save_peft_adapter(model, root / "all", targets="all-linear", seed=1)
    save_peft_adapter(model, root / "qv", targets=["q_proj", "v_proj", "down_proj"], seed=2, use_rslora=True)
    for i, name in enumerate("cdefg"):  # plain adapters for the lifecycle tests
        save_peft_adapter(model, root / name, targets=["o_proj"], seed=10 + i, r=2)
    save_peft_adapter(model, root / "rank16", targets=["q_proj"], seed=3, r=16)
    save_peft_adapter(model, root / "head", targets=["lm_head"], seed=4)
    shutil.copytree(root / "c", root / "corrupt")
    (root / "corrupt" / "adapter_model.safetensors").write_bytes(b"not safetensors at all")
    other = base / "other_model"  # another hidden size: the adapter's shapes are not this model's
    build_tiny_model(other, seed=0, **{**TINY, "hidden_size": 48})
    save_peft_adapter(other, root / "othermodel", targets=["o_proj"], seed=5)
    shutil.copytree(root / "c", root / "badconfig")
    (root / "badconfig" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 2')
    save_peft_adapter(model, outside / "c", targets=["o_proj"], seed=10, r=2)
    (root / "link").symlink_to(outside / "c", target_is_directory=True)
    (root / "weights_only").mkdir()
    save_file({"x": torch.zeros(1)}, str(root / "weights_only" / "adapter_model.safetensors"))
    return {"model": model, "root": root, "outside": outside}


@pytest.fixture(scope="module")
def engine(tree):
    running = serve_in_thread(
        str(tree["model"]),
        api_token=TOKEN,
        tokenless_control=False,
        weights_root=str(tree["root"]),
        enable_lora=True,
        max_lora_rank=8,
        lora_target_modules="all",
        max_loras_per_batch=3,
        max_loaded_loras=MAX_LOADED,
        max_running_requests=8,
        seed=0,
    )
    with httpx.Client(base_url=running.url, timeout=120, headers=AUTH) as client:
        yield client
    running.stop()


@pytest.fixture
def client(engine):
    """The engine with generation running and no adapter loaded."""
    engine.post("/continue_generation", json={})
    for name in loaded(engine):
        assert engine.post("/unload_lora_adapter", json={"lora_name": name}).status_code == 200
    return engine


def load(client: httpx.Client, name: str, path: Path | str, **extra) -> httpx.Response:
    return client.post("/load_lora_adapter", json={"lora_name": name, "lora_path": str(path), **extra})


def loaded(client: httpx.Client) -> list[str]:
    """The adapters requests may name, as /v1/models lists them (after the base model)."""
    return [card["id"] for card in client.get("/v1/models").json()["data"][1:]]


def adapters(client: httpx.Client) -> dict[str, dict]:
    return {a["name"]: a for a in client.get("/server_info").json()["lora_adapters"]}


def stats(client: httpx.Client) -> dict:
    return client.get("/server_info").json()["internal_states"][0]


def metric(client: httpx.Client, sample: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def lora_updates(client: httpx.Client, operation: str, result: str) -> float:
    return metric(client, f'asyncrl_engine_lora_updates_total{{operation="{operation}",result="{result}"}}')


def generate(client: httpx.Client, lora_path, n: int = 8, **body) -> httpx.Response:
    params = {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 11}
    return client.post(
        "/generate",
        json={
            "input_ids": PROMPT,
            "sampling_params": params,
            "return_logprob": True,
            "lora_path": lora_path,
            **body,
        },
    )


def logprobs(answer: dict) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]])


class InFlight:
    """A /generate naming `name`, sent while generation is paused, so it stays in flight until
    `finish` continues generation; `answer` is its response."""

    def __init__(self, client: httpx.Client, name: str, n: int = 12):
        self.answer: httpx.Response | None = None
        self._thread = threading.Thread(target=self._send, args=(client, name, n))
        self._thread.start()
        wait_until(lambda: adapters(client)[name]["in_flight"] == 1, message=f"a request holds {name}")

    def _send(self, client, name, n):
        self.answer = generate(client, name, n)

    def finish(self, client: httpx.Client) -> httpx.Response:
        client.post("/continue_generation", json={})
        self._thread.join(timeout=120)
        assert self.answer is not None
        return self.answer


def paused(client: httpx.Client) -> None:
    assert client.post("/pause_generation", json={"mode": "in_place"}).status_code == 200


# ------------------------------------------------------------------------- what is sampled


def test_two_adapters_and_a_base_row_in_one_batch_match_peft(client, tree):
    """Same prompt on every row, so rows with different adapters must not share a prefill."""
    for name in ("all", "qv"):
        resp = load(client, name, tree["root"] / name)
        assert resp.status_code == 200, resp.text
    before = stats(client)
    n = 10
    resp = client.post(
        "/generate",
        json={
            "input_ids": [PROMPT] * 3,
            "lora_path": ["all", "qv", None],
            "sampling_params": {
                "max_new_tokens": n,
                "temperature": 1.0,
                "ignore_eos": True,
                "sampling_seed": 5,
            },
            "return_logprob": True,
        },
    )
    assert resp.status_code == 200, resp.text
    after = stats(client)
    # one prefill and n - 1 decode steps, three rows each: the three ran as one batch
    assert after["prefill_steps"] - before["prefill_steps"] == 1
    assert after["decode_steps"] - before["decode_steps"] == n - 1
    assert after["generated_tokens"] - before["generated_tokens"] == 3 * n
    for answer, adapter in zip(resp.json(), [tree["root"] / "all", tree["root"] / "qv", None]):
        got = logprobs(answer)
        want = teacher_forced_logprobs(tree["model"], adapter, PROMPT, answer["output_ids"])
        assert (got - want).abs().max() <= TOLERANCE, (adapter, got, want)
        if adapter is not None:  # not a no-op: the base model gives other log-probs
            base = teacher_forced_logprobs(tree["model"], None, PROMPT, answer["output_ids"])
            assert (got - base).abs().max() > 0.05
        assert answer["meta_info"]["weight_version"] == "0"
    served = adapters(client)
    assert (served["all"]["requests"], served["qv"]["requests"]) == (1, 1)


def test_prompt_logprobs_with_an_adapter_match_peft(client, tree):
    assert load(client, "qv", tree["root"] / "qv").status_code == 200
    resp = generate(client, "qv", n=3, logprob_start_len=0)
    assert resp.status_code == 200, resp.text
    got = torch.tensor([lp for lp, _, _ in resp.json()["meta_info"]["input_token_logprobs"][1:]])
    want = prompt_logprobs(tree["model"], tree["root"] / "qv", PROMPT)
    assert (got - want).abs().max() <= TOLERANCE


def test_an_unknown_adapter_is_refused_before_any_token(client, tree):
    assert load(client, "c", tree["root"] / "c").status_code == 200
    before = stats(client)
    for lora_path in ("nope", ["c", "nope"]):
        body = {"input_ids": [PROMPT, PROMPT]} if isinstance(lora_path, list) else {}
        resp = generate(client, lora_path, **body)
        assert resp.status_code == 400
        message = resp.json()["error"]["message"]
        assert "not loaded: nope" in message and "Loaded adapters: ['c']" in message
        assert "output_ids" not in resp.text
    after = stats(client)
    assert after["generated_tokens"] == before["generated_tokens"]  # nothing of either request ran
    assert adapters(client)["c"]["requests"] == 0


# ------------------------------------------------------------------------------- lifecycle


def test_an_adapter_in_use_survives_newer_loads_and_is_evicted_after(client, tree):
    root = tree["root"]
    assert load(client, "c", root / "c").status_code == 200
    paused(client)
    request = InFlight(client, "c")
    try:
        for name, expect in [("d", ["c", "d"]), ("e", ["c", "d", "e"]), ("f", ["c", "e", "f"]),
                             ("g", ["c", "f", "g"])]:  # fmt: skip
            resp = load(client, name, root / name)
            assert resp.status_code == 200, resp.text
            assert list(resp.json()["loaded_adapters"]) == expect  # d, then e, went: c is in use
    finally:
        answer = request.finish(client)
    assert answer.status_code == 200, answer.text
    out = answer.json()
    want = teacher_forced_logprobs(tree["model"], root / "c", PROMPT, out["output_ids"])
    assert (logprobs(out) - want).abs().max() <= TOLERANCE  # served by c, all along
    assert adapters(client)["c"]["in_flight"] == 0
    resp = load(client, "d", root / "d")  # c is now the least recently used, and unused
    assert resp.json() == {"success": True, "error_message": "", "loaded_adapters": {
        "f": str(root / "f"), "g": str(root / "g"), "d": str(root / "d")}}  # fmt: skip


def test_eviction_takes_the_least_recently_used_unused_unpinned_adapter(client, tree):
    root = tree["root"]
    assert load(client, "c", root / "c", pinned=True).status_code == 200
    assert load(client, "d", root / "d").status_code == 200
    assert load(client, "e", root / "e").status_code == 200
    assert generate(client, "d", n=1).status_code == 200  # order of use: c, e, d
    assert list(load(client, "f", root / "f").json()["loaded_adapters"]) == ["c", "d", "f"]  # e went
    assert generate(client, "c", n=1).status_code == 200  # d, f, c
    assert list(load(client, "g", root / "g").json()["loaded_adapters"]) == ["f", "c", "g"]  # d went
    assert loaded(client) == ["f", "c", "g"]


def test_a_load_with_every_adapter_in_use_is_refused(client, tree):
    root = tree["root"]
    for name in "cde":
        assert load(client, name, root / name).status_code == 200
    refused = lora_updates(client, "load", "refused")
    paused(client)
    requests = [InFlight(client, name, n=2) for name in "cde"]
    try:
        resp = load(client, "f", root / "f")
        assert resp.status_code == 400
        body = resp.json()
        assert body["success"] is False and body["loaded_adapters"] is None
        assert "all 3 loaded adapters (max_loaded_loras) are in use" in body["error_message"]
    finally:
        answers = [r.finish(client) for r in requests]
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert lora_updates(client, "load", "refused") == refused + 1
    assert loaded(client) == ["c", "d", "e"]
    assert load(client, "f", root / "f").status_code == 200  # free again: c goes


def test_an_unload_waits_for_the_requests_using_the_adapter(client, tree):
    root = tree["root"]
    assert load(client, "c", root / "c").status_code == 200
    paused(client)
    request = InFlight(client, "c")
    unload: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: unload.setdefault("c", client.post("/unload_lora_adapter", json={"lora_name": "c"}))
    )
    thread.start()
    try:
        wait_until(lambda: adapters(client)["c"]["leaving"], message="c is being unloaded")
        assert "c" not in loaded(client)  # new requests cannot name it any more
        late = generate(client, "c")
        assert late.status_code == 400 and "not loaded: c" in late.json()["error"]["message"]
        again = load(client, "c", root / "c")
        assert again.status_code == 400 and "is being unloaded" in again.json()["error_message"]
        assert "c" not in unload  # the unload has not answered
    finally:
        answer = request.finish(client)
        thread.join(timeout=120)
    assert answer.status_code == 200
    out = answer.json()
    want = teacher_forced_logprobs(tree["model"], root / "c", PROMPT, out["output_ids"])
    assert (logprobs(out) - want).abs().max() <= TOLERANCE
    assert unload["c"].status_code == 200
    assert unload["c"].json() == {"success": True, "error_message": "", "loaded_adapters": {}}
    assert adapters(client) == {}


# ------------------------------------------------------------------------------- bad loads


@pytest.mark.parametrize(
    ("path", "result", "message"),
    [
        ("rank16", "error", "with rank 16 is incompatible with the engine's max_lora_rank 8"),
        ("head", "error", "targets modules the engine cannot adapt in this model: ['lm_head']"),
        ("corrupt", "error", "cannot read adapter_model.safetensors"),
        ("othermodel", "error", "has lora_A (4, 48) and lora_B (48, 4), expected (4, 32) and (32, 4)"),
        ("badconfig", "error", "cannot read adapter_config.json"),
        ("weights_only", "refused", REFUSED_ADAPTER_PATH),
        ("missing", "refused", REFUSED_ADAPTER_PATH),
        ("link", "refused", REFUSED_ADAPTER_PATH),  # a link out of weights_root
        ("{outside}", "refused", REFUSED_ADAPTER_PATH),
        ("relative/c", "refused", REFUSED_ADAPTER_PATH),
    ],
)
def test_a_bad_load_is_refused_counted_and_not_listed(client, tree, path, result, message):
    if path == "{outside}":
        path = tree["outside"] / "c"
    elif not path.startswith("relative"):
        path = tree["root"] / path
    before = lora_updates(client, "load", result)
    resp = load(client, "bad", path)
    assert resp.status_code == 400
    body = resp.json()
    assert body["success"] is False and message in body["error_message"], body
    assert body["loaded_adapters"] == {}  # SGLang's LoRA manager answers with what is loaded
    assert lora_updates(client, "load", result) == before + 1
    assert "bad" not in loaded(client) and "bad" not in adapters(client)
    assert generate(client, "bad").status_code == 400


def test_loading_a_name_twice_is_refused_and_keeps_the_first(client, tree):
    assert load(client, "c", tree["root"] / "c").status_code == 200
    resp = load(client, "c", tree["root"] / "d")
    assert resp.status_code == 400
    assert resp.json() == {
        "success": False,
        "error_message": "Failed to load LoRA adapter c because it is already loaded",
        "loaded_adapters": {"c": str(tree["root"] / "c")},
    }
    assert adapters(client)["c"]["path"] == str(tree["root"] / "c")


def test_unloading_an_adapter_not_loaded_is_refused(client):
    resp = client.post("/unload_lora_adapter", json={"lora_name": "ghost"})
    assert resp.status_code == 400
    assert resp.json() == {
        "success": False,
        "error_message": "LoRA with name ghost does not exist. Loaded LoRAs: []",
        "loaded_adapters": None,
    }


def test_the_endpoints_need_the_engine_token(client, tree):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong-token-but-long-enough"}):
        resp = client.post("/load_lora_adapter", headers=headers,
                           json={"lora_name": "c", "lora_path": str(tree["root"] / "c")})  # fmt: skip
        assert resp.status_code == 401
        assert (
            client.post("/unload_lora_adapter", headers=headers, json={"lora_name": "c"}).status_code == 401
        )
    assert loaded(client) == []


def test_an_engine_without_lora_refuses_adapters(tree):
    running = serve_in_thread(str(tree["model"]), weights_root=str(tree["root"]))
    try:
        with httpx.Client(base_url=running.url, timeout=60) as plain:
            resp = load(plain, "c", tree["root"] / "c")
            assert resp.status_code == 400
            assert resp.json() == {"success": False, "error_message": LORA_DISABLED, "loaded_adapters": None}
            resp = generate(plain, "c")
            assert resp.status_code == 400
            assert (
                "LoRA adapter 'c' was requested, but LoRA is not enabled" in resp.json()["error"]["message"]
            )
            assert generate(plain, None).status_code == 200
            assert plain.get("/server_info").json()["lora_adapters"] is None
    finally:
        running.stop()
