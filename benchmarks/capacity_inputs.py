"""The capacity model of docs/scaling.md: every per-unit figure it uses, measured here, and the
arithmetic that scales them to a large run.

Measured on this machine (one thread each, as rank 0 and a rollout replica run):
* a `Group` of G samples × T completion tokens as `proto/codec.py` writes it: bytes (token columns,
  text, the rest), encode and decode time;
* the rollout's CPU per group, in part: G `/generate` answers of T tokens (SGLang's JSON, a
  `[logprob, id, null]` triple per token) parsed by the engine client, gathered column-wise into
  `Samples` as the scheduler does, built into a `Group` and encoded (no HTTP, no event loop, no
  reward call: a lower bound);
* a real redis-server on a free port (AOF, `appendfsync always`, as shipped) fed through
  `Groups.put` (batches of 4) and `Groups.take` (all at once, as the trainer asks for B) + `ack`:
  Redis memory per stored group (`MEMORY USAGE` of every key of the run, `INFO memory` beside it),
  commands per group (`INFO commandstats`, those run inside scripts included), redis-server
  main-thread CPU per group (`INFO cpu`) and one client's put and take + ack rates; then 1,000
  one-token groups for the metadata's share of that CPU and what a group leaves after its ack;
* fp32 → bf16 cast of a CPU tensor (rank 0 casts the gathered full state before it publishes) and
  `compute_delta` (bitwise compare, gather, sha256) on a bf16 state with 2.5% of its elements
  changed, the share benchmarks/publish_delta.py measured on SmolLM2 with Adam-sized steps.

`capacity()` then turns a `Scenario` (default: a 32B dense model on 1,024 H100s, 8k-token answers,
G = 16, B = 512, η = 4), the measured figures and the external anchors of `Anchors` (spec sheets,
published measurements; not measured here) into the derived figures the document shows.

    .venv/bin/python benchmarks/capacity_inputs.py [--groups 16] [--rounds 5] [--doc]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import string
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import msgspec
import numpy as np
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.buffer import Buffer, Groups, RedisServer
from asyncrl.buffer.groups import STALE_STREAM_MAXLEN
from asyncrl.proto import Group, RewardStatus, Samples, decode, encode

PUT_BATCH = 4  # groups per put: a rollout replica writes the groups it finished, a few at a time
PROBES = {"info", "memory", "scan", "config"}  # this script's own reads, not counted as the buffer's commands
RESIDUE_GROUPS = 1000
CHANGED_FRACTION = 0.025  # elements of a bf16 state that change per step (SmolLM2, RESULTS.md)


@dataclass(frozen=True)
class Scenario:
    """The run to size. The model's shape is Qwen2.5-32B's public config."""

    params: float = 32e9
    layers: int = 64
    attn_width: int = 5120  # query heads × head dim (40 × 128)
    kv_heads: int = 8
    head_dim: int = 128
    gpus: int = 1024
    gpus_per_node: int = 8
    answer_tokens: int = 8192  # every answer at 8k: an upper bound on bytes and work
    prompt_tokens: int = 512  # assumed
    chars_per_token: float = 4.0  # assumed: the text the rollout stores beside the tokens
    group_size: int = 16  # G
    batch_groups: int = 512  # B
    max_staleness: int = 4  # η
    checkpoint_every: int = 10  # the trainer's default: trained groups are acked (and freed) then
    engine_tp: int = 4  # SGLang --tp-size per engine


@dataclass(frozen=True)
class Anchors:
    """Figures not measured here. External: spec sheets and published measurements (cited in
    docs/scaling.md). Assumed: efficiencies chosen for the model, each a plain guess."""

    gpu_flops: float = 989e12  # external: H100 SXM dense bf16 tensor FLOP/s
    hbm_bytes_s: float = 3.35e12  # external: H100 SXM HBM3
    gpu_memory: float = 80e9  # external: H100 80 GB
    net_bytes_s: float = 50e9  # external: one 400 Gb/s NDR InfiniBand port per GPU
    train_mfu: float = 0.40  # assumed: FSDP2 training, long sequences
    prefill_mfu: float = 0.50  # assumed: SGLang prefill
    decode_hbm_efficiency: float = 0.70  # assumed: share of HBM bandwidth a decode step reaches
    mem_fraction: float = 0.85  # SGLang's --mem-fraction-static: weights + KV pool
    delta_fraction: float = 0.075  # measured here before (RESULTS.md "Delta weight sync", SmolLM2 bf16)


@dataclass(frozen=True)
class Measured:
    """Per-unit figures this script measures (`measure`)."""

    group_bytes: float  # one encoded Group
    redis_bytes_per_group: float  # Redis memory while the group is stored (payload + metadata)
    redis_residue_per_group: float  # Redis memory a group keeps after it left (its state field)
    redis_us_per_group: float  # redis-server main-thread CPU for put + take + ack
    redis_meta_us_per_group: float  # the same for a one-token group: the metadata's part
    commands_per_group: float  # Redis commands for put + take + ack (in scripts included)
    put_bytes_s: float  # one client, payload bytes/s of Groups.put
    take_bytes_s: float  # one client, payload bytes/s of Groups.take + ack
    encode_s_per_group: float
    decode_s_per_group: float
    rollout_s_per_group: float  # parse the answers, gather the columns, build, encode
    cast_bytes_s: float  # fp32 bytes/s cast to bf16, one thread
    delta_s_per_byte: float  # compute_delta seconds per byte of the bf16 state, one thread


# The medians of five runs of this script (2026-12-07, 2 shared cores, load average 4-5) that
# docs/scaling.md uses; `--doc` prints the derived figures from these instead of measuring.
DOC_MEASURED = Measured(
    group_bytes=2_100_974,
    redis_bytes_per_group=2_622_071,
    redis_residue_per_group=82,
    redis_us_per_group=4_800,
    redis_meta_us_per_group=90,
    commands_per_group=6.125,
    put_bytes_s=270e6,
    take_bytes_s=400e6,
    encode_s_per_group=0.35e-3,
    decode_s_per_group=0.35e-3,
    rollout_s_per_group=0.093,
    cast_bytes_s=2.5e9,
    delta_s_per_byte=2.7e-9,
)


def capacity(s: Scenario, a: Anchors, m: Measured) -> dict[str, float]:
    """The derived figures of docs/scaling.md, by name. Pure arithmetic; docs/scaling.md writes
    out each formula. Bytes are bytes, times seconds, rates per second."""
    d: dict[str, float] = {}
    seq = s.prompt_tokens + s.answer_tokens
    samples = s.batch_groups * s.group_size
    d["completion_tokens_per_step"] = samples * s.answer_tokens
    d["train_tokens_per_step"] = samples * seq  # a row is prompt + answer (no prompt sharing past 4,096)
    # Matmuls 6N per token; causal attention 2·L·width·seq forward per token on average, ×3 with backward.
    d["train_flops_per_token"] = 6 * s.params + 6 * s.layers * s.attn_width * seq
    d["train_tokens_s_per_gpu"] = a.gpu_flops * a.train_mfu / d["train_flops_per_token"]

    # An engine decodes while memory-bound: each step reads the weights and the whole KV pool.
    weights = 2 * s.params  # bf16
    kv_per_token = 2 * s.layers * s.kv_heads * s.head_dim * 2  # K and V, bf16
    pool = s.engine_tp * a.gpu_memory * a.mem_fraction - weights
    resident = s.prompt_tokens + s.answer_tokens / 2  # mean context of a running request
    d["kv_bytes_per_token"] = kv_per_token
    d["engine_kv_tokens"] = pool / kv_per_token
    d["engine_concurrency"] = d["engine_kv_tokens"] / resident
    d["engine_step_s"] = (weights + pool) / (s.engine_tp * a.hbm_bytes_s * a.decode_hbm_efficiency)
    d["engine_tokens_s"] = d["engine_concurrency"] / d["engine_step_s"]
    d["decode_tokens_s_per_gpu"] = d["engine_tokens_s"] / s.engine_tp

    # GPUs split so generation and training take the same time per step (η lets them overlap).
    gen_gpu_s = d["completion_tokens_per_step"] / d["decode_tokens_s_per_gpu"]
    train_gpu_s = d["train_tokens_per_step"] / d["train_tokens_s_per_gpu"]
    per_node = s.gpus_per_node
    trainer_gpus = per_node * round(s.gpus * train_gpu_s / (gen_gpu_s + train_gpu_s) / per_node)
    d["trainer_gpus"] = trainer_gpus
    d["engine_gpus"] = s.gpus - trainer_gpus
    d["engines"] = d["engine_gpus"] // s.engine_tp
    d["engine_nodes"] = d["engine_gpus"] / per_node
    d["generation_s"] = gen_gpu_s / d["engine_gpus"]
    d["training_s"] = train_gpu_s / trainer_gpus
    step = d["step_s"] = max(d["generation_s"], d["training_s"])

    # Rollout concurrency against the admission window.
    d["groups_in_flight_needed"] = d["engines"] * d["engine_concurrency"] / s.group_size
    d["admission_window_groups"] = (s.max_staleness + 1) * s.batch_groups
    d["rollout_cores"] = s.batch_groups / step * m.rollout_s_per_group

    # The buffer.
    d["groups_s"] = s.batch_groups / step
    d["buffer_bytes_s"] = d["groups_s"] * m.group_bytes  # in (puts); the same leaves by takes
    d["commands_s"] = d["groups_s"] * m.commands_per_group
    d["redis_core_share"] = d["groups_s"] * m.redis_us_per_group / 1e6
    d["redis_groups_s_per_core"] = 1e6 / m.redis_us_per_group
    # On a cluster the payloads spread over the masters; the run's metadata stays on one.
    d["redis_meta_core_share"] = d["groups_s"] * m.redis_meta_us_per_group / 1e6
    d["cluster_meta_groups_s"] = 1e6 / m.redis_meta_us_per_group
    # Payloads held: groups put and not trained (+ running, no payload yet) stay under the
    # admission window; trained groups keep theirs until the checkpoint's ack.
    d["payload_groups_max"] = (s.max_staleness + 1 + s.checkpoint_every) * s.batch_groups
    d["redis_bytes_max"] = d["payload_groups_max"] * m.redis_bytes_per_group
    d["take_reply_bytes"] = s.batch_groups * m.group_bytes  # one MGET of B payloads
    d["stale_stream_bytes_max"] = STALE_STREAM_MAXLEN * m.redis_bytes_per_group  # dropped groups kept
    d["redis_residue_per_step"] = s.batch_groups * m.redis_residue_per_group

    # Trainer rank 0, every step, before the ranks can start: take B groups, re-encode them for
    # the broadcast; then every rank decodes all B.
    d["rank0_take_s"] = d["take_reply_bytes"] / m.take_bytes_s
    d["rank0_encode_s"] = s.batch_groups * m.encode_s_per_group
    d["rank_decode_s"] = s.batch_groups * m.decode_s_per_group

    # Weights, every version.
    full = weights
    master = 4 * s.params  # fp32, what FSDP2 gathers
    d["publish_bytes"] = full
    d["gather_wire_s"] = master / a.net_bytes_s  # floor: rank 0 receives the fp32 state
    d["cast_s"] = master / m.cast_bytes_s
    d["broadcast_wire_s"] = full / a.net_bytes_s  # floor: one copy per link, pipelined
    d["disk_read_bytes_per_version"] = d["engine_nodes"] * full  # one read per node (page cache)
    d["disk_read_bytes_s"] = d["disk_read_bytes_per_version"] / step
    d["delta_bytes"] = a.delta_fraction * full
    d["delta_read_bytes_s"] = d["engine_nodes"] * d["delta_bytes"] / step
    d["delta_compute_s"] = full * m.delta_s_per_byte
    # Every update aborts (or retracts) the running requests: their KV is recomputed.
    prefill_flops = 2 * s.params + 2 * s.layers * s.attn_width * resident
    prefill_tokens_s = s.engine_tp * a.gpu_flops * a.prefill_mfu / prefill_flops
    d["kv_recompute_s"] = d["engine_kv_tokens"] / prefill_tokens_s
    d["kv_recompute_share"] = d["kv_recompute_s"] / step

    # Per version with today's code: the trainer waits for rank 0's serial work, the engines
    # recompute their KV once per version; and how many versions one answer spans.
    d["trainer_version_s"] = (
        d["training_s"] + d["gather_wire_s"] + d["cast_s"] + d["rank0_take_s"] + d["rank0_encode_s"]
        + d["rank_decode_s"]
    )  # fmt: skip
    d["engine_version_s"] = d["generation_s"] + d["kv_recompute_s"]
    # A request gets one token per decode step of a full engine; a version's decoding lasts
    # `generation_s`, so an answer's first and last tokens lie this many versions apart.
    d["answer_decode_s"] = s.answer_tokens * d["engine_step_s"]
    d["answer_versions"] = d["answer_decode_s"] / d["generation_s"]
    return d


# ---------------------------------------------------------------------------------- measuring


def group_id(i: int) -> str:
    """A group id as the rollout's intake makes them (`j` + 20 hex digits, `-`, the index)."""
    return f"j{i:020x}-{i:06d}"


def make_group(rng: np.random.Generator, s: Scenario, gid: str) -> Group:
    """A scored group of G × T tokens with text of `chars_per_token` per token."""
    n, t = s.group_size, s.answer_tokens
    letters = np.frombuffer(string.ascii_lowercase.encode(), dtype=np.uint8)
    text_len = int(t * s.chars_per_token)
    return Group.build(
        group_id=gid,
        job_id="capacity",
        prompt_tokens=rng.integers(0, 150_000, s.prompt_tokens, dtype=np.int32),
        reward_spec={"verifier": "math", "answer": "42"},
        samples=Samples(
            lengths=[t] * n,
            completion_ids=rng.integers(0, 150_000, n * t, dtype=np.int32),
            behavior_logprobs=-rng.random(n * t, dtype=np.float32),
            versions=np.full(n * t, 7, dtype=np.int32),
            prompt_id=["p"] * n,
            finish_reason=["length"] * n,
            truncated=[True] * n,
            text=[rng.choice(letters, text_len).tobytes().decode() for _ in range(n)],
            reward=[1.0] * n,
            reward_status=[RewardStatus.scored] * n,
            reward_details=[{"extracted": "42"}] * n,
            submitted=[1.0] * n,
            first_token=[2.0] * n,
            finished=[3.0] * n,
            scored=[4.0] * n,
        ),
        submit_version=7,
    )


def per_call(fn, items, rounds: int) -> float:
    """Median over rounds of the seconds per item of `fn(item)` for every item."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for item in items:
            fn(item)
        times.append((time.perf_counter() - t0) / len(items))
    return statistics.median(times)


def rollout_seconds(rng: np.random.Generator, s: Scenario, rounds: int) -> float:
    """Seconds of one core per group for what the rollout does with a group's answers: parse the
    `/generate` batch, gather the columns as `Scheduler._score` does, build, encode."""
    from asyncrl.services.rollout.clients.engine import _parse_generations  # the client's own parser

    n, t = s.group_size, s.answer_tokens
    answers = [
        {
            "text": "x" * int(t * s.chars_per_token),
            "output_ids": ids,
            "meta_info": {
                "id": f"r{i}",
                "finish_reason": {"type": "length", "length": t},
                "prompt_tokens": s.prompt_tokens,
                "completion_tokens": t,
                "weight_version": "7",
                "output_token_logprobs": [[-float(lp), tok, None] for lp, tok in zip(rng.random(t), ids)],
            },
        }
        for i, ids in enumerate(rng.integers(0, 150_000, (n, t)).tolist())
    ]
    body = httpx.Response(200, content=msgspec.json.encode(answers))
    prompt = rng.integers(0, 150_000, s.prompt_tokens, dtype=np.int32)

    def one(_):
        gens = _parse_generations(body, n)
        samples = Samples(
            lengths=[len(g.output_ids) for g in gens],
            completion_ids=[x for g in gens for x in g.output_ids],
            behavior_logprobs=[x for g in gens for x in g.logprobs],
            versions=[int(g.weight_version) for g in gens for _ in g.output_ids],
            prompt_id=["p"] * n,
            finish_reason=[g.finish_reason for g in gens],
            truncated=[True] * n,
            text=[g.text for g in gens],
            reward=[1.0] * n,
            reward_status=[RewardStatus.scored] * n,
            reward_details=[{}] * n,
            submitted=[1.0] * n,
            first_token=[2.0] * n,
            finished=[3.0] * n,
            scored=[4.0] * n,
        )
        group = Group.build(group_id="g", job_id="j", prompt_tokens=prompt, reward_spec={"verifier": "math"},
                            samples=samples, submit_version=7)  # fmt: skip
        encode(group)

    return per_call(one, range(2), rounds)


def run_bytes(r: redis.Redis, run: str) -> int:
    """Redis's own accounting (`MEMORY USAGE`, every field) of every key of a run."""
    return sum(
        r.memory_usage(k, samples=0) or 0 for k in r.scan_iter(match=f"asyncrl:{{{run}}}:*", count=1000)
    )


def redis_figures(groups: list[Group], residue_groups: list[Group], rounds: int) -> dict[str, float]:
    """Memory, commands, server CPU and one client's rates of put / take + ack on a private
    redis-server (AOF, appendfsync always). What a group leaves behind after its ack is measured
    apart, with many one-token groups: Redis stores a hash of more than 128 fields as a hash
    table, as a long run's `groups:state` is."""
    n = len(groups)
    payload = sum(len(encode(g)) for g in groups)
    out: dict[str, list[float]] = {k: [] for k in ("stored", "payload", "info", "us", "calls", "put", "take")}
    with tempfile.TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp) / "redis", fsync="always").start()
        r = redis.Redis.from_url(server.url)

        def used() -> int:  # INFO's used memory less the clients' buffers and the AOF buffer
            info = r.info("memory")
            return info["used_memory"] - info["mem_clients_normal"] - info["mem_aof_buffer"]

        def cpu_and_calls() -> tuple[float, int]:
            cpu = r.info("cpu")
            main = cpu.get("used_cpu_sys_main_thread", cpu["used_cpu_sys"]) + cpu.get(
                "used_cpu_user_main_thread", cpu["used_cpu_user"]
            )
            stats = r.info("commandstats")
            return main, sum(v["calls"] for k, v in stats.items() if k.removeprefix("cmdstat_") not in PROBES)

        try:
            for rnd in range(rounds + 1):  # round 0 warms up and is not counted
                run = f"cap{rnd}"
                buf = Groups(Buffer(server.url, run), "capacity")
                before = used()
                r.config_resetstat()
                cpu0, calls0 = cpu_and_calls()
                t0 = time.perf_counter()
                for i in range(0, n, PUT_BATCH):
                    buf.put(groups[i : i + PUT_BATCH])
                t_put = time.perf_counter() - t0
                cpu_put, calls_put = cpu_and_calls()  # (the reads below are not counted)
                info = used() - before
                stored = run_bytes(r, run)
                payloads = sum(r.memory_usage(buf.buf.payload_key(g.group_id), samples=0) for g in groups)
                cpu1, calls1 = cpu_and_calls()
                t1 = time.perf_counter()
                taken = buf.take(n, current_version=7, max_staleness=0, block_ms=1000)
                buf.ack([g.group_id for g in taken.groups])
                t_take = time.perf_counter() - t1
                if len(taken.groups) != n:
                    raise RuntimeError(f"took {len(taken.groups)} of {n} groups")
                cpu2, calls = cpu_and_calls()
                buf.buf.close()
                if rnd == 0:
                    continue
                out["stored"].append(stored / n)
                out["payload"].append(payloads / n)
                out["info"].append(info / n)
                out["us"].append(((cpu_put - cpu0) + (cpu2 - cpu1)) * 1e6 / n)
                out["calls"].append((calls_put - calls0 + calls - calls1) / n)
                out["put"].append(payload / t_put)
                out["take"].append(payload / t_take)
            # One-token groups: the metadata's share of the work and what stays after the ack.
            buf = Groups(Buffer(server.url, "residue"), "capacity")
            cpu0, _ = cpu_and_calls()
            for i in range(0, len(residue_groups), PUT_BATCH):
                buf.put(residue_groups[i : i + PUT_BATCH])
            taken = buf.take(len(residue_groups), current_version=7, max_staleness=0, block_ms=1000)
            buf.ack([g.group_id for g in taken.groups])
            cpu1, _ = cpu_and_calls()
            if len(taken.groups) != len(residue_groups):
                raise RuntimeError(f"took {len(taken.groups)} of {len(residue_groups)} groups")
            meta_us = (cpu1 - cpu0) * 1e6 / len(residue_groups)
            residue = run_bytes(r, "residue") / len(residue_groups)
            buf.buf.close()
        finally:
            r.close()
            server.stop()
    return {k: statistics.median(v) for k, v in out.items()} | {"residue": residue, "meta_us": meta_us}


def cast_bytes_s(rounds: int) -> float:
    """fp32 bytes/s cast to bf16 on one thread, into fresh memory as a publish does (each output
    over glibc's mmap threshold, as a 32B model's tensors are: first-touch page faults count)."""
    import torch

    state = [torch.randn(24 * 1024 * 1024) for _ in range(4)]  # 4 × 96 MiB of fp32
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        cast = [t.to(torch.bfloat16) for t in state]
        times.append(time.perf_counter() - t0)
        del cast
    return sum(t.numel() * 4 for t in state) / statistics.median(times)


def delta_s_per_byte(rng: np.random.Generator, rounds: int) -> float:
    """compute_delta as `DiskPublisher` calls it (blocks of one element) on 64 MiB of bf16 in
    8 tensors, CHANGED_FRACTION of the elements moved by one ulp."""
    import torch

    from asyncrl.services.transport.weights.delta import compute_delta

    prev = {f"layer{i}.weight": torch.randn(4 * 1024 * 1024).to(torch.bfloat16) for i in range(8)}
    new = {}
    for name, t in prev.items():
        bits = t.clone().view(torch.int16)
        moved = torch.from_numpy(rng.random(t.numel()) < CHANGED_FRACTION)
        bits[moved] += 1
        new[name] = bits.view(torch.bfloat16)
    full = sum(t.numel() * t.element_size() for t in prev.values())
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        delta = compute_delta(prev, new, granularity="block", block_elems=1, max_bytes=full // 2)
        times.append(time.perf_counter() - t0)
        if delta is None:
            raise RuntimeError("the delta was refused as too large")
    return statistics.median(times) / full


def measure(s: Scenario, groups_n: int, rounds: int) -> tuple[Measured, dict[str, float]]:
    """The per-unit figures, and the split of one group's bytes (for the printout)."""
    import torch

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    groups = [make_group(rng, s, group_id(i)) for i in range(groups_n)]
    tiny = dataclasses.replace(s, group_size=1, answer_tokens=1, prompt_tokens=1)
    residue_groups = [make_group(rng, tiny, group_id(i)) for i in range(RESIDUE_GROUPS)]
    data = [encode(g) for g in groups]
    tokens = s.group_size * s.answer_tokens
    split = {
        "token columns (ids, logprobs, versions)": tokens * 12,
        "text": sum(len(t) for t in groups[0].samples.text),
        "prompt tokens": s.prompt_tokens * 4,
    }
    split["the rest (msgpack framing, other fields)"] = len(data[0]) - sum(split.values())
    rf = redis_figures(groups, residue_groups, rounds)
    m = Measured(
        group_bytes=statistics.mean(len(b) for b in data),
        redis_bytes_per_group=rf["stored"],
        redis_residue_per_group=rf["residue"],
        redis_us_per_group=rf["us"],
        redis_meta_us_per_group=rf["meta_us"],
        commands_per_group=rf["calls"],
        put_bytes_s=rf["put"],
        take_bytes_s=rf["take"],
        encode_s_per_group=per_call(encode, groups, rounds),
        decode_s_per_group=per_call(lambda b: decode(b, Group), data, rounds),
        rollout_s_per_group=rollout_seconds(rng, s, rounds),
        cast_bytes_s=cast_bytes_s(rounds),
        delta_s_per_byte=delta_s_per_byte(rng, rounds),
    )
    split["Redis: MEMORY USAGE of the payload"] = rf["payload"]
    split["Redis: INFO used_memory delta per stored group"] = rf["info"]
    return m, split


def figure(value: float) -> str:
    """Whole units from 100 up (bytes exact), four significant digits below."""
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=16, help="groups through Redis per round")
    ap.add_argument("--rounds", type=int, default=5, help="measured rounds (medians)")
    ap.add_argument("--doc", action="store_true", help="derive from DOC_MEASURED, measure nothing")
    args = ap.parse_args()
    s, a = Scenario(), Anchors()
    t0 = time.perf_counter()
    if args.doc:
        m = DOC_MEASURED
        print("# per-unit figures recorded in docs/scaling.md (DOC_MEASURED)")
    else:
        m, split = measure(s, args.groups, args.rounds)
        print(f"# measured here ({args.groups} groups of {s.group_size} x {s.answer_tokens} tokens, "
              f"median of {args.rounds} rounds, one thread)")  # fmt: skip
        for name, value in split.items():
            print(f"group bytes: {name:48} {value:>12,.0f}")
    for f in dataclasses.fields(m):
        print(f"{f.name:28} {figure(getattr(m, f.name)):>20}")
    print(f"\n# derived for {s}\n# anchors {a}")
    for name, value in capacity(s, a, m).items():
        print(f"{name:28} {figure(value):>20}")
    print(f"\n({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
