"""LoRA in the engine, in process: the update each row gets (hand arithmetic), PEFT's scale, the
adapter directories `read_adapter` refuses and why, path confinement, which adapter eviction
takes, and admission under `max_loras_per_batch`. Over HTTP: tests/integration/engine/test_engine_lora.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft_adapters import save_peft_adapter
from torch import nn

from asyncrl.services.engine.adapters import AdapterRegistry
from asyncrl.services.engine.lora import (
    AdapterError,
    LoraAdapter,
    applied,
    lora_scale,
    read_adapter,
    resolve_adapter_dir,
    target_linears,
)
from asyncrl.services.engine.sampling import RowSampling
from asyncrl.services.engine.scheduler import Request, Scheduler
from asyncrl.services.ops.tinymodel import build_tiny_model

torch.set_num_threads(1)
ALL = frozenset({"qkv_proj", "o_proj", "gate_up_proj", "down_proj"})
TINY = {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}


def adapter(name: str, weights=None, pinned: bool = False) -> LoraAdapter:
    return LoraAdapter(name=name, path=f"/w/{name}", rank=1, scale=1.0, weights=weights or {}, pinned=pinned)


# --------------------------------------------------------------------------------- the math


def test_scale_is_alpha_over_r_or_over_its_root_with_rslora():
    assert lora_scale({"r": 4, "lora_alpha": 8}) == 2.0
    assert lora_scale({"r": 4, "lora_alpha": 8, "use_rslora": True}) == 4.0  # 8 / √4
    assert lora_scale({"r": 2, "lora_alpha": 1, "use_rslora": False}) == 0.5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(2, 2, bias=False)
        with torch.no_grad():
            self.q_proj.weight.copy_(torch.eye(2))  # the base output is the input itself

    def forward(self, x):
        return self.q_proj(x)


def test_each_row_gets_its_own_adapters_update_and_base_rows_none():
    block = Block()
    linears = {"q_proj": block.q_proj}
    # rank 1: A = [1, 1] sums the input, B (scale 2 folded in) = [[2], [0]] puts 2·sum in the first output
    one = adapter("one", {"q_proj": (torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0], [0.0]]))})
    # B = [[0], [-1]]: -(x0 - x1) in the second output, with A = [1, -1]
    two = adapter("two", {"q_proj": (torch.tensor([[1.0, -1.0]]), torch.tensor([[0.0], [-1.0]]))})
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 7.0], [1.0, 1.0]])
    with applied(linears, [one, None, two, one]):
        out = block(x)
    assert out.tolist() == [
        [1 + 2 * 3, 2],  # one: sum 3 → +6 on the first output
        [3, 4],  # base
        [5, 7 - (5 - 7)],  # two: x0 - x1 = -2 → +2 on the second
        [1 + 2 * 2, 1],  # one: sum 2 → +4
    ]
    assert block(x).tolist() == x.tolist()  # outside the block: the base model again


def test_one_adapter_on_every_row_and_a_batch_of_none():
    block = Block()
    linears = {"q_proj": block.q_proj}
    one = adapter("one", {"q_proj": (torch.tensor([[1.0, 1.0]]), torch.tensor([[2.0], [0.0]]))})
    x = torch.tensor([[[1.0, 2.0], [0.0, 1.0]]])  # [rows, positions, features], as a prefill
    with applied(linears, [one]):
        assert block(x).tolist() == [[[7.0, 2.0], [2.0, 1.0]]]
    with applied(linears, [None, None]):
        assert not block.q_proj._forward_hooks  # nothing installed for a batch naming no adapter
        assert block(x).tolist() == x.tolist()


# -------------------------------------------------------------------------- reading adapters


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = tmp_path_factory.mktemp("lora_unit_model")
    build_tiny_model(path, seed=2, **TINY)
    return path, AutoModelForCausalLM.from_pretrained(str(path))


def read(model, path, *, allowed=ALL, max_rank=8) -> LoraAdapter:
    _, hf = model
    return read_adapter("x", str(path), real_path=str(path), linears=target_linears(hf), max_rank=max_rank,
                        allowed=allowed, vocab_size=hf.config.vocab_size, dtype=torch.float32,
                        device=torch.device("cpu"))  # fmt: skip


def test_a_peft_adapter_is_read_with_its_scale_folded_into_b(model, tmp_path):
    path, hf = model
    save_peft_adapter(path, tmp_path / "a", targets=["q_proj", "down_proj"], seed=1, r=4, lora_alpha=2)
    got = read(model, tmp_path / "a")
    assert (got.rank, got.scale) == (4, 0.5)
    assert sorted(got.weights) == ["model.layers.0.mlp.down_proj", "model.layers.0.self_attn.q_proj"]
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "a" / "adapter_model.safetensors"))
    a, b = got.weights["model.layers.0.self_attn.q_proj"]
    assert torch.equal(a, saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"])
    assert torch.allclose(b, 0.5 * saved["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"])


@pytest.mark.parametrize(
    ("config", "allowed", "message"),
    [
        ({"use_dora": True}, ALL, "doesn't support DoRA adapters"),
        ({"bias": "all"}, ALL, "does not apply: ['bias']"),
        ({"rank_pattern": {"q_proj": 2}}, ALL, "does not apply: ['rank_pattern']"),
        (
            {},
            frozenset({"o_proj"}),
            "targets ['qkv_proj'], not in the engine's lora_target_modules ['o_proj']",
        ),
    ],
)
def test_what_the_engine_cannot_apply_is_refused(model, tmp_path, config, allowed, message):
    save_peft_adapter(model[0], tmp_path / "a", targets=["q_proj"], seed=1, **config)
    with pytest.raises(AdapterError, match=message.replace("[", r"\[").replace("(", r"\(")):
        read(model, tmp_path / "a", allowed=allowed)


def test_q_proj_allows_k_and_v_as_sglang_stacks_them(model, tmp_path):
    save_peft_adapter(model[0], tmp_path / "a", targets=["v_proj"], seed=1)
    assert list(read(model, tmp_path / "a", allowed=frozenset({"qkv_proj"})).weights) == [
        "model.layers.0.self_attn.v_proj"
    ]


def test_a_rank_above_the_bound_and_a_config_that_is_not_lora_are_refused(model, tmp_path):
    save_peft_adapter(model[0], tmp_path / "a", targets=["q_proj"], seed=1, r=8)
    with pytest.raises(AdapterError, match="rank 8 is incompatible with the engine's max_lora_rank 4"):
        read(model, tmp_path / "a", max_rank=4)
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "IA3"}))
    with pytest.raises(AdapterError, match="peft_type 'IA3'"):
        read(model, tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps({**config, "r": 0}))
    with pytest.raises(AdapterError, match="an integer r > 0"):
        read(model, tmp_path / "a")


def test_adapter_paths_are_confined_to_the_root(model, tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    save_peft_adapter(model[0], root / "a", targets=["q_proj"], seed=1)
    save_peft_adapter(model[0], outside / "b", targets=["q_proj"], seed=1)
    assert resolve_adapter_dir(str(root), str(root / "a")) == os.path.realpath(root / "a")
    assert resolve_adapter_dir(str(root), str(root / "a" / ".." / "a")) == os.path.realpath(root / "a")
    (root / "c").mkdir()  # a directory inside whose weights file links out
    (root / "c" / "adapter_config.json").write_text((root / "a" / "adapter_config.json").read_text())
    (root / "c" / "adapter_model.safetensors").symlink_to(outside / "b" / "adapter_model.safetensors")
    for refused in [outside / "b", root / ".." / "outside" / "b", root / "c", root / "missing", "a", "\0"]:
        assert resolve_adapter_dir(str(root), str(refused)) is None, refused


# ------------------------------------------------------------------------------ the registry


def test_eviction_takes_the_least_recently_used_adapter_no_request_uses():
    registry = AdapterRegistry(max_loaded=3)
    a, b, c = adapter("a"), adapter("b", pinned=True), adapter("c")
    for x in (a, b, c):
        registry.add(x)
    assert registry.room_needed()
    assert registry.victim() == "a"  # loaded first, never used since
    held = registry.acquire(["a", None, "c"])
    assert held == [a, None, c]
    assert registry.victim() is None  # a and c in use, b pinned
    registry.release([c])
    assert registry.victim() == "c"
    registry.release([a])
    assert registry.victim() == "a"  # used before c
    registry.acquire(["a"])
    registry.release([a])
    assert registry.victim() == "c"  # now c is the least recently used
    registry.evict("c")
    assert list(registry.loaded_paths()) == ["b", "a"] and not registry.room_needed()
    with pytest.raises(KeyError):
        registry.acquire(["a", "c"])


def test_an_unregistered_adapter_goes_when_its_last_request_ends():
    registry = AdapterRegistry(max_loaded=None)
    a = adapter("a")
    registry.add(a)
    held = registry.acquire(["a", "a"])
    gone = registry.unregister("a")
    assert registry.missing(["a"]) == ["a"] and not gone.is_set()  # hidden from new requests at once
    assert registry.unregister("a") is gone  # a second unload waits for the same
    registry.release(held[:1])
    assert not gone.is_set() and registry.is_leaving("a")
    registry.release(held[1:])
    assert gone.is_set() and not registry.is_leaving("a") and registry.state() == []
    registry.add(adapter("b"))
    assert registry.unregister("b").is_set()  # nothing used it: gone at once


# ------------------------------------------------------------------------------- admission


def test_a_batch_holds_at_most_max_loras_per_batch_adapters_the_base_counted():
    a, b, c = adapter("a"), adapter("b"), adapter("c")
    # no runner: admission looks at the requests only
    s = Scheduler(None, max_running=8, max_prefill_tokens=4096, weight_version="0", max_loras_per_batch=2)  # type: ignore[arg-type]
    greedy = RowSampling(0.0, 1.0, -1, 0.0)
    for rid, lora in [("1", a), ("2", b), ("3", None), ("4", a), ("5", c), ("6", b)]:
        r = Request(rid, [1, 2], 4, frozenset(), greedy, 0, on_finish=lambda _: None)
        r.adapter = lora
        s.waiting.append(r)
    # a, b fill the two places; the base row and c wait; a and b come in after them
    assert [r.rid for r in s._admit()] == ["1", "2", "4", "6"]
    assert [r.rid for r in s.waiting] == ["3", "5"]  # in their order, first in line next time


# ------------------------------------------------------------------------------- settings


def test_lora_settings_follow_sglangs_start_up_rules():
    from pydantic import ValidationError

    from asyncrl.services.engine.config import EngineSettings

    on = {"model": "m", "enable_lora": True}
    s = EngineSettings(**on, max_lora_rank=8, lora_target_modules="q_proj, o_proj")
    assert s.lora_target_modules == "q_proj,o_proj" and s.lora_targets == {"qkv_proj", "o_proj"}
    assert (s.max_loras_per_batch, s.max_loaded_loras) == (8, None)  # SGLang's defaults
    assert EngineSettings(**on, max_lora_rank=8, lora_target_modules=["all"]).lora_targets == ALL
    assert EngineSettings(model="m").enable_lora is False
    for bad, message in [
        ({}, "needs max_lora_rank and lora_target_modules"),
        ({"max_lora_rank": 8}, "needs max_lora_rank and lora_target_modules"),
        ({"max_lora_rank": 8, "lora_target_modules": "lm_head"}, r"lora_target_modules \['lm_head'\]"),
        ({"max_lora_rank": 8, "lora_target_modules": "all,q_proj"}, "must be the only module"),
        (
            {"max_lora_rank": 8, "lora_target_modules": "all", "max_loaded_loras": 4},
            "at least max_loras_per_batch",
        ),
    ]:
        with pytest.raises(ValidationError, match=message):
            EngineSettings(**on, **bad)
