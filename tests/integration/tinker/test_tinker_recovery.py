"""What a restarted service makes of the models in its command log (services/tinker/recovery.py),
in process and deterministic: the service's own code accepts the calls (`TinkerService`, no
HTTP) and its worker runs them one pass at a time (`worker.step()`, its thread never started);
"the restart" is a second backend, with the first one's checkpoint and weights roots and nothing
in memory, handed to `recover`. The first backend says what the rebuilt models must hold."""

from __future__ import annotations

import shutil

import pytest
import redis
import torch
from tinker_stack import BASE, tinker_settings

from asyncrl.proto import tinker as wire
from asyncrl.services.tinker.commands import CommandLog
from asyncrl.services.tinker.paths import backend_id
from asyncrl.services.tinker.recovery import recover
from asyncrl.services.tinker.service import TinkerService
from asyncrl.services.tinker.worker import arrays_to_json

torch.set_num_threads(1)
LORA = {"rank": 4, "seed": 5, "train_unembed": False}


@pytest.fixture
def world(redis_server, tiny, tmp_path, run_id):
    """(a service on a fresh namespace, a factory of backends on the same roots, its Redis)."""
    from asyncrl.services.tinker.app import build_backend

    settings = tinker_settings(redis_server.url, run_id, tmp_path, tiny, None, max_models=8)
    client = redis.Redis.from_url(redis_server.url)
    log = CommandLog(client, run_id, max_queued=64, result_ttl_s=3600)
    backend, api = build_backend(settings)
    service = TinkerService(settings, log, backend, api)
    yield service, (lambda: build_backend(settings)[0]), tmp_path
    client.close()


def run(service: TinkerService, future: wire.UntypedFuture) -> dict:
    """Run the worker until `future` is finished; its record."""
    for _ in range(20):
        record = service.log.future(future.request_id)
        if record["state"] in ("done", "failed"):
            return record
        service.worker.step()
    raise AssertionError(f"{future.request_id} did not finish: {record}")


def call(service: TinkerService, method: str, body: wire.Body) -> dict:
    return run(service, getattr(service, method)(body, body.model_dump_json().encode()))


def train(service: TinkerService, mid: str, seq: int) -> int:
    """A cross-entropy forward_backward and an optim_step (seq ids `seq`, `seq` + 1)."""
    tokens = list(range(5, 17))
    datum = wire.WireDatum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]).numpy(),
                                         "weights": torch.ones(11).numpy()})  # fmt: skip
    fb = wire.ForwardBackwardCall(mid, seq, "cross_entropy", False, [datum])
    raw = repr((mid, seq, arrays_to_json(datum.inputs))).encode()
    assert run(service, service.forward_backward(fb, raw))["state"] == "done"
    step = wire.OptimStepRequest(
        model_id=mid, seq_id=seq + 1, adam_params=wire.AdamParams(learning_rate=0.05)
    )
    assert call(service, "optim_step", step)["state"] == "done"
    return seq + 2


def adapters(backend, mid: str) -> dict[str, torch.Tensor]:
    module = backend.model(backend_id(mid)).module
    return {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}


def adam(backend, mid: str) -> list[torch.Tensor]:
    opt = backend.model(backend_id(mid)).optimizer
    return [v.clone() for g in opt.param_groups for p in g["params"] for v in opt.state[p].values()]


def same(a, b) -> bool:
    pairs = zip(a.values(), b.values()) if isinstance(a, dict) else zip(a, b)
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in pairs)


def create(service: TinkerService, sid: str, n: int, lora: dict = LORA) -> dict:
    body = wire.CreateModelRequest(session_id=sid, model_seq_id=n, base_model=BASE, lora_config=lora)
    return call(service, "create_model", body)


def test_models_created_from_a_checkpoint_are_rebuilt_with_its_weights(world):
    service, new_backend, _ = world
    sid = service.log.create_session({})
    source = create(service, sid, 0)["result"]["model_id"]
    train(service, source, 1)
    train(service, source, 3)
    saved = call(service, "save_weights", wire.SaveWeightsRequest(model_id=source, seq_id=5, path="ck"))
    path = saved["result"]["path"]
    loaded = {}
    for n, optimizer in ((1, False), (2, True)):  # create_training_client_from_state[_with_optimizer]
        body = wire.LoadWeightsRequest(session_id=sid, model_seq_id=n, path=path, optimizer=optimizer)
        loaded[optimizer] = call(service, "load_weights", body)["result"]["model_id"]
    before = {mid: (adapters(service.backend, mid), adam(service.backend, mid)) for mid in loaded.values()}
    assert same(before[loaded[False]][0], before[loaded[True]][0])  # the checkpoint's weights, both

    outcomes = recover(service.log, new_backend_ := new_backend())
    assert outcomes == {source: "restored", loaded[False]: "restored", loaded[True]: "restored"}
    for mid, (weights, state) in before.items():
        assert same(adapters(new_backend_, mid), weights), mid  # not a fresh adapter from a seed
        assert same(adam(new_backend_, mid), state), mid  # fresh for the weights-only load


def test_a_model_that_cannot_be_built_neither_holds_a_slot_nor_stops_a_restart(world):
    service, new_backend, root = world
    sid = service.log.create_session({})
    # LoRA on nothing: the service accepts the call, the backend refuses it.
    nothing = {**LORA, "train_mlp": False, "train_attn": False}
    failed = create(service, sid, 0, nothing)
    assert failed["state"] == "failed" and "trains nothing" in failed["error"]
    mid = f"{sid}:train:0"
    assert service.log.model(mid)["status"] == "failed" and mid not in service.log.live_models()
    with pytest.raises(Exception) as refused:
        service.optim_step(
            wire.OptimStepRequest(model_id=mid, seq_id=1, adam_params=wire.AdamParams()), b"{}"
        )
    assert refused.value.status_code == 400 and "trains nothing" in refused.value.detail

    # A model whose restore point is gone from disk: given up with the reason, the others rebuilt.
    ok = create(service, sid, 1)["result"]["model_id"]
    gone = create(service, sid, 2)["result"]["model_id"]
    train(service, gone, 1)
    call(service, "save_weights", wire.SaveWeightsRequest(model_id=gone, seq_id=3, path="ck"))
    shutil.rmtree(root / "checkpoints" / backend_id(gone))
    backend = new_backend()
    assert recover(service.log, backend) == {ok: "restored", gone: "failed"}
    record = service.log.model(gone)
    assert record["status"] == "lost" and "could not be rebuilt" in record["lost_reason"]
    assert backend.models() == [backend_id(ok)]  # nothing half-built left behind


def test_a_model_whose_session_ended_is_released_not_rebuilt(world):
    service, new_backend, _ = world
    closed, open_ = service.log.create_session({}), service.log.create_session({})
    done = create(service, closed, 0)["result"]["model_id"]
    kept = create(service, open_, 0)["result"]["model_id"]
    service.finish_session(
        closed, "success"
    )  # the SDK's close; the process dies before the worker releases it
    backend = new_backend()
    assert recover(service.log, backend) == {done: "released", kept: "restored"}
    assert backend.models() == [backend_id(kept)] and service.log.model(done)["status"] == "unloaded"


def test_live_models_reads_an_index_not_every_model_ever_held(world, monkeypatch):
    """The worker asks for the live models at every pass (twice a second when idle), and so do
    /healthz, /metrics and create_model: the cost must not grow with the models a namespace
    held before (one a cookbook run)."""
    service, _, _ = world
    sid = service.log.create_session({})
    live = create(service, sid, 0)["result"]["model_id"]
    create(service, sid, 1, {**LORA, "train_mlp": False, "train_attn": False})  # failed: not live
    for n in range(2, 6):  # held once, released since
        service.log.update_model(create(service, sid, n)["result"]["model_id"], status="unloaded")
    reads = []
    monkeypatch.setattr(service.log, "model", lambda mid: reads.append(mid))
    assert service.log.live_models() == [live] and reads == []
    assert service.log.redis.smembers(service.log.key("live")) == {live.encode()}


def test_a_result_redis_failed_to_record_is_recorded_not_run_again(world, monkeypatch):
    """Redis drops the write of a finished call's result (a failover, a reset connection): the
    call's effect is in memory already, so the next pass records it; running it again would
    add its gradients twice."""
    service, _, _ = world
    sid = service.log.create_session({})
    mid = create(service, sid, 0)["result"]["model_id"]
    tokens = list(range(5, 17))
    datum = wire.WireDatum(tokens[:-1], {"target_tokens": torch.tensor(tokens[1:]).numpy(),
                                         "weights": torch.ones(11).numpy()})  # fmt: skip
    future = service.forward_backward(
        wire.ForwardBackwardCall(mid, 1, "cross_entropy", False, [datum]), b"fb1"
    )
    finish, failures = service.log.finish, []

    def flaky(command, **outcome):
        if not failures:
            failures.append(command.request_id)
            raise redis.ConnectionError("Connection reset by peer")
        return finish(command, **outcome)

    monkeypatch.setattr(service.log, "finish", flaky)
    with pytest.raises(redis.ConnectionError):
        service.worker.step()  # the worker's loop counts this and goes on
    assert run(service, future)["state"] == "done"
    assert failures == [future.request_id]
    assert service.backend.metrics()[backend_id(mid)]["forward_backward_calls"] == 1.0


def test_a_call_that_lands_as_its_model_is_released_fails_rather_than_waits_forever(world, monkeypatch):
    """The worker finds a finished session's model idle and releases it; a call of that model
    arriving between that look and the release must not sit in a queue no one reads (its
    future would answer "try again" for good): it is refused, or failed by the release."""
    service, _, _ = world
    sid = service.log.create_session({})
    mid = create(service, sid, 0)["result"]["model_id"]
    service.finish_session(sid, "success")
    step = wire.OptimStepRequest(model_id=mid, seq_id=1, adam_params=wire.AdamParams())
    head, late = service.log.head, []

    def racing(model: str):
        if not late:  # the worker saw an empty queue; the call lands right after
            late.append(service.optim_step(step, b"late"))
            return None, None
        return head(model)

    monkeypatch.setattr(service.log, "head", racing)
    service.worker.step()
    assert service.log.model(mid)["status"] == "unloaded"
    failed = service.log.future(late[0].request_id)
    assert failed["state"] == "failed" and "released" in failed["error"]
    with pytest.raises(Exception) as refused:  # and once released, the call is refused at once
        service.optim_step(step.model_copy(update={"seq_id": 2}), b"later")
    assert refused.value.status_code == 404 and "unloaded" in refused.value.detail
