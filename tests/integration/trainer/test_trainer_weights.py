"""Weight publishing by broadcast to a real reference engine, and checkpoint round trips of a
FSDP2-sharded model, in a one-rank gloo group inside the test process. Disk publishing is a
unit test (tests/unit/trainer/test_publish_disk.py)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from asyncrl.trainer.checkpoint import Checkpointer
from asyncrl.trainer.model import build_model, full_state_dict, init_distributed
from asyncrl.trainer.publish import BroadcastError, BroadcastPublisher, cast_state
from asyncrl.trainer.schedule import build_scheduler

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def dist1():
    import torch.distributed as dist

    d = init_distributed("cpu", timeout_s=60)
    yield d
    dist.destroy_process_group()


def perturbed(state: dict[str, torch.Tensor], delta: float) -> dict[str, torch.Tensor]:
    return {
        k: v + delta * torch.arange(v.numel(), dtype=v.dtype).reshape(v.shape) / v.numel()
        for k, v in state.items()
    }


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (FSDP2 on several ranks), or the tensor itself (a world of one in
    fp32 is not sharded: trainer/model.py)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def test_checkpoint_round_trip_restores_model_optimizer_rng(tiny, tmp_path, dist1):
    model = build_model(tiny, dist1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_scheduler(opt, "cosine", warmup_steps=1, decay_steps=4)
    ids = torch.randint(3, 40, (2, 8))

    def step():
        model(input_ids=ids).logits.square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    step()
    ck = Checkpointer(tmp_path / "ck", dist1, keep=1)
    torch.manual_seed(123)
    path = ck.save(model, opt, sched, 7, ["g1", "g2"])
    saved_model = {k: v.clone() for k, v in full_state_dict(model).items()}
    saved_adam = {k: _full(v["exp_avg"]).clone() for k, v in _named_optim_state(model, opt).items()}
    after_save = torch.rand(3)
    assert json.loads((path / "meta.json").read_text())["consumed_ids"] == ["g1", "g2"]
    step()  # diverge, then restore
    torch.rand(5)
    assert not torch.equal(full_state_dict(model)["model.norm.weight"], saved_model["model.norm.weight"])

    meta = ck.load(model, opt, sched)
    assert (meta.version, meta.consumed_ids, meta.path) == (7, ["g1", "g2"], path)
    for k, v in full_state_dict(model).items():
        assert torch.equal(v, saved_model[k]), k
    for k, v in _named_optim_state(model, opt).items():
        assert torch.equal(_full(v["exp_avg"]), saved_adam[k]), k
    assert torch.equal(torch.rand(3), after_save)  # RNG continues where the checkpoint was taken
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.75)  # update 2 of 4
    ck.save(model, opt, sched, 9, [])
    assert [p.name for p in (tmp_path / "ck").iterdir()] == ["step_00000009"]  # keep=1 pruned 7


def test_a_checkpoint_without_dcp_metadata_is_refused(tiny, tmp_path, dist1):
    """A full `state.pt` checkpoint of the format before sharding (or a directory this rank cannot
    see) is an error, not a silent fresh start that would retrain acked groups."""
    model = build_model(tiny, dist1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    old = tmp_path / "ck" / "step_00000004"
    old.mkdir(parents=True)
    (old / "meta.json").write_text(json.dumps({"version": 4, "consumed_ids": ["g1"]}))
    torch.save({"model": {}}, old / "state.pt")
    with pytest.raises(RuntimeError, match=r"ranks \[0\] find no .*step_00000004/.metadata"):
        Checkpointer(tmp_path / "ck", dist1).load(model, opt, build_scheduler(opt, "constant"))


class _RunsCode:
    """Unpickling this runs `os.system`: what a tampered `.metadata` could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("payload", ["code", "not_metadata"])
def test_a_tampered_checkpoint_index_is_refused_without_running_it(tiny, tmp_path, dist1, payload):
    """DCP's `.metadata` is a pickle: it is read by an unpickler that builds only checkpoint
    metadata (trainer/checkpoint.py `CheckedReader`), so a replaced index neither runs code nor
    loads; the untouched checkpoint loads as before."""
    import pickle

    from asyncrl.trainer.checkpoint import UnsafeCheckpoint

    model = build_model(tiny, dist1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = build_scheduler(opt, "constant")
    model(input_ids=torch.randint(3, 40, (2, 8))).logits.square().mean().backward()
    opt.step()
    ck = Checkpointer(tmp_path / "ck", dist1, keep=1)
    path = ck.save(model, opt, sched, 3, ["g1"])
    assert ck.load(model, opt, sched).version == 3
    marker = tmp_path / "ran"
    evil = _RunsCode(marker) if payload == "code" else {"state_dict_metadata": {}}
    (path / ".metadata").write_bytes(pickle.dumps(evil))
    with pytest.raises(UnsafeCheckpoint, match="os.system|posix.system|not DCP Metadata"):
        ck.load(model, opt, sched)
    assert not marker.exists()


class _Reduced:
    """Pickles as `fn(*args)`."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def test_the_metadata_unpickler_looks_up_enum_members_and_nothing_else(tmp_path):
    """Some Pythons pickle an enum member as `getattr(EnumClass, name)` (the checkpoint of the
    compose trainer's image does): that lookup is allowed, a getattr on anything else (here
    a path's `touch` method, which a further call would run) is refused."""
    import pickle
    from pathlib import PosixPath

    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from asyncrl.trainer.checkpoint import UnsafeCheckpoint, _MetadataUnpickler

    member = pickle.dumps(_Reduced(getattr, _MEM_FORMAT_ENCODING, "TORCH_CONTIGUOUS_FORMAT"))
    assert _MetadataUnpickler(member, "m").load() is _MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    marker = tmp_path / "touched"
    method = pickle.dumps(_Reduced(getattr, PosixPath(marker), "touch"))
    with pytest.raises(UnsafeCheckpoint, match="getattr\\(PosixPath object, 'touch'\\)"):
        _MetadataUnpickler(method, "m").load()
    with pytest.raises(UnsafeCheckpoint, match="not an enum|only an enum"):
        _MetadataUnpickler(pickle.dumps(_Reduced(getattr, _MEM_FORMAT_ENCODING, "mro")), "m").load()
    assert not marker.exists()


def _named_optim_state(model, opt):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: s for p, s in opt.state.items()}


def test_broadcast_publisher_updates_a_reference_engine(tiny, dist1):
    """Real engine (uvicorn in a thread), real gloo group: the engine ends up with exactly the
    trainer's tensors and reports the new weight_version."""
    from engine_server import serve_in_thread

    from asyncrl.buffer.server import free_port

    engine = serve_in_thread(str(tiny), device="cpu", dtype="float32")
    try:
        model = build_model(tiny, dist1)
        state = cast_state(perturbed(full_state_dict(model), 0.05), torch.float32)
        pub = BroadcastPublisher(
            [engine.url], "127.0.0.1", free_port(), "gloo", bucket_bytes=64 << 10, timeout_s=60
        )
        out = pub.publish(4, state)
        assert out.nbytes == sum(t.numel() * 4 for t in state.values())
        got = engine.engine.runner.model.state_dict()
        for name, value in state.items():
            assert torch.equal(got[name], value), name
        assert torch.equal(
            got["lm_head.weight"], state["model.embed_tokens.weight"]
        )  # tie kept on the engine
        info = pub.http.get(engine.url + "/get_model_info").json()
        assert info["weight_version"] == "4"
        bad = {"model.norm.weight": torch.zeros(3)}  # wrong shape: refused after the tensors are received
        with pytest.raises(BroadcastError):
            pub.publish(5, bad)
        # a failed update leaves the engine paused, never generating on part of a version under
        # the old name; the next whole publish continues it
        assert (engine.engine.scheduler.paused, engine.engine.weight_version) == ("abort", "4")
        pub.publish(6, state)
        assert (engine.engine.scheduler.paused, engine.engine.weight_version) == (None, "6")
        done = pub.http.post(engine.url + "/generate", json={"input_ids": [1, 2, 3],
                             "sampling_params": {"max_new_tokens": 2, "temperature": 0}})  # fmt: skip
        assert done.status_code == 200 and len(done.json()["output_ids"]) == 2, done.text
        pub.close()
    finally:
        engine.stop()


def test_each_update_runs_in_a_weight_update_session_and_a_stale_one_is_closed(tiny, dist1):
    """SGLang 0.5.23 takes `/update_weights_from_distributed` only between `/begin_weight_update`
    and `/end_weight_update`, one session at a time; a trainer that died inside one leaves it
    open, and the next trainer's connect closes it before it publishes."""
    from engine_server import serve_in_thread

    from asyncrl.buffer.server import free_port

    engine = serve_in_thread(str(tiny), device="cpu", dtype="float32")
    try:
        http = httpx.Client(base_url=engine.url, timeout=60)
        assert http.post("/begin_weight_update", json={}).json() == {"success": True, "message": "Success"}
        again = http.post("/begin_weight_update", json={"selector": "all"})
        assert again.status_code == 400 and "already open" in again.json()["message"]
        model = build_model(tiny, dist1)
        state = cast_state(perturbed(full_state_dict(model), 0.02), torch.float32)
        pub = BroadcastPublisher(
            [engine.url], "127.0.0.1", free_port(), "gloo", bucket_bytes=64 << 10, timeout_s=60
        )
        pub.publish(3, state)  # connects, closes the stale session, then opens and ends its own
        got = engine.engine.runner.model.state_dict()
        assert all(torch.equal(got[n], v) for n, v in state.items())
        assert engine.engine.weight_session is False
        none = http.post("/end_weight_update", json={})
        assert none.status_code == 400 and none.json()["message"] == (
            "no weight-update session is open; call begin_weight_update() first"
        )
        pub.close()
        http.close()
    finally:
        engine.stop()


def test_an_engine_that_refuses_to_join_fails_the_connect_at_once(tiny, dist1):
    """An engine that refuses `/init_weights_update_group` (here: a group of that name is already
    there) answers at once; the publisher raises that answer then, not after rank 0 waited its
    whole rendezvous timeout for a rank that will never come."""
    import time

    from engine_server import serve_in_thread

    from asyncrl.buffer.server import free_port

    engine = serve_in_thread(str(tiny), device="cpu", dtype="float32")
    try:
        first = BroadcastPublisher(
            [engine.url], "127.0.0.1", free_port(), "gloo", bucket_bytes=64 << 10, timeout_s=60
        )
        first.connect()
        second = BroadcastPublisher(
            [engine.url], "127.0.0.1", free_port(), "gloo", bucket_bytes=64 << 10, timeout_s=60
        )
        t0 = time.monotonic()
        with pytest.raises(BroadcastError, match="HTTP 400 .*already exists"):
            second.connect()
        assert time.monotonic() - t0 < 20  # the engine's answer, not the 60 s rendezvous timeout
        first.close()
        second.close()
    finally:
        engine.stop()


def test_full_state_dict_of_an_unsharded_model_is_what_the_gathering_api_returns(tiny, dist1):
    """A world of one does not shard the model: `full_state_dict` reads its tensors directly;
    the names and values are the gathering API's (tied weights once)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from asyncrl.trainer.model import tied_aliases

    model = build_model(tiny, dist1)
    assert not any(hasattr(p, "to_local") for p in model.parameters())  # the fast path's case
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))  # not the file's values
    gathered = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    for alias in tied_aliases(model):
        gathered.pop(alias, None)
    state = full_state_dict(model)
    assert list(state) == list(gathered)
    for k, v in state.items():
        assert not v.requires_grad and torch.equal(v, gathered[k]), k


def test_a_resume_takes_the_configured_hyperparameters(tiny, tmp_path, dist1):
    """The checkpoint holds the state (moments, the schedule's position); the config holds the
    hyperparameters. Unchanged, a resume continues exactly; a changed peak lr or weight decay
    applies from the resumed update on, and is reported."""
    from asyncrl.trainer.schedule import lr_factor

    def parts(lr: float, weight_decay: float):
        model = build_model(tiny, dist1)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        return model, opt, build_scheduler(opt, "cosine", warmup_steps=1, decay_steps=6)

    model, opt, sched = parts(1e-2, 0.0)
    ids = torch.randint(3, 40, (2, 8))
    for _ in range(2):
        model(input_ids=ids).logits.square().mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    ck = Checkpointer(tmp_path / "ck", dist1, keep=1)
    ck.save(model, opt, sched, 2, [])
    saved_moments = {k: _full(v["exp_avg"]).clone() for k, v in _named_optim_state(model, opt).items()}

    same = parts(1e-2, 0.0)
    meta = ck.load(*same)
    assert meta.changed == {}
    assert same[1].param_groups[0]["lr"] == opt.param_groups[0]["lr"] == 1e-2 * lr_factor(3, "cosine", 1, 6)

    model2, opt2, sched2 = parts(4e-3, 0.1)
    meta = ck.load(model2, opt2, sched2)
    assert meta.changed == {"lr": (1e-2, 4e-3), "weight_decay": (0.0, 0.1)}
    assert opt2.param_groups[0]["lr"] == 4e-3 * lr_factor(3, "cosine", 1, 6)  # update 3 at the new peak
    assert (
        sched2.get_last_lr() == [opt2.param_groups[0]["lr"]] and opt2.param_groups[0]["weight_decay"] == 0.1
    )
    for k, v in _named_optim_state(model2, opt2).items():  # the state is still the checkpoint's
        assert torch.equal(_full(v["exp_avg"]), saved_moments[k]), k
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(4e-3 * lr_factor(4, "cosine", 1, 6), rel=1e-12)
