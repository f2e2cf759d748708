"""The reference engine's control plane over real HTTP (uvicorn on loopback; `asyncrl engine`
subprocesses where startup and signals matter) with a tiny real model: the bearer token on
every control endpoint (any case of the scheme name), weak tokens and a token-less non-loopback
listener refused at start, disk updates confined to `weights_root` with one message for every
refused path, weight updates serialised and time-bounded (a dead update-group address fails
within its bound and the next disk update goes through at once), `/health` degraded while
weight sync fails or an update is stuck, and SIGTERM stopping an engine whose update is stuck."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from engine_server import free_port, serve_in_thread
from pydantic import ValidationError
from safetensors.torch import save_file
from waiting import wait_until

from asyncrl.services.engine.config import EngineSettings
from asyncrl.services.engine.updates import JOIN_GRACE_S, REFUSED_PATH, WeightUpdates
from asyncrl.services.ops.tinymodel import build_tiny_model
from asyncrl.services.runtime.auth import ENGINE_TOKEN_ENV, check_token, generate_token

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[3]
TOKEN = "Ctl-plane-test-token-7f3K9q"  # strong enough for check_token; never used outside tests
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GROUP_TIMEOUT_S = 2.0
# (path, body) of every endpoint that changes the engine's state
CONTROL = [
    ("/pause_generation", {"mode": "in_place"}),
    ("/continue_generation", {}),
    ("/abort_request", {"rid": "nobody"}),
    ("/flush_cache", None),
    ("/begin_weight_update", {}),
    ("/end_weight_update", {}),
    ("/update_weights_from_disk", {"model_path": "/nowhere", "weight_version": "666"}),
    (
        "/init_weights_update_group",
        {
            "master_address": "127.0.0.1",
            "master_port": 9,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
        },
    ),
    (
        "/update_weights_from_distributed",
        {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]], "group_name": "g"},
    ),
    ("/load_lora_adapter", {"lora_name": "x", "lora_path": "/nowhere"}),
    ("/unload_lora_adapter", {"lora_name": "x"}),
]


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict[str, Path]:
    """weights_root with a good checkpoint, and around it every shape of path that must be refused."""
    base = tmp_path_factory.mktemp("control_plane")
    model = base / "model"
    build_tiny_model(model, seed=0)
    root, outside = base / "root", base / "outside"
    (root / "v1").mkdir(parents=True)
    shutil.copy(model / "model.safetensors", root / "v1" / "model.safetensors")
    (outside / "ckpt").mkdir(parents=True)
    shutil.copy(model / "model.safetensors", outside / "ckpt" / "model.safetensors")
    (root / "dirlink").symlink_to(outside / "ckpt", target_is_directory=True)  # a directory link out
    (root / "filelink").mkdir()
    (root / "filelink" / "model.safetensors").symlink_to(outside / "ckpt" / "model.safetensors")
    (root / "empty").mkdir()
    (root / "afile").write_text("not a checkpoint")
    (root / "bad").mkdir()  # inside the root, readable, but not this model's weights
    save_file({"model.norm.weight": torch.zeros(3)}, str(root / "bad" / "model.safetensors"))
    return {"model": model, "root": root, "outside": outside}


@pytest.fixture(scope="module")
def engine(tree):
    running = serve_in_thread(
        str(tree["model"]),
        api_token=TOKEN,
        weights_root=str(tree["root"]),
        weight_group_timeout_s=GROUP_TIMEOUT_S,
        tokenless_control=False,
    )
    with httpx.Client(base_url=running.url, timeout=60) as client:
        yield running, client
    running.stop()


def metric(client: httpx.Client, sample: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def load(client: httpx.Client, path: Path | str, version: str = "1") -> httpx.Response:
    return client.post("/update_weights_from_disk", headers=AUTH,
                       json={"model_path": str(path), "weight_version": version})  # fmt: skip


# --------------------------------------------------------------------------------- the token


@pytest.mark.parametrize(("path", "body"), CONTROL, ids=[p for p, _ in CONTROL])
def test_control_endpoints_refuse_a_missing_or_wrong_token(engine, path, body):
    _, client = engine
    for headers in ({}, {"Authorization": "Bearer wrong-token-but-long-enough"}, {"Authorization": TOKEN},
                    {"Authorization": f"Basic {TOKEN}"}, {"Authorization": f"Bearer {TOKEN}x"}):  # fmt: skip
        resp = client.post(path, json=body, headers=headers)
        assert resp.status_code == 401, (path, headers, resp.text)
        assert resp.json() == {"detail": "missing or invalid bearer token"}
        assert resp.headers["www-authenticate"] == "Bearer"
    assert client.get("/get_weight_version", headers=AUTH).json() == {"weight_version": "0"}  # nothing forged


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_control_endpoints_answer_with_the_token_in_any_case_of_the_scheme(engine, tree, scheme):
    _, client = engine
    auth = {"Authorization": f"{scheme} {TOKEN}"}
    paused = client.post("/pause_generation", json={"mode": "in_place"}, headers=auth)
    assert (paused.status_code, paused.json()["status"]) == (200, "ok")
    assert client.post("/abort_request", json={"rid": "nobody"}, headers=auth).status_code == 200
    assert client.post("/continue_generation", headers=auth).status_code == 200
    assert client.post("/flush_cache", headers=auth).text == "Cache flushed.\n"
    body = {"model_path": str(tree["root"] / "v1"), "weight_version": f"v-{scheme}"}
    resp = client.post("/update_weights_from_disk", headers=auth, json=body)
    assert (resp.status_code, resp.json()["success"]) == (200, True), resp.text
    assert client.get("/get_weight_version", headers=auth).json() == {"weight_version": f"v-{scheme}"}


def test_data_endpoints_on_loopback_need_no_token_when_only_the_engine_has_one(engine):
    """`asyncrl up`'s case: a generated engine token, no ASYNCRL_API_TOKEN, loopback."""
    _, client = engine
    body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}
    assert client.post("/generate", json=body).status_code == 200
    assert (
        client.post("/generate", json=body, headers={"Authorization": f"bearer {TOKEN}"}).status_code == 200
    )
    assert client.get("/get_weight_version").status_code == 200
    assert client.get("/get_server_info").json()["api_token"] == "**********"  # never echoed
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    assert client.post("/pause_generation", json={}).status_code == 401


def _tiers(tree, **settings) -> dict[str, dict[str, int]]:
    """Status of a data and a control endpoint per Authorization header, through the real app."""
    from fastapi.testclient import TestClient

    from asyncrl.services.engine.app import build_app
    from asyncrl.services.engine.engine import InferenceEngine

    app = build_app(
        InferenceEngine(EngineSettings(model=str(tree["model"]), weights_root=str(tree["root"]), **settings))
    )
    out = {}
    with TestClient(app) as client:
        for name, headers in (("none", {}), ("api", {"Authorization": f"Bearer {API}"}), ("engine", AUTH)):
            out[name] = {
                "data": client.get("/get_weight_version", headers=headers).status_code,
                "control": client.post("/continue_generation", headers=headers).status_code,
                "probe": client.get("/health", headers=headers).status_code,
            }
    return out


API = "Shared-api-token-for-tests-2Lp8"


def test_with_asyncrl_api_token_the_data_plane_needs_a_token_too(tree, monkeypatch):
    """ASYNCRL_API_TOKEN guards every service's data plane (docs/architecture.md §9); the engine token,
    when it differs, still alone opens the control plane and is accepted on the data plane."""
    monkeypatch.setenv("ASYNCRL_API_TOKEN", API)
    assert _tiers(tree, api_token=TOKEN) == {
        "none": {"data": 401, "control": 401, "probe": 200},
        "api": {"data": 200, "control": 401, "probe": 200},
        "engine": {"data": 200, "control": 200, "probe": 200},
    }
    monkeypatch.delenv(ENGINE_TOKEN_ENV, raising=False)  # only the shared token: it is the engine's too
    assert _tiers(tree)["api"] == {"data": 200, "control": 200, "probe": 200}


def test_beyond_loopback_the_data_plane_needs_the_token(tree, monkeypatch):
    for key in [k for k in os.environ if k.startswith("ASYNCRL_")]:
        monkeypatch.delenv(key)
    assert _tiers(tree, api_token=TOKEN, host="0.0.0.0") == {
        "none": {"data": 401, "control": 401, "probe": 200},
        "api": {"data": 401, "control": 401, "probe": 200},
        "engine": {"data": 200, "control": 200, "probe": 200},
    }


@pytest.mark.parametrize(
    "weak",
    ["changeme", "s3cret", "a" * 40, "changemechangeme", "0123456", "short-but-Ok1", "has a space in it ok!"],
)
def test_weak_tokens_are_refused_at_startup(tree, weak):
    with pytest.raises(ValidationError, match="too weak"):
        EngineSettings(model=str(tree["model"]), api_token=weak)
    check_token(generate_token())  # what `asyncrl up` makes passes


def test_cli_refuses_a_weak_token_and_a_tokenless_public_listener(tree, monkeypatch):
    """`asyncrl engine` stops at once with a message (exit 2), before loading any model."""
    base = [sys.executable, "-m", "asyncrl.services.ops.cli", "engine", "--model", str(tree["model"])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_")}
    weak = subprocess.run(base, env={**env, ENGINE_TOKEN_ENV: "changeme"}, cwd=REPO, capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert weak.returncode == 2 and "too weak" in weak.stderr and "changeme" not in weak.stderr, weak.stderr
    shared = subprocess.run(base, env={**env, "ASYNCRL_API_TOKEN": "aaaaaaaaaaaaaaaaaaaa"}, cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert shared.returncode == 2 and "too weak" in shared.stderr, shared.stderr
    public = subprocess.run([*base, "--host", "0.0.0.0"], env=env, cwd=REPO, capture_output=True, text=True,
                            timeout=60, check=False)  # fmt: skip
    assert public.returncode == 2, public.stderr
    assert "refusing to listen on 0.0.0.0 without an API token" in public.stderr
    with pytest.raises(ValidationError, match="without an API token"):
        EngineSettings(model=str(tree["model"]), host="::")
    for key in [k for k in os.environ if k.startswith("ASYNCRL_")]:
        monkeypatch.delenv(key)
    assert EngineSettings(model=str(tree["model"])).host == "127.0.0.1"  # the default needs no token
    assert EngineSettings(model=str(tree["model"]), host="0.0.0.0", api_token=TOKEN).host == "0.0.0.0"


def test_tokenless_engine_serves_generation_on_loopback_and_refuses_control(tree, monkeypatch):
    for key in [k for k in os.environ if k.startswith("ASYNCRL_")]:
        monkeypatch.delenv(key)
    running = serve_in_thread(str(tree["model"]), weights_root=str(tree["root"]), tokenless_control=False)
    try:
        assert running.url.startswith("http://127.0.0.1:")
        body = {"input_ids": [1, 5, 6], "sampling_params": {"max_new_tokens": 2}}
        assert httpx.post(f"{running.url}/generate", json=body, timeout=60).status_code == 200
        for path, body in CONTROL:
            resp = httpx.post(f"{running.url}{path}", json=body, timeout=60)
            assert resp.status_code == 403, (path, resp.text)
            assert "started without an API token" in resp.json()["detail"]
        assert httpx.get(f"{running.url}/get_weight_version").json() == {"weight_version": "0"}
        assert running.engine.scheduler.paused is None
    finally:
        running.stop()


# --------------------------------------------------------------------------------- weights_root


def test_every_refused_path_gets_the_same_message(engine, tree):
    _, client = engine
    root, outside = tree["root"], tree["outside"]
    refused = [
        "v1",  # relative
        f"{root}/../outside/ckpt",  # traversal
        f"{root}/v1/../../outside/ckpt",
        str(outside / "ckpt"),  # outside, absolute
        str(root / "dirlink"),  # a symlink inside the root to a directory outside
        str(root / "filelink"),  # a directory inside whose weight file links outside
        str(root / "missing"),
        str(root / "afile"),  # not a directory
        str(root / "empty"),  # no *.safetensors
        "/etc",
        "/",
        f"{root}/v1\x00",
    ]
    before = metric(client, 'asyncrl_engine_weight_updates_total{result="refused",source="disk"}')
    for path in refused:
        resp = load(client, path, "forged")
        assert resp.status_code == 400, (path, resp.text)
        assert resp.json() == {"success": False, "message": REFUSED_PATH, "num_paused_requests": 0}, path
    after = metric(client, 'asyncrl_engine_weight_updates_total{result="refused",source="disk"}')
    assert after - before == len(refused)
    assert client.get("/get_weight_version", headers=AUTH).json()["weight_version"] != "forged"
    assert client.get("/health").status_code == 200  # refusals do not touch the weights: still healthy
    inside = load(client, f"{root}/empty/../v1", "via-dotdot-inside")  # '..' that stays inside is fine
    assert inside.status_code == 200, inside.text


def test_without_weights_root_disk_updates_are_refused(tree):
    running = serve_in_thread(str(tree["model"]), api_token=TOKEN, weights_root=None, tokenless_control=False)
    try:
        resp = httpx.post(f"{running.url}/update_weights_from_disk", headers=AUTH, timeout=60,
                          json={"model_path": str(tree["root"] / "v1")})  # fmt: skip
        assert resp.status_code == 400
        assert (
            resp.json()["message"] == "update_weights_from_disk is disabled: the engine has no weights_root"
        )
    finally:
        running.stop()


# --------------------------------------------------------------------------------- bounded updates


def blackhole() -> socket.socket:
    """A dead rendezvous address: connections queue in the kernel and nobody ever answers them
    (torch's TCPStore client then waits past its own timeout)."""
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)
    return hole


def queued_connections(hole: socket.socket) -> int:
    """Connections waiting in the blackhole's accept queue (the rx_queue of a listening socket
    in /proc/net/tcp): a rendezvous that has begun."""
    port = hole.getsockname()[1]
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:  # 0A: LISTEN
            return int(fields[4].split(":")[1], 16)
    return 0


def join_body(hole: socket.socket, group: str) -> dict:
    return {"master_address": "127.0.0.1", "master_port": hole.getsockname()[1], "rank_offset": 1,
            "world_size": 2, "group_name": group, "backend": "gloo"}  # fmt: skip


def test_dead_group_address_fails_within_the_bound_then_a_disk_update_is_prompt(engine, tree):
    _, client = engine
    with blackhole() as hole:
        t0 = time.monotonic()
        resp = client.post("/init_weights_update_group", headers=AUTH, json=join_body(hole, "dead"))
        took = time.monotonic() - t0
        assert resp.status_code == 400 and resp.json()["success"] is False, resp.text
        assert "'dead'" in resp.json()["message"]
        assert took < GROUP_TIMEOUT_S + JOIN_GRACE_S + 3, took
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["reason"] == "weight_update_failed"
        assert "(group)" in health.json()["message"]
        t0 = time.monotonic()
        ok = load(client, tree["root"] / "v1", "after-dead-group")
        assert ok.status_code == 200 and ok.json()["success"], ok.text
        assert time.monotonic() - t0 < 5
    assert client.get("/health").status_code == 200
    assert client.get("/get_weight_version", headers=AUTH).json() == {"weight_version": "after-dead-group"}


def test_a_burst_of_joins_to_a_blackhole_does_not_hold_weight_sync(engine, tree):
    """Eight joins naming an address that accepts and never answers: one takes the turn and
    fails within its bound, the others are refused at once (409); the disk update sent right
    after them waits at most for that one, and /generate never waits at all."""
    _, client = engine
    with blackhole() as hole:
        body = join_body(hole, "blackhole")
        t0 = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            joins = [pool.submit(client.post, "/init_weights_update_group", headers=AUTH, json=body)
                     for _ in range(8)]  # fmt: skip
            wait_until(lambda: sum(f.done() for f in joins) >= 7, message="seven joins are refused at once")
            gen = client.post("/generate", headers=AUTH, json={"input_ids": [1, 5], "sampling_params":
                                                               {"max_new_tokens": 2}})  # fmt: skip
            assert gen.status_code == 200 and time.monotonic() - t0 < GROUP_TIMEOUT_S
            update = load(client, tree["root"] / "v1", "after-burst")
            statuses = sorted(f.result().status_code for f in joins)
        took = time.monotonic() - t0
    assert statuses == [400] + [409] * 7, statuses
    assert update.status_code == 200, update.text
    assert took < GROUP_TIMEOUT_S + JOIN_GRACE_S + 5, took
    assert client.get("/health").status_code == 200


# --------------------------------------------------------------------------------- health


def test_the_health_rule():
    """Failures (error, timeout) degrade until a later success; refusals and busy answers change
    nothing; a joined group clears only a failed join, not stale weights."""
    u = WeightUpdates()
    assert u.degraded() is None
    u.record("disk", "error", "shape mismatch")
    assert u.degraded()["reason"] == "weight_update_failed" and "(disk)" in u.degraded()["message"]
    for source, result in (("group", "ok"), ("disk", "refused"), ("disk", "busy")):
        u.record(source, result)
        assert u.degraded() is not None, (source, result)
    u.record("distributed", "ok")
    assert u.degraded() is None and u.last_success_at is not None
    u.record("group", "timeout", "dead address")
    assert "(group)" in u.degraded()["message"]
    u.record("group", "ok")
    assert u.degraded() is None


def test_health_is_degraded_after_a_failed_update_until_one_succeeds(engine, tree):
    _, client = engine
    assert load(client, tree["root"] / "v1", "good").status_code == 200
    assert client.get("/health").status_code == 200
    errors = metric(client, 'asyncrl_engine_weight_updates_total{result="error",source="disk"}')
    bad = load(client, tree["root"] / "bad", "bad")
    assert bad.status_code == 400 and "shape mismatch" in bad.json()["message"]  # the check of the weights
    health = client.get("/health")
    assert health.status_code == 503
    body = health.json()
    assert (body["status"], body["reason"]) == ("degraded", "weight_update_failed")
    assert "(disk)" in body["message"] and body["last_success_at"] > 0
    assert metric(client, 'asyncrl_engine_weight_updates_total{result="error",source="disk"}') == errors + 1
    assert metric(client, "asyncrl_engine_weight_sync_degraded") == 1
    assert client.get("/get_weight_version", headers=AUTH).json() == {"weight_version": "good"}
    assert load(client, tree["outside"] / "ckpt").status_code == 400  # a refusal changes nothing
    assert client.get("/health").status_code == 503
    before = time.time()
    assert load(client, tree["root"] / "v1", "good-again").status_code == 200
    assert client.get("/health").status_code == 200 and client.get("/health").content == b""
    assert metric(client, "asyncrl_engine_weight_sync_degraded") == 0
    assert metric(client, "asyncrl_engine_weight_update_last_success_timestamp_seconds") >= before - 1


def test_health_reports_an_update_stuck_past_its_deadline(tree):
    """A weight copy that has started cannot be withdrawn: past the deadline it is reported
    (503, weight_update_stuck) and the update still completes."""
    running = serve_in_thread(str(tree["model"]), api_token=TOKEN, weights_root=str(tree["root"]),
                              weight_update_timeout_s=1.0, tokenless_control=False)  # fmt: skip
    apply = running.engine.runner.apply_weights
    # time is the subject: a weight copy that outlasts the 1 s update deadline
    running.engine.runner.apply_weights = lambda named: (time.sleep(3.0), apply(named))
    try:
        box = {}
        thread = threading.Thread(target=lambda: box.update(r=httpx.post(
            f"{running.url}/update_weights_from_disk", headers=AUTH, timeout=60,
            json={"model_path": str(tree["root"] / "v1"), "weight_version": "slow"})))  # fmt: skip
        thread.start()
        health = wait_until(lambda: (h := httpx.get(f"{running.url}/health")).status_code == 503 and h,
                            timeout=10, interval=0.1, message="the update is reported stuck")  # fmt: skip
        assert health.json()["reason"] == "weight_update_stuck"
        assert "disk" in health.json()["message"]
        assert running.engine.updates.pending == 1
        thread.join(30)
        assert box["r"].status_code == 200, box["r"].text
        assert httpx.get(f"{running.url}/health").status_code == 200
        assert httpx.get(f"{running.url}/get_weight_version", headers=AUTH).json() == {
            "weight_version": "slow"
        }
    finally:
        running.stop()


# --------------------------------------------------------------------------------- SIGTERM


def test_sigterm_stops_the_engine_while_an_update_is_stuck(tree):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_")}
    env.update({ENGINE_TOKEN_ENV: TOKEN, "OMP_NUM_THREADS": "1"})
    cmd = [sys.executable, "-m", "asyncrl.services.ops.cli", "engine", "--model", str(tree["model"]), "--port", str(port),
           "--weight-group-timeout-s", "600", "--log-level", "warning"]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with blackhole() as hole:
        proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:

            def healthy() -> bool:
                assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                try:
                    return httpx.get(f"{url}/health", timeout=1).status_code == 200
                except httpx.TransportError:
                    return False

            wait_until(healthy, timeout=120, interval=0.2, message="the engine is healthy")
            body = join_body(hole, "stuck")
            joining = threading.Thread(target=lambda: _post_quietly(f"{url}/init_weights_update_group", body),
                                       daemon=True)  # fmt: skip
            joining.start()
            info = f"{url}/get_server_info"
            wait_until(lambda: httpx.get(info, headers=AUTH).json()["weight_updates"]["pending"] == 1,
                       message="the join is pending")  # fmt: skip
            wait_until(lambda: queued_connections(hole) > 0, message="the rendezvous is under way")
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=25)
            except subprocess.TimeoutExpired:
                pytest.fail("the engine ignored SIGTERM while a weight update was stuck")
            assert code in (0, -signal.SIGTERM), proc.stderr.read().decode()[-2000:]
            assert time.monotonic() - t0 < 25
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _post_quietly(url: str, body: dict) -> None:
    try:
        httpx.post(url, json=body, headers=AUTH, timeout=120)
    except httpx.HTTPError:
        pass  # the engine went away under it: that is the point


# --------------------------------------------------------------------------------- asyncrl up


def test_asyncrl_up_gives_engines_a_strong_token_and_the_run_weights_root(tmp_path, monkeypatch):
    import tomllib

    from asyncrl.services.ops.launcher import Launcher
    from asyncrl.services.ops.run_config import RunConfig

    for key in [k for k in os.environ if k.startswith("ASYNCRL_")]:
        monkeypatch.delenv(key)
    raw = tomllib.loads((REPO / "configs" / "demo.toml").read_text())
    raw["run"].update(dir=str(tmp_path / "run"), redis_url="redis://127.0.0.1:1/0")
    one, two = (Launcher(RunConfig.model_validate(raw), tmp_path / "x.toml", echo=False) for _ in range(2))
    check_token(one.engine_token)
    assert one.engine_token != two.engine_token  # generated per run, never a fixed default
    engine = one.plan()[1][0].cmd
    assert engine[engine.index("--weights-root") + 1] == str(tmp_path / "run" / "trainer" / "weights")
    assert one.engine_token not in engine  # the reference engine gets it by env, not argv
    monkeypatch.setenv("ASYNCRL_API_TOKEN", API)  # an operator's token is used as it is
    raw["launch"]["engine_kind"] = "sglang"
    sglang = Launcher(RunConfig.model_validate(raw), tmp_path / "x.toml", echo=False)
    assert sglang.engine_token == API
    cmd = sglang.plan()[1][0].cmd
    assert cmd[cmd.index("--api-key") + 1] == API
