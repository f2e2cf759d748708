"""Delta weight publishing against full publishing, paired version by version: bytes per
version and publish → engine-serving seconds.

The trainer side holds fp32 master weights (tied weights once) and moves them each version by
an Adam-sized step: `lr * sign(N(0, 1))` per element (Adam's update is ~lr per element), then
publishes them in the publish dtype through two `DiskPublisher`s over the same state: one full
(`delta=False`, today's path) and one with deltas (`delta=True`, a full anchor every
`--anchor-every`). Each arm has its own reference engine (`asyncrl engine` process, CPU, fp32,
1 torch thread) that loads every version with `/update_weights_from_disk`; per version the two
arms run one after the other, alternating which goes first. "total s" = publish write + the
engine's update call, until it serves the version. At the end the delta engine is moved two
versions ahead (a missed delta): the resync's seconds and the engines' resync counters are shown.

    .venv/bin/python benchmarks/publish_delta.py [--model runs/models/smollm2 | --tiny]
        [--dtypes bfloat16 float32] [--versions 8] [--granularity block] [--block-elems 1]
        [--anchor-every 10] [--lr 1e-6] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from publish_real import ENGINE_TOKEN, UPDATE_TIMEOUT_S, load_state, start_engine_process, update_engine


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "runs" / "models" / "smollm2"), help="HF model directory")
    p.add_argument("--tiny", action="store_true", help="a tiny random model (services/ops/tinymodel.py)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=["bfloat16", "float32"])
    p.add_argument("--versions", type=int, default=8, help="timed versions per dtype, after 1 anchor")
    p.add_argument("--granularity", choices=["tensor", "block"], default="block")
    p.add_argument("--block-elems", type=int, default=1)
    p.add_argument("--anchor-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-6, help="per-element step of the master weights")
    p.add_argument("--json", help="write the figures here")
    return p.parse_args(argv)


def metric(http, url: str, sample: str) -> float:
    for line in http.get(f"{url}/metrics").text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    return 0.0


def timed_arm(pub, state, version: int, url: str, http) -> dict:
    t0 = time.perf_counter()
    out = pub.write(version, state)
    t1 = time.perf_counter()
    update_engine(http, url, out.path, version)
    t2 = time.perf_counter()
    return {"bytes": out.nbytes, "publish_s": t1 - t0, "engine_s": t2 - t1, "total_s": t2 - t0}


def run_dtype(args, master, dtype_name: str, root: Path, urls: dict, http) -> dict:
    import torch

    from asyncrl.trainer.publish import DiskPublisher, cast_state

    dtype = getattr(torch, dtype_name)
    pubs = {
        "full": DiskPublisher(root / f"{dtype_name}-full", args.model, keep=3),
        "delta": DiskPublisher(
            root / f"{dtype_name}-delta",
            args.model,
            keep=3,
            delta=True,
            anchor_every=args.anchor_every,
            granularity=args.granularity,
            block_elems=args.block_elems,
        ),
    }
    g = torch.Generator().manual_seed(0)
    master = {k: v.clone() for k, v in master.items()}
    rows = []
    for version in range(1, args.versions + 2):
        if version > 1:
            for t in master.values():
                t.add_(torch.randn(t.shape, generator=g).sign_().mul_(args.lr))
        # a fresh copy per version, as the trainer's detach_from makes: a cast to the same
        # dtype returns the master tensors themselves, which the next step changes in place
        state = {k: v.clone() for k, v in cast_state(master, dtype).items()}
        arms = ["full", "delta"] if version % 2 else ["delta", "full"]
        row = {arm: timed_arm(pubs[arm], state, version, urls[arm], http) for arm in arms}
        changed = row["delta"]["bytes"]
        print(f"[{dtype_name} v{version}] full {row['full']['total_s']:.3f}s {row['full']['bytes'] / 1e6:.1f} MB | "
              f"delta {row['delta']['total_s']:.3f}s {changed / 1e6:.2f} MB | load {os.getloadavg()[0]:.2f}",
              flush=True)  # fmt: skip
        if version > 1:  # version 1 is every chain's first anchor
            rows.append(row)
    # a missed delta: the delta engine is moved two versions ahead, so it resyncs from the anchor
    resync_before = metric(http, urls["delta"], 'asyncrl_engine_weight_resyncs_total{reason="base"}')
    for _ in range(2):
        for t in master.values():
            t.add_(torch.randn(t.shape, generator=g).sign_().mul_(args.lr))
        version += 1
        out = pubs["delta"].write(version, {k: v.clone() for k, v in cast_state(master, dtype).items()})
    t0 = time.perf_counter()
    update_engine(http, urls["delta"], out.path, version)
    resync_s = time.perf_counter() - t0
    resyncs = (
        metric(http, urls["delta"], 'asyncrl_engine_weight_resyncs_total{reason="base"}') - resync_before
    )
    # the full engine back onto the same version, so both arms start the next dtype in step
    update_engine(http, urls["full"], pubs["full"].write(version, cast_state(master, dtype)).path, version)

    def med(arm: str, key: str) -> float:
        return statistics.median(r[arm][key] for r in rows)

    summary = {arm: {k: med(arm, k) for k in ("bytes", "publish_s", "engine_s", "total_s")} for arm in pubs}
    ratios = [r["delta"]["total_s"] / r["full"]["total_s"] for r in rows]
    return {
        "median": summary,
        "ratio_total_median": statistics.median(ratios),
        "ratios": ratios,
        "resync_s": resync_s,
        "resyncs_counted": resyncs,
        "per_version": rows,
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx
    import torch

    torch.set_num_threads(1)
    runs = ROOT / "runs"
    runs.mkdir(exist_ok=True)
    tiny_tmp = None
    if args.tiny:
        from asyncrl.services.ops.tinymodel import build_tiny_model

        tiny_tmp = tempfile.TemporaryDirectory(prefix="delta-tiny-", dir=runs)
        build_tiny_model(tiny_tmp.name, seed=0)
        args.model = tiny_tmp.name
    master = load_state(args.model)
    nparams = sum(t.numel() for t in master.values())
    tmp = tempfile.TemporaryDirectory(prefix="publish-delta-", dir=runs)
    root = Path(tmp.name)
    procs, urls = [], {}
    load_start = os.getloadavg()
    try:
        for arm in ("full", "delta"):
            proc, urls[arm] = start_engine_process(args.model, str(root))
            procs.append(proc)
        http = httpx.Client(timeout=UPDATE_TIMEOUT_S, headers={"Authorization": f"Bearer {ENGINE_TOKEN}"})
        results = {d: run_dtype(args, master, d, root, urls, http) for d in args.dtypes}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        tmp.cleanup()
        if tiny_tmp is not None:
            tiny_tmp.cleanup()
    load = os.getloadavg()
    print(f"\nmodel {'tiny' if args.tiny else args.model}: {nparams / 1e6:.2f}M parameters, lr {args.lr:g} "
          f"(sign steps), {args.granularity} granularity"
          f"{f' ({args.block_elems} elements per block)' if args.granularity == 'block' else ''}, anchor every "
          f"{args.anchor_every}; median of {args.versions} versions; load average {load_start[0]:.2f} at the "
          f"start, {load[0]:.2f} at the end, on {os.cpu_count()} cores")  # fmt: skip
    print(
        "| dtype | full MB/version | delta MB/version | bytes delta/full | full publish→serving s "
        "| delta publish→serving s | paired ratio delta/full (median) | resync after a missed delta s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for d, r in results.items():
        f, dl = r["median"]["full"], r["median"]["delta"]
        print(f"| {d} | {f['bytes'] / 1e6:.2f} | {dl['bytes'] / 1e6:.3f} | {dl['bytes'] / f['bytes']:.3f} | "
              f"{f['total_s']:.3f} | {dl['total_s']:.3f} | {r['ratio_total_median']:.2f} | "
              f"{r['resync_s']:.3f} ({r['resyncs_counted']:.0f} counted) |")  # fmt: skip
    for d, r in results.items():
        print(f"{d} paired ratios: " + " ".join(f"{x:.2f}" for x in r["ratios"]))
        print(
            f"{d} medians: "
            + json.dumps({a: {k: round(v, 4) for k, v in m.items()} for a, m in r["median"].items()})
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "parameters": nparams, "args": vars(args),
                                               "results": results}, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
