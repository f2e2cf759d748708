"""Delta weight sync over the broadcast path against full broadcasts, paired version by version:
bytes per version and publish → engine-serving seconds (benchmarks/publish_delta.py is the disk
path's).

The trainer side holds fp32 master weights (tied weights once) and moves them each version by
an Adam-sized step: `lr * sign(N(0, 1))` per element (Adam's update is ~lr per element), of
every tensor, or with `--train-last-layers K` only of the last K decoder layers and the final
norm (a partial fine-tune: the rest frozen). Each version is published in the publish dtype by
two `BroadcastPublisher`s over gloo, each the rank 0 of its own group with its own reference
engine (`asyncrl engine` process, CPU, fp32, 1 torch thread): one full (`delta=False`) and one
with deltas (`delta=True`: the changed tensors only, a full anchor every `--anchor-every`).
Per version the two arms run one after the other, alternating which goes first. "publish→serving
s" is `publish()`: the compare (delta arm), pause, session, every bucket announced, broadcast
and applied, continue: the engine serves the version when it returns. After each dtype both
engines answer the same greedy probe with logprobs, which must be identical; then the delta
engine is moved off the chain (a disk load of the source weights, as a missed version leaves
it) and sent the next version as a delta: its 409, the full version that follows, and both
sides' counters are shown.

    .venv/bin/python benchmarks/publish_delta_broadcast.py [--model runs/models/smollm2 | --tiny]
        [--dtypes bfloat16 float32] [--versions 6] [--train-last-layers 0] [--anchor-every 10]
        [--lr 1e-6] [--bucket-mb 256] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from publish_delta import metric
from publish_real import ENGINE_TOKEN, UPDATE_TIMEOUT_S, load_state, start_engine_process

PROBE = {"input_ids": [[1, 5, 6, 7], [1, 9, 9]], "return_logprob": True,
         "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}}  # fmt: skip


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "runs" / "models" / "smollm2"), help="HF model directory")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (services/ops/tinymodel.py)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--versions", type=int, default=6, help="timed versions per dtype, after 1 anchor")
    p.add_argument("--train-last-layers", type=int, default=0, help="move only the last K layers (0: all)")
    p.add_argument("--anchor-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-6, help="per-element step of the master weights")
    p.add_argument("--bucket-mb", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="seed of the steps")
    p.add_argument("--json", help="write the figures here")
    return p.parse_args(argv)


def trained(master: dict, last_layers: int) -> list[str]:
    """The tensors a version moves: every one, or those of the last `last_layers` layers and the
    final norm."""
    if not last_layers:
        return list(master)
    layers = sorted({int(m[1]) for n in master if (m := re.match(r"model\.layers\.(\d+)\.", n))})
    keep = {str(i) for i in layers[-last_layers:]}
    return [n for n in master if (m := re.match(r"model\.layers\.(\d+)\.", n)) and m[1] in keep] + [
        n for n in master if n.startswith("model.norm.")
    ]


def served(http, url: str) -> str:
    return http.get(f"{url}/get_model_info").json()["weight_version"]


def run_dtype(args, master, dtype_name: str, pubs: dict, urls: dict, http, first: int) -> tuple[dict, int]:
    import torch
    from prometheus_client import REGISTRY

    from asyncrl.trainer.publish import cast_state

    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(args.seed)
    master = {k: v.clone() for k, v in master.items()}
    moving = trained(master, args.train_last_layers)

    def step() -> dict:
        for name in moving:
            t = master[name]
            t.add_(torch.randn(t.shape, generator=g).sign_().mul_(args.lr))
        # a fresh copy per version, as the trainer's detach_from makes
        return {k: v.clone() for k, v in cast_state(master, dtype).items()}

    chain, compares = pubs["delta"].chain, []
    compare = chain.delta

    def timed_compare(*args_, **kwargs):  # the delta arm's compare and sha256, inside its publish
        t0 = time.perf_counter()
        try:
            return compare(*args_, **kwargs)
        finally:
            compares.append(time.perf_counter() - t0)

    chain.delta = timed_compare
    rows = []
    version = first
    state = {k: v.clone() for k, v in cast_state(master, dtype).items()}
    for i in range(args.versions + 1):
        if i:
            state = step()
        arms = ["full", "delta"] if version % 2 else ["delta", "full"]
        row = {}
        for arm in arms:
            t0 = time.perf_counter()
            out = pubs[arm].publish(version, state)
            row[arm] = {"bytes": out.nbytes, "total_s": time.perf_counter() - t0, "as_delta": out.delta}
            if arm == "delta":
                row[arm]["compare_s"] = compares[-1]
            assert served(http, urls[arm]) == str(version)
        print(f"[{dtype_name} v{version}] full {row['full']['total_s']:.3f}s {row['full']['bytes'] / 1e6:.1f} MB | "
              f"delta {row['delta']['total_s']:.3f}s {row['delta']['bytes'] / 1e6:.2f} MB"
              f"{'' if row['delta']['as_delta'] else ' (anchor)'} | load {os.getloadavg()[0]:.2f}", flush=True)  # fmt: skip
        if i:  # the first version of a dtype is every chain's anchor
            rows.append(row)
        version += 1
    answers = {}
    for arm in urls:
        resp = http.post(f"{urls[arm]}/generate", json=PROBE)
        resp.raise_for_status()
        answers[arm] = resp.json()
    same = [(a["output_ids"], a["meta_info"]["output_token_logprobs"]) for a in answers["full"]] == [
        (a["output_ids"], a["meta_info"]["output_token_logprobs"]) for a in answers["delta"]
    ]
    if not same:
        raise AssertionError(f"{dtype_name}: the delta engine answers differently from the full one")
    # a missed version: the delta engine reloads the source weights from disk, then gets a delta
    resp = http.post(
        f"{urls['delta']}/update_weights_from_disk", json={"model_path": args.model, "weight_version": "off"}
    )
    resp.raise_for_status()
    before = {
        "engine_base": metric(http, urls["delta"], 'asyncrl_engine_weight_resyncs_total{reason="base"}'),
        "trainer_refused": REGISTRY.get_sample_value("asyncrl_trainer_weight_resyncs_total", {"reason": "refused"}) or 0.0,
    }  # fmt: skip
    state = step()
    t0 = time.perf_counter()
    out = pubs["delta"].publish(version, state)
    resync_s = time.perf_counter() - t0
    resynced = {
        "engine_base": metric(http, urls["delta"], 'asyncrl_engine_weight_resyncs_total{reason="base"}'),
        "trainer_refused": REGISTRY.get_sample_value("asyncrl_trainer_weight_resyncs_total", {"reason": "refused"}) or 0.0,
    }  # fmt: skip
    pubs["full"].publish(version, state)  # both arms in step for the next dtype
    assert served(http, urls["delta"]) == served(http, urls["full"]) == str(version)

    def med(arm: str, key: str) -> float:
        return statistics.median(r[arm][key] for r in rows)

    ratios = [r["delta"]["total_s"] / r["full"]["total_s"] for r in rows]
    chain.delta = compare
    return {
        "compare_s_median": statistics.median(r["delta"]["compare_s"] for r in rows),
        "median": {arm: {k: med(arm, k) for k in ("bytes", "total_s")} for arm in pubs},
        "deltas_sent": sum(r["delta"]["as_delta"] for r in rows),
        "ratio_total_median": statistics.median(ratios),
        "ratios": ratios,
        "delta_bytes": [r["delta"]["bytes"] for r in rows],
        "missed": {
            "seconds": resync_s,
            "sent_as_delta": out.delta,
            "counted": {k: resynced[k] - before[k] for k in before},
        },
        "same_answers": same,
        "per_version": rows,
    }, version + 1


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx
    import torch

    from asyncrl.buffer.server import free_port
    from asyncrl.trainer.publish import BroadcastPublisher

    torch.set_num_threads(1)
    runs = ROOT / "runs"
    runs.mkdir(exist_ok=True)
    tiny_tmp = None
    if args.tiny:
        from asyncrl.services.ops.tinymodel import build_tiny_model

        tiny_tmp = tempfile.TemporaryDirectory(prefix="delta-tiny-", dir=runs)
        build_tiny_model(tiny_tmp.name, seed=0)
        args.model = tiny_tmp.name
    args.model = str(Path(args.model).resolve())
    master = load_state(args.model)
    nparams = sum(t.numel() for t in master.values())
    moving = sum(master[n].numel() for n in trained(master, args.train_last_layers))
    procs, urls, pubs = [], {}, {}
    load_start = os.getloadavg()
    try:
        for arm in ("full", "delta"):
            proc, urls[arm] = start_engine_process(args.model, str(runs))
            procs.append(proc)
            pubs[arm] = BroadcastPublisher(
                [urls[arm]], "127.0.0.1", free_port(), "gloo", args.bucket_mb << 20,
                group_name=f"bench-{arm}", timeout_s=UPDATE_TIMEOUT_S, api_token=ENGINE_TOKEN,
                delta=arm == "delta", anchor_every=args.anchor_every,
            )  # fmt: skip
        http = httpx.Client(timeout=UPDATE_TIMEOUT_S, headers={"Authorization": f"Bearer {ENGINE_TOKEN}"})
        results, version = {}, 1
        for d in args.dtypes:
            results[d], version = run_dtype(args, master, d, pubs, urls, http, version)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        if tiny_tmp is not None:
            tiny_tmp.cleanup()
    load = os.getloadavg()
    print(f"\nmodel {'tiny' if args.tiny else args.model}: {nparams / 1e6:.2f}M parameters, "
          f"{'all' if not args.train_last_layers else f'the last {args.train_last_layers} layers'} moving "
          f"({moving / nparams:.1%}), lr {args.lr:g} (sign steps, seed {args.seed}), anchor every {args.anchor_every}, "
          f"buckets {args.bucket_mb} MiB, gloo; median of {args.versions} versions; load average "
          f"{load_start[0]:.2f} at the start, {load[0]:.2f} at the end, on {os.cpu_count()} cores")  # fmt: skip
    print(
        "| dtype | full MB/version | delta MB/version | bytes delta/full | versions sent as deltas "
        "| full publish→serving s | delta publish→serving s | paired ratio delta/full (median, range) "
        "| of which compare + sha256 s | missed version: delta refused → full s (counted) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for d, r in results.items():
        f, dl = r["median"]["full"], r["median"]["delta"]
        m = r["missed"]
        missed = (
            "(sent as a delta?)" if m["sent_as_delta"]
            else f"{m['seconds']:.3f} (engine {m['counted']['engine_base']:.0f}, trainer {m['counted']['trainer_refused']:.0f})"
        )  # fmt: skip
        print(f"| {d} | {f['bytes'] / 1e6:.2f} | {dl['bytes'] / 1e6:.2f} | {dl['bytes'] / f['bytes']:.3f} | "
              f"{r['deltas_sent']}/{len(r['ratios'])} | {f['total_s']:.3f} | {dl['total_s']:.3f} | "
              f"{r['ratio_total_median']:.2f} ({min(r['ratios']):.2f}-{max(r['ratios']):.2f}) | "
              f"{r['compare_s_median']:.3f} | {missed} |")  # fmt: skip
    for d, r in results.items():
        print(f"{d} paired ratios: " + " ".join(f"{x:.2f}" for x in r["ratios"]))
        print(f"{d} delta bytes per version: " + " ".join(f"{b / 1e6:.2f}" for b in r["delta_bytes"]))
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "parameters": nparams, "args": vars(args),
                                               "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
