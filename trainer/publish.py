"""Publishing a new policy version to the engines, the sender's side of
services/transport/weights (whose docstring is the contract): to disk, or broadcast over
torch.distributed.

Disk (`DiskPublisher`): rank 0 writes the version's directory in a temp directory that is
fsynced and renamed into place, with the source directory's config and tokenizer files as hard
links where the filesystem allows (the 3.5 MB tokenizer.json is not copied every version: the
source directory must not be rewritten in place while the run publishes), keeps the newest
`keep` versions and deletes those of a lost history.

Broadcast (`BroadcastPublisher`): the trainer's rank 0 is rank 0 of a separate process group on
its own TCPStore; this side adds group membership from each engine's TP size, pausing
generation on every engine for the update, and a typed error when an engine refuses. Not
handled: engines joining after the group is formed (list them at start), and re-forming a
broken group (restart the trainer).

LoRA: with `[trainer.lora]` a version is the adapter alone, written to disk as a PEFT adapter
directory (`DiskPublisher(adapter_config=...)`); the broadcast does not carry adapters.

Deltas (`DeltaChain`, either publisher with `delta=True`): a version holds only what changed
since the previous one, with a full anchor every `anchor_every` versions. On disk a delta is a
directory an engine rebuilds on its own (services/engine/deltas.py); over the broadcast the
changed tensors are sent and an engine that cannot take them is sent the full version at once.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import torch

from asyncrl.proto.sglang import ROUTES
from asyncrl.services.runtime.logging import log_event
from asyncrl.services.transport.weights import weight_version_name
from asyncrl.services.transport.weights.broadcast import (
    DeltaAnnouncement,
    DeltaRefused,
    broadcast_weights,
    http_announcer,
    init_weight_update_group,
)
from asyncrl.services.transport.weights.delta import (
    DELTA_FILE,
    MANIFEST_FILE,
    DeltaManifest,
    compute_delta,
    tensor_sha256,
)
from asyncrl.services.transport.weights.filesystem import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_FILE,
    MODEL_FILE,
    file_metadata,
    is_source_weights,
    published_versions,
    version_dir_name,
)
from asyncrl.trainer import metrics as tm
from asyncrl.trainer.checkpoint import atomic_publish_dir

log = logging.getLogger("asyncrl.trainer")


@dataclass
class Published:
    version: int
    nbytes: int
    seconds: float
    path: str | None = None
    delta: bool = False  # sent as a delta on the previous version (else whole)


def detach_from(state: dict[str, torch.Tensor], model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """`state` with a copy of each tensor that shares memory with `model`'s parameters or buffers
    (a full state dict of an unsharded model, or of one rank's shard, hands out the live tensors;
    a cast to the same dtype keeps them): safe to read while the optimizer updates the model."""
    live = {_local(t).untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    return {k: v.clone() if v.untyped_storage().data_ptr() in live else v for k, v in state.items()}


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t  # a DTensor's own shard


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Floating tensors to `dtype`, contiguous (safetensors and broadcast need it)."""
    return {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in state.items()}


# A delta above this share of the full version is written whole: reading the base, applying and
# hashing cost the engine more than loading the full version would (benchmarks/RESULTS.md).
MAX_DELTA_FRACTION = 0.5


class DeltaChain:
    """The sender's side of a chain of deltas: the previous version's tensors (one copy of the
    published state in memory, which the caller must not change after handing it over: the
    trainer detaches them) and the newest anchor (a version sent whole)."""

    def __init__(self, anchor_every: int, granularity: str = "tensor", block_elems: int = 65536):
        self.anchor_every, self.granularity, self.block_elems = anchor_every, granularity, block_elems
        self.prev: tuple[int, int, dict[str, torch.Tensor]] | None = None  # (epoch, version, state)
        self.anchor: tuple[int, int] | None = None  # (epoch, version)

    def delta(
        self, version: int, state: dict[str, torch.Tensor], epoch: int
    ) -> tuple[DeltaManifest, dict[str, torch.Tensor]] | None:
        """The delta from the previous version to `version`, or None when `version` is to be an
        anchor: the first, after a gap, a rollback or a new epoch, every `anchor_every`-th, when
        names, shapes or dtypes changed, or when the delta would exceed `MAX_DELTA_FRACTION` of
        the full version."""
        prev, anchor = self.prev, self.anchor
        if (
            prev is None
            or anchor is None
            or (prev[0], prev[1]) != (epoch, version - 1)
            or anchor[0] != epoch
            or version - anchor[1] >= self.anchor_every
        ):
            return None
        full = sum(t.numel() * t.element_size() for t in state.values())
        try:
            delta = compute_delta(
                prev[2],
                state,
                granularity=self.granularity,
                block_elems=self.block_elems,
                max_bytes=int(full * MAX_DELTA_FRACTION),
            )
        except ValueError:  # names, shapes or dtypes changed: start a new chain
            return None
        if delta is None:  # most of it changed (fp32, a large step, coarse blocks): an anchor
            return None
        tensors, hashes = delta
        changed = sum(t.numel() * t.element_size() for t in tensors.values())
        manifest = DeltaManifest(
            version=version,
            epoch=epoch,
            base=version - 1,
            anchor=anchor[1],
            granularity=self.granularity,
            block_elems=self.block_elems,
            sha256=hashes,
            tensors_total=len(state),
            changed_bytes=changed,
            full_bytes=full,
        )
        return manifest, tensors

    def sent(self, version: int, state: dict[str, torch.Tensor], epoch: int, *, anchor: bool) -> None:
        """`version` reached its receivers (whole when `anchor`): the next delta is against it."""
        self.prev = (epoch, version, state)
        if anchor:
            self.anchor = (epoch, version)

    def reset(self) -> None:
        """Forget the chain (a failed send): the next version is an anchor."""
        self.prev = self.anchor = None


class DiskPublisher:
    """`delta=True`: every `anchor_every`-th version (and the first, and any after a gap, a
    rollback or a new epoch) is written whole (an anchor); the others hold only what changed
    since the previous version (services/transport/weights/delta.py; `DeltaChain` decides).

    `adapter_config` (LoRA, trainer/lora.py): each version is a PEFT adapter directory instead,
    `adapter_config.json` (this dict) and `adapter_model.safetensors` (the state handed to
    `write`: the adapter's tensors alone), nothing of the source directory; named, announced,
    kept and pruned like full versions. Not with `delta`."""

    def __init__(
        self,
        root: str | Path,
        source_dir: str | Path,
        keep: int = 3,
        *,
        delta: bool = False,
        anchor_every: int = 10,
        granularity: str = "tensor",
        block_elems: int = 65536,
        adapter_config: dict | None = None,
    ):
        if delta and adapter_config is not None:
            raise ValueError("adapters are published whole: no delta")
        self.root = Path(root)
        self.source_dir = Path(source_dir)
        self.keep = keep
        self.delta = delta
        self.adapter_config = adapter_config
        self.chain = DeltaChain(anchor_every, granularity, block_elems)
        self.root.mkdir(parents=True, exist_ok=True)
        for stale in self.root.glob(".tmp-*"):  # a write a crash cut short: never announced, never loaded
            shutil.rmtree(stale, ignore_errors=True)
        # closes the last references to pruned weight files (see _prune)
        self._closer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="weights-prune")
        self._closing: Future | None = None
        self._synced: set[str] = set()  # source files fsynced once: their links need no fsync again

    def path_of(self, version: int, epoch: int = 0) -> Path:
        return self.root / version_dir_name(version, epoch)

    def write(self, version: int, state: dict[str, torch.Tensor], epoch: int = 0) -> Published:
        """Rank 0: write version `version` of `epoch` durably; returns where and how many bytes."""
        from safetensors.torch import save_file

        t0 = time.perf_counter()
        if self._closing is not None:  # at most one prune's files held open at a time
            self._closing.result()
        self._drop_lost(version, epoch)
        final = self.path_of(version, epoch)
        tmp = self.root / f".tmp-{final.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        if self.adapter_config is not None:
            return self._write_adapter(version, state, epoch, tmp, final, t0)
        written = [tmp / MODEL_FILE]  # files whose bytes this write put on disk
        for f in self.source_dir.iterdir():
            if not f.is_file() or is_source_weights(f.name):
                continue
            if not _link_or_copy(f, tmp / f.name) or f.name not in self._synced:
                written.append(tmp / f.name)
                self._synced.add(f.name)
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        anchor = self.chain.anchor
        on_disk = anchor is not None and self.path_of(anchor[1], epoch).is_dir()
        delta = self.chain.delta(version, state, epoch) if self.delta and on_disk else None
        if delta is None:
            save_file(state, str(tmp / MODEL_FILE), metadata=file_metadata(version, epoch))
        else:
            manifest, tensors = delta
            save_file(tensors, str(tmp / DELTA_FILE), metadata=file_metadata(version, epoch))
            (tmp / MANIFEST_FILE).write_text(manifest.to_json())
            written[0] = tmp / DELTA_FILE
            written.append(tmp / MANIFEST_FILE)
            nbytes = manifest.changed_bytes
        atomic_publish_dir(tmp, final, written)  # at one publish per step every fsync counts (~2-3 ms each)
        if self.delta:  # only once the version is in place: a failed write starts a new chain
            self.chain.sent(version, state, epoch, anchor=delta is None)
        self._prune()
        return Published(version, nbytes, time.perf_counter() - t0, str(final), delta=delta is not None)

    def _write_adapter(
        self, version: int, state: dict[str, torch.Tensor], epoch: int, tmp: Path, final: Path, t0: float
    ) -> Published:
        from safetensors.torch import save_file

        save_file(state, str(tmp / ADAPTER_FILE), metadata=file_metadata(version, epoch))
        (tmp / ADAPTER_CONFIG_FILE).write_text(json.dumps(self.adapter_config, indent=2, sort_keys=True))
        atomic_publish_dir(tmp, final, [tmp / ADAPTER_FILE, tmp / ADAPTER_CONFIG_FILE])
        self._prune()
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        return Published(version, nbytes, time.perf_counter() - t0, str(final))

    def _drop_lost(self, version: int, epoch: int) -> None:
        """Versions above `version` of this or an older epoch come from steps lost in a crash
        (the trainer resumed from an older checkpoint): they must never be served again, and
        must not crowd out `version`."""
        for (e, v), p in published_versions(self.root):
            if e <= epoch and v > version:
                shutil.rmtree(p, ignore_errors=True)

    def _prune(self) -> None:
        """Remove all but the newest `keep` versions before `write` returns; with deltas, also
        keep the newest anchor and every version after it (an engine on any older version
        resyncs from that anchor through those deltas). Deleting a weight
        file costs ~0.1 s per 540 MB on ext4, paid when its last reference goes (the kernel
        frees its blocks and cached pages then): an fd held across the unlink lets a
        background thread pay it, so the trainer does not wait for the filesystem."""
        listed = published_versions(self.root)
        versions = [p for _, p in listed]
        doomed = versions[: -self.keep]
        if self.delta and self.chain.anchor is not None:
            doomed = [p for key, p in listed[: -self.keep] if key < self.chain.anchor]
        held: list[int] = []
        for old in doomed:
            for f in old.glob("*.safetensors"):
                try:
                    held.append(os.open(f, os.O_RDONLY))
                except OSError:  # gone already, or unreadable: rmtree deletes it inline
                    pass
            shutil.rmtree(old, ignore_errors=True)
        if held:
            self._closing = self._closer.submit(lambda: [os.close(fd) for fd in held])


def _link_or_copy(src: Path, dst: Path) -> bool:
    """A hard link (no bytes written; fsyncing it syncs the shared inode), else a copy: on
    another filesystem, without link support, or for a file this process may not write
    (`fsync_file` opens a file read-write to fsync it). True for a link."""
    if os.access(src, os.W_OK):
        try:
            os.link(src, dst)
            return True
        except OSError:
            pass
    shutil.copy2(src, dst)
    return False


class BroadcastPublisher:
    """Rank 0 only. `connect()` once (engines join the group), then `publish(version, state)`.

    The wire protocol is services/transport/weights/broadcast.py's (SGLang's): this class adds
    the choreography around it: group membership from each engine's TP size, pausing generation
    for the duration of an update, and a typed error when an engine refuses.

    `delta=True`: a version is sent as the tensors that changed since the previous one
    (`DeltaChain`, whole tensors), with an anchor every `anchor_every`. Reference engines get
    the delta's base and hashes and check them; an engine that refuses the delta (409) is sent
    the full version at once, in the same pause (so is every engine: a broadcast reaches the
    whole group), and that version starts a new chain. SGLang engines cannot check anything, so
    before a delta each one's `weight_version` must be the base (`/model_info`), else the
    version goes out in full. Each full version sent instead of a delta is counted by reason
    (`asyncrl_trainer_weight_resyncs_total`); any failure forgets the chain."""

    def __init__(
        self,
        engine_urls: list[str],
        master_address: str,
        master_port: int,
        backend: str,
        bucket_bytes: int,
        group_name: str = "asyncrl_weights",
        timeout_s: float = 600.0,
        api_token: str | None = None,
        *,
        delta: bool = False,
        anchor_every: int = 10,
    ):
        self.engine_urls = [u.rstrip("/") for u in engine_urls]
        self.master_address, self.master_port, self.backend = master_address, master_port, backend
        self.bucket_bytes, self.group_name, self.timeout_s = bucket_bytes, group_name, timeout_s
        self.headers = {"Authorization": f"Bearer {api_token}"} if api_token else {}
        self.http = httpx.Client(timeout=timeout_s, headers=self.headers)
        self.group = None
        self.delta = delta
        self.chain = DeltaChain(anchor_every, "tensor")  # SGLang's wire names whole tensors only
        self.reference: list[bool] = []  # per engine: a reference engine (reads the delta extension)

    def _engine_info(self, url: str) -> tuple[int, bool]:
        """(ranks it joins with, whether it is a reference engine): an SGLang engine joins with
        tp_size ranks (`/get_server_info`); the reference engine with 1, and names the SGLang
        release it follows there (`sglang_api_commit`)."""
        resp = self.http.get(url + "/get_server_info")
        if resp.status_code == 404:
            return 1, False
        resp.raise_for_status()
        info = resp.json()
        return int(info.get("tp_size", 1)), "sglang_api_commit" in info

    def _post_all(self, path: str, bodies: list[dict]) -> None:
        with ThreadPoolExecutor(max_workers=max(len(bodies), 1)) as pool:
            answers = list(
                pool.map(lambda ub: self._post(ub[0] + path, ub[1]), zip(self.engine_urls, bodies))
            )
        failed = [a for a in answers if a]
        if failed:
            raise BroadcastError("; ".join(failed))

    def _post(self, url: str, body: dict) -> str:
        """'' on success, else what went wrong."""
        try:
            resp = self.http.post(url, json=body)
        except httpx.HTTPError as exc:
            return f"{url}: {exc!r}"
        ok = resp.status_code == 200 and (not resp.content or resp.json().get("success", True) is not False)
        return "" if ok else f"{url}: HTTP {resp.status_code} {resp.text[:300]}"

    def connect(self) -> None:
        infos = [self._engine_info(u) for u in self.engine_urls]
        sizes = [size for size, _ in infos]
        self.reference = [reference for _, reference in infos]
        world = 1 + sum(sizes)
        bodies = [
            {
                "master_address": self.master_address,
                "master_port": self.master_port,
                "rank_offset": 1 + sum(sizes[:i]),
                "world_size": world,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            for i in range(len(sizes))
        ]
        # The rendezvous needs both sides at once: rank 0 hosts it on a thread of its own while the
        # engines are asked to join. An engine that refuses (a backend it cannot run, a group of
        # that name already there) answers at once, and that answer is raised at once, instead of
        # after rank 0 waited `timeout_s` for ranks that will never come (the host thread is a
        # daemon left to that timeout).
        hosted: Future = Future()

        def host() -> None:
            try:
                hosted.set_result(
                    init_weight_update_group(
                        self.master_address,
                        self.master_port,
                        0,
                        world,
                        self.group_name,
                        self.backend,
                        self.timeout_s,
                    )
                )
            except BaseException as exc:  # noqa: BLE001 — handed to connect(), which raises it
                hosted.set_exception(exc)

        threading.Thread(target=host, name="weight-group-host", daemon=True).start()
        self._post_all("/init_weights_update_group", bodies)
        self.group = hosted.result(timeout=self.timeout_s)
        self._close_stale_sessions()

    def _close_stale_sessions(self) -> None:
        """End a weight-update session a dead trainer left open (SGLang refuses to open a second);
        an engine without one answers that none is open, which is the usual case."""
        for url in self.engine_urls:
            resp = self.http.post(url + "/end_weight_update", json={})
            if resp.status_code != 200 and "no weight-update session is open" not in resp.text:
                raise BroadcastError(f"{url}: HTTP {resp.status_code} {resp.text[:300]}")

    def publish(self, version: int, state: dict[str, torch.Tensor], epoch: int = 0) -> Published:
        if self.group is None:
            self.connect()
        t0 = time.perf_counter()
        name, base = weight_version_name(version, epoch), weight_version_name(version - 1, epoch)
        delta = self.chain.delta(version, state, epoch) if self.delta else None
        if delta is not None and self._behind(base):
            tm.PUBLISH_RESYNCS.labels(reason="behind").inc()
            delta = None
        everyone = [{}] * len(self.engine_urls)
        self._post_all("/pause_generation", everyone)
        try:
            # SGLang 0.5.23 takes /update_weights_from_distributed only inside this session
            self._post_all("/begin_weight_update", everyone)
            try:
                nbytes, as_delta = self._send_version(version, state, name, base, delta)
            finally:
                self._post_all("/end_weight_update", everyone)
        except BaseException:
            # The engines stay paused: some buckets may have loaded, under the old version's
            # name, and generating on them would label tokens with weights they were not
            # sampled from. The trainer exits; its restart's rollback publish sends a whole
            # version and continues them (trainer/loop.py).
            self.chain.reset()
            raise
        self._post_all("/continue_generation", everyone)
        if self.delta:
            self.chain.sent(version, state, epoch, anchor=not as_delta)
        return Published(version, nbytes, time.perf_counter() - t0, delta=as_delta)

    def _send_version(
        self,
        version: int,
        state: dict[str, torch.Tensor],
        name: str,
        base: str,
        delta: tuple[DeltaManifest, dict[str, torch.Tensor]] | None,
    ) -> tuple[int, bool]:
        """(bytes of the form the engines took, whether a delta): `delta` when given and every
        engine takes it, else (also after a refusal: the refused delta's bytes are not counted)
        `state` whole."""
        if delta is not None:
            manifest, tensors = delta
            hashes = manifest.sha256
            if not tensors:  # nothing changed: the version's name still travels with a bucket
                tensors = _smallest(state)
                hashes = {n: tensor_sha256(t) for n, t in tensors.items()}
            try:
                return self._send(tensors, name, DeltaAnnouncement(base, hashes)), True
            except DeltaRefused as exc:
                tm.PUBLISH_RESYNCS.labels(reason="refused").inc()
                log_event(
                    log,
                    "delta refused, sending the full version",
                    logging.WARNING,
                    version=version,
                    error=str(exc),
                )
                return self._send(state, name, None), False
        return self._send(state, name, None), False

    def _send(
        self, named: dict[str, torch.Tensor], weight_version: str, delta: DeltaAnnouncement | None
    ) -> int:
        """Broadcast `named` as `weight_version` (a delta's buckets announced with `delta`);
        the bytes sent. Raises `DeltaRefused` (a delta only) or `BroadcastError`."""
        device = (
            torch.device("cpu")
            if self.backend == "gloo"
            else torch.device("cuda", torch.cuda.current_device())
        )
        announce = http_announcer(
            self.engine_urls,
            weight_version=weight_version,
            group_name=self.group_name,
            timeout_s=self.timeout_s,
            headers=self.headers,
            delta=delta,
            extended=self.reference,
        )
        try:
            broadcast_weights(
                ((n, t.to(device)) for n, t in named.items()),
                self.group,
                self.bucket_bytes,
                announce=announce,
            )
        except DeltaRefused:
            raise
        except RuntimeError as exc:
            raise BroadcastError(str(exc)) from exc
        return sum(t.numel() * t.element_size() for t in named.values())

    def _behind(self, base: str) -> bool:
        """Whether an SGLang engine does not serve `base` (it cannot check a delta's base itself)."""
        for url, reference in zip(self.engine_urls, self.reference):
            if reference:
                continue
            resp = self.http.get(url + "/model_info")
            if resp.status_code == 404:  # a server before 0.5.23's route names
                resp = self.http.get(url + ROUTES["/model_info"])
            if resp.status_code != 200 or resp.json().get("weight_version") != base:
                return True
        return False

    def close(self) -> None:
        self.http.close()


def _smallest(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The smallest tensor of `state`: what an empty delta sends, so that its last bucket
    carries the version's name."""
    name = min(state, key=lambda n: state[n].numel())
    return {name: state[name]}


class BroadcastError(RuntimeError):
    """An engine refused or failed a weight update."""
