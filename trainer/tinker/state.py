"""save_state / load_state: a model's adapters and AdamW state as this trainer's checkpoints
(trainer/checkpoint.py: DCP shards, `extra.pt`, `meta.json`, read back by its checked reader),
one named checkpoint per directory.

Layout: `<checkpoints_root>/<model_id>/<name>/` holds `tinker.json` (base model, lora_config,
step, the caller's `extra`) and the Checkpointer's `step_<step:08d>/`. A save writes all of it
into `.tmp-<name>` and renames it into place (`atomic_publish_dir`): a named checkpoint that
exists is complete, and saving a name again replaces it whole. The path id the service gets
back is `<model_id>/<name>`; `resolve` accepts only such ids and only inside the root.

Not in a checkpoint: gradients accumulated since the last optim_step (a load drops them), the
sampler versions (the weights root keeps those). A load also restores the process's torch RNG
state as saved (the Checkpointer's rule; nothing here draws from it after creation).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from asyncrl.proto.tinker import CHECKPOINT_NAME
from asyncrl.trainer.checkpoint import Checkpointer, atomic_publish_dir
from asyncrl.trainer.model import Dist
from asyncrl.trainer.tinker.errors import InvalidInputError, UnknownModelError
from asyncrl.trainer.tinker.models import TinkerModel, fresh_adam_state

META_FILE = "tinker.json"


def check_name(value: str, what: str) -> str:
    if not isinstance(value, str) or not CHECKPOINT_NAME.fullmatch(value):
        raise InvalidInputError(
            f"{what} {value!r}: 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return value


def save(root: Path, ranks: Dist, m: TinkerModel, name: str, extra: dict) -> str:
    check_name(name, "checkpoint name")
    try:
        meta = json.dumps(
            {"base_model": m.base_model, "lora": m.lora.as_dict(), "step": m.step, "extra": extra}
        )
    except (TypeError, ValueError) as exc:
        raise InvalidInputError(f"extra must be JSON: {exc}") from exc
    home = root / m.model_id
    final, tmp = home / name, home / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)  # a save a crash cut short
    Checkpointer(tmp, ranks, keep=1).save(m.module, m.optimizer, m.scheduler, m.step, consumed_ids=[])
    (tmp / META_FILE).write_text(meta)
    atomic_publish_dir(tmp, final, [tmp / META_FILE])  # the Checkpointer fsynced its own files
    return f"{m.model_id}/{name}"


def resolve(root: Path, path: str) -> Path:
    parts = path.split("/") if isinstance(path, str) else []
    if len(parts) != 2:
        raise InvalidInputError(f"checkpoint path {path!r}: expected '<model_id>/<name>'")
    for part in parts:
        check_name(part, "checkpoint path part")
    where = root / parts[0] / parts[1]
    if not (where / META_FILE).is_file():
        raise UnknownModelError(f"no checkpoint {path!r}")
    return where


def read_meta(where: Path) -> dict:
    return json.loads((where / META_FILE).read_text())


def load(root: Path, ranks: Dist, m: TinkerModel, path: str, optimizer: bool) -> dict:
    """Restore `m` from checkpoint `path` (its AdamW state too when `optimizer`, else a fresh
    one); returns the `extra` saved with it. Refuses one of another base or LoRA shape."""
    where = resolve(root, path)
    meta = read_meta(where)
    if meta["base_model"] != m.base_model:
        raise InvalidInputError(
            f"checkpoint {path!r} is of {meta['base_model']}, this model of {m.base_model}"
        )
    saved = {k: meta["lora"][k] for k in ("rank", "train_mlp", "train_attn")}
    mine = {k: getattr(m.lora, k) for k in saved}
    if saved != mine:
        raise InvalidInputError(f"checkpoint {path!r} holds LoRA {saved}, this model has {mine}")
    m.optimizer.zero_grad(set_to_none=True)  # the accumulated gradients belong to the weights replaced
    try:
        restored = Checkpointer(where, ranks, keep=1).load(m.module, m.optimizer, m.scheduler)
    except ValueError as exc:
        raise InvalidInputError(f"checkpoint {path!r} does not fit this model: {exc}") from exc
    if restored is None:
        raise UnknownModelError(f"checkpoint {path!r} holds no saved state")
    if not optimizer:
        fresh_adam_state(m.optimizer)
    m.step = int(meta["step"])
    return meta["extra"]
