"""The broadcast of weights over torch.distributed, SGLang's protocol, both ends of it: the
sender's bucket planning, send and per-bucket announcement (trainer/publish.py drives them) and
the receiver's join and receive (services/engine/updates.py). The contract, what `last` means
included, is services/transport/weights' docstring.

The sequence, the same for a real SGLang server and the reference engine:

1. Every engine is told to join a group: `POST /init_weights_update_group` with
   `{master_address, master_port, rank_offset, world_size, group_name, backend}`. The sender
   is rank 0 and hosts the rendezvous store on `master_address:master_port`; engine `i` is
   rank `rank_offset` (one rank per reference engine; an SGLang engine with TP=k takes k ranks).
   The sender calls `init_weight_update_group(..., rank=0)` *concurrently* with those HTTP
   calls: the rendezvous completes only when every rank has joined.
2. For each bucket (`plan_buckets`) the sender announces it to every engine with one
   `POST /update_weights_from_distributed` (`bucket_request`), then broadcasts each tensor of
   the bucket from rank 0, in `names` order, one collective per tensor (`receive_bucket` on
   the engine). The HTTP call returns once the engine has received and loaded the bucket.
3. The sender pauses generation (`POST /pause_generation`) before the first bucket and
   continues after the last, so no request is decoded with half-updated weights; the
   reference engine applies each bucket between two scheduler steps and drops old-weight KV.
   Inside the pause it opens a weight-update session (`POST /begin_weight_update`) and ends
   it (`POST /end_weight_update`): SGLang 0.5.23 refuses `/update_weights_from_distributed`
   outside one (the reference engine receives such a bucket, then refuses it).
4. A body the engine cannot even parse (HTTP 422) leaves the sender's broadcast to time out
   after `timeout_s`.

Deltas (`DeltaAnnouncement`). A version may carry only the tensors that changed since the
previous one, under their own names: a subset of the names is valid SGLang protocol (its
`/update_weights_from_distributed` loads whatever names a bucket lists). The buckets of a
delta are announced with asyncrl's `delta` extension (`proto.sglang.BroadcastDelta`: the base
version, and each tensor's sha256 as sent) to reference engines only; an SGLang engine gets
SGLang's fields alone, and so checks neither. A reference engine answers a bucket it will not
take (not on the base, a hash that differs) with 409 after it has received the bucket's
tensors, so the stream stays in step; the announcer raises `DeltaRefused` when every engine
that failed answered 409, and the sender then sends the version in full. Changed blocks of a
tensor cannot be named on SGLang's wire: deltas here are whole tensors.

Names are the HF state-dict names (`model.layers.0.self_attn.q_proj.weight`); dtypes are torch
dtype names (`"bfloat16"`, `"float32"`; a `"torch."` prefix is accepted); tensors are sent
contiguous, on the group's device (CPU for gloo).

The group is a standalone `ProcessGroupGloo`/`ProcessGroupNCCL` on its own TCP store, so it
never touches the trainer's default (FSDP) process group. Its store layout (`{group_name}/`
then `{device}/` prefixes on a TCPStore hosted by rank 0) matches torch's
`_new_process_group_helper`, which SGLang's `init_custom_process_group` uses, so either side
can be a real SGLang.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
DEFAULT_TIMEOUT_S = 300.0


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = "weight_update_group",
    backend: str = "gloo",
    timeout_s: float = DEFAULT_TIMEOUT_S,
):
    """Join (rank > 0) or host (rank 0) a weight-update group; returns the process group."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    group_store = dist.PrefixStore(f"{group_name}/", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(dist.PrefixStore("cpu/", group_store), rank, world_size, timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(dist.PrefixStore("cuda/", group_store), rank, world_size, options)
    raise ValueError(f"unsupported backend {backend!r} (gloo or nccl)")


def broadcast(group, tensor: torch.Tensor, src: int = 0) -> None:
    """Blocking broadcast of `tensor` from `src` over a group made by `init_weight_update_group`."""
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    group.broadcast([tensor], opts).wait()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


DTYPES = {
    dtype_name(d): d
    for d in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; one of {sorted(DTYPES)}") from None


@dataclass(frozen=True)
class Bucket:
    """What the sender announces of one bucket; `last`: no bucket follows, so the announcement
    carries the new `weight_version`."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    last: bool


@dataclass(frozen=True)
class DeltaAnnouncement:
    """What a delta version's buckets carry to reference engines: the version it applies to
    (`weight_version_name`) and every tensor's sha256 (delta.py `tensor_sha256`)."""

    base: str
    sha256: Mapping[str, str]


class DeltaRefused(RuntimeError):
    """Every engine that failed a bucket of a delta answered 409: it needs the full version."""


# announce(bucket) starts the engines' metadata calls and returns a Future that resolves
# once they have received the bucket (and raises if any engine refused it).
Announce = Callable[[Bucket], Future]


def broadcast_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    group,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    announce: Announce,
) -> int:
    """Send `named_tensors` to every engine of `group` (called on rank 0); returns the number
    of buckets. One `announce` (one metadata HTTP call per engine) per bucket."""
    count = 0
    for tensors, bucket in plan_buckets(named_tensors, bucket_bytes):
        pending = announce(bucket)
        for tensor in tensors:
            broadcast(group, tensor)
        pending.result()
        count += 1
    return count


def plan_buckets(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[tuple[list[torch.Tensor], Bucket]]:
    """`named` in buckets of about `bucket_bytes`, drawn lazily: a bucket is yielded once its
    tensors and the next one (to know whether it is the last) have been drawn, so a caller whose
    iterable moves each tensor to the GPU as it is drawn holds one bucket there, not the model."""
    it = iter(named)
    ahead = next(it, None)
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    while ahead is not None:
        name, t = ahead
        t = t.detach().contiguous()
        current.append((name, t))
        size += t.numel() * t.element_size()
        ahead = next(it, None)
        if size >= bucket_bytes or ahead is None:
            yield (
                [t for _, t in current],
                Bucket(
                    names=[n for n, _ in current],
                    dtypes=[dtype_name(t.dtype) for _, t in current],
                    shapes=[list(t.shape) for _, t in current],
                    last=ahead is None,
                ),
            )
            current, size = [], 0


def receive_bucket(
    group, names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], device
) -> dict[str, torch.Tensor]:
    """The receiver's half of one bucket: every announced tensor, in `names` order, on `device`
    (the group's: CPU for gloo). Nothing is checked here, so the sender is never left blocked on
    a tensor the receiver refuses afterwards."""
    received = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        tensor = torch.empty(shape, dtype=dtype, device=device)
        broadcast(group, tensor)
        received[name] = tensor
    if device != "cpu":  # the receiver's next reads run on other threads and streams
        torch.cuda.current_stream(device).synchronize()
    return received


def bucket_request(
    bucket: Bucket,
    *,
    weight_version: str | None,
    group_name: str,
    flush_cache: bool = True,
    delta: DeltaAnnouncement | None = None,
) -> dict:
    """The body of `/update_weights_from_distributed` announcing `bucket`
    (`UpdateWeightsFromDistributedReqInput` in proto/sglang.py; with `delta`, the reference
    engine's `ReferenceUpdateWeightsFromDistributedReqInput`)."""
    body = {
        "names": bucket.names,
        "dtypes": bucket.dtypes,
        "shapes": bucket.shapes,
        "group_name": group_name,
        "flush_cache": flush_cache,
        "weight_version": weight_version if bucket.last else None,
    }
    if delta is not None:
        body["delta"] = {"base": delta.base, "sha256": {n: delta.sha256[n] for n in bucket.names}}
    return body


def http_announcer(
    engine_urls: list[str],
    *,
    weight_version: str | None,
    group_name: str = "weight_update_group",
    flush_cache: bool = True,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    headers: dict[str, str] | None = None,
    delta: DeltaAnnouncement | None = None,
    extended: Sequence[bool] | None = None,
) -> Announce:
    """An `announce` that POSTs each bucket to `/update_weights_from_distributed` of every
    engine in parallel; the Future raises `RuntimeError` naming the engines that failed
    (`DeltaRefused` when each of them answered 409). `delta` goes to the engines whose entry
    of `extended` is true (reference engines), never to the others."""
    import httpx

    # one worker per engine plus one for the gathering job
    pool = ThreadPoolExecutor(max_workers=len(engine_urls) + 1, thread_name_prefix="weight-announce")

    def post(url: str, body: dict) -> None:
        resp = httpx.post(
            f"{url.rstrip('/')}/update_weights_from_distributed",
            json=body,
            timeout=timeout_s,
            headers=headers,
        )
        if resp.status_code == 409 and delta is not None:
            raise DeltaRefused(f"{url}: HTTP 409: {resp.text[:500]}")
        if resp.status_code != 200 or not resp.json().get("success", False):
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {resp.text[:500]}")

    def announce(bucket: Bucket) -> Future:
        bodies = [
            bucket_request(
                bucket,
                weight_version=weight_version,
                group_name=group_name,
                flush_cache=flush_cache,
                delta=delta if extended is not None and extended[i] else None,
            )
            for i in range(len(engine_urls))
        ]
        futures = [pool.submit(post, url, body) for url, body in zip(engine_urls, bodies)]
        done: Future = Future()

        def gather() -> None:
            errors: list[Exception] = []
            for f in futures:
                try:
                    f.result()
                except Exception as exc:  # noqa: BLE001 — collected and re-raised below as one error
                    errors.append(exc)
            if errors:
                kind = DeltaRefused if all(isinstance(e, DeltaRefused) for e in errors) else RuntimeError
                done.set_exception(kind("weight update failed: " + "; ".join(map(str, errors))))
            else:
                done.set_result(None)

        pool.submit(gather)
        return done

    return announce
