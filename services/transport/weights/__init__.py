"""How a policy version's weights reach the engines: the contract the trainer (sender,
trainer/publish.py) and the engines (receivers, services/engine/updates.py) both hold, and the
rollout service (which moves the engines to disk versions) reads. docs/architecture.md §5 says
why; this package says what travels.

Names. Policy version `version` of trainer history `epoch` (proto/lineage.py) is called
`weight_version_name(version, epoch)` on an engine: `"466"` in epoch 0, `"466@e2"` in epoch 2,
in SGLang's free-form `weight_version` string. An engine reports it on every response; a name
`parse_weight_version` does not read (SGLang's `"default"`) is no version of this run.

Announcement. Every published version is recorded and announced through the buffer as a
`WeightsInfo` (`buffer.PolicyVersions.publish`): `method="disk"` with the directory's `path`,
or `method="distributed"` once the broadcast is done. The announcement comes after the weights
are loadable: a receiver never sees a version it cannot load.

Disk (`filesystem.py`). The sender writes `<root>/<version_dir_name(version, epoch)>/` holding
`model.safetensors` (tied weights once, as HF writes them) and the source checkpoint's other
files (config, tokenizer), renamed into place whole and fsynced: a directory that exists is
complete. A version of another history is a different directory, never an overwrite. The
sender keeps the newest few and deletes those of a lost history. The receiver loads every
`*.safetensors` file of a directory it is told (`/update_weights_from_disk`) and checks that it
lies inside its own `weights_root` and that the tensors match its model.

LoRA adapters (`[trainer.lora]`). A version is the adapter alone, on disk only: the version
directory (same name, same lifecycle) holds `adapter_config.json` and
`adapter_model.safetensors` as peft writes them (`filesystem.py`), and its `WeightsInfo` says
`kind="lora"` with the `adapter_name` to load it under (`adapter_name(run, version, epoch)`):
a receiver loads it beside the base model it serves (SGLang's `/load_lora_adapter` with
`lora_name=adapter_name`, `lora_path=path`) and names it in each request (`lora_path`), never
through `/update_weights_from_disk`. The base model is the one the engine started with.

Broadcast (`broadcast.py`, SGLang's `/init_weights_update_group` and
`/update_weights_from_distributed`). The sender is rank 0 of a process group of its own; each
engine joins it at `rank_offset`. For each bucket of about `bucket_bytes` the sender announces
the bucket's `names`, `dtypes` and `shapes` to every engine in one HTTP call, then broadcasts
each tensor in `names` order; `weight_version` goes with the last bucket only, so an engine
takes the new name once it holds every tensor. The receiver receives every tensor of a bucket
before it checks any (an unknown name, a wrong shape), so the sender never blocks on a refusal:
the refusal comes back in the HTTP answer. Generation is paused on every engine for the update,
and the buckets go inside a weight-update session (`/begin_weight_update`, `/end_weight_update`:
SGLang 0.5.23 takes none outside one). With deltas a version's buckets hold only the tensors
that changed; a reference engine takes them on top of exactly the announced base and checks
each tensor's sha256, or answers 409 and is sent the full version (broadcast.py).
"""

EPOCH_SEPARATOR = "@e"


def weight_version_name(version: int, epoch: int = 0) -> str:
    """What an engine reports as `weight_version` for policy version `version` of `epoch`."""
    return str(version) if epoch == 0 else f"{version}{EPOCH_SEPARATOR}{epoch}"


def parse_weight_version(name: str | None) -> tuple[int, int] | None:
    """`(version, epoch)` of a `weight_version_name`; None for anything else (SGLang's "default")."""
    if not name:
        return None
    version, sep, epoch = name.partition(EPOCH_SEPARATOR)
    if not version.isdigit() or (sep and not epoch.isdigit()):
        return None
    return int(version), int(epoch) if sep else 0


def adapter_name(run: str, version: int, epoch: int = 0) -> str:
    """The name a LoRA version is loaded under on an engine: unique per run, version and history,
    `"demo-466"` in epoch 0, `"demo-466@e2"` in epoch 2."""
    return f"{run}-{weight_version_name(version, epoch)}"


def parse_adapter_name(run: str, name: str) -> tuple[int, int] | None:
    """`(version, epoch)` of an `adapter_name` of `run`; None for any other name (another run's
    adapter, or one loaded by hand)."""
    prefix = f"{run}-"
    return parse_weight_version(name[len(prefix) :]) if name.startswith(prefix) else None
