"""Disk weight publish of a real model, trainer write → every engine serving the new version,
against the raw bound of writing and reading the same bytes on the same machine.

The trainer side holds the model's full state dict as fp32 CPU tensors (tied weights once,
as `trainer.model.full_state_dict` returns it). Each round, for each publish dtype:

* publish: `DiskPublisher.write(v, cast_state(state, dtype))`: the cast, the safetensors
  write, config/tokenizer files, fsyncs, the atomic rename and pruning (the cast is also
  shown on its own);
* engine load: `POST /update_weights_from_disk` (`abort_all_requests`, `flush_cache`, as the
  rollout service sends it) to every engine at once, until each reports `weight_version` v on
  `/get_model_info`;
* raw write: the same tensor bytes, concatenated beforehand, written to one file in the same
  directory with one `write` and one `fsync`;
* raw read: that file read into a preallocated buffer with one `readinto`, then copied into
  preallocated tensors of the same shapes in the engine's parameter dtype (float32 on CPU),
  which is the least an engine must do.

ratio = raw total / (publish + engine load), the target is >= 0.8; a second ratio leaves the
cast out (the bound has none to do). Raw and real alternate which goes first, round by round;
every column is the median of its own per-round values. Both read from the page cache (the
bytes were just written), as an engine on the trainer's machine does. The engines are
`asyncrl engine` processes on CPU in float32 with 1 torch thread (`--engine thread` serves one
inside this process, for profiling); this process runs like the trainer's rank 0: 1 torch
thread and `buffer.malloc_tuning.tune_malloc()` (its `Buffer` applies it). "publish s" is what a
trainer step blocks on: divide it by the step time (`--step-seconds`) for the step's share.

    .venv/bin/python benchmarks/publish_real.py [--model runs/models/smollm2] [--rounds 5]
        [--dtypes float32 bfloat16] [--engines 1] [--root DIR] [--json OUT] [--step-seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(
    0, str(ROOT / "tests")
)  # the in-thread test servers: tests/engine_server.py, rollout_server.py

ENGINE_START_TIMEOUT_S = 300.0  # loading a 135M model on a busy 2-core machine takes ~10 s
UPDATE_TIMEOUT_S = 600.0
ENGINE_TOKEN = secrets.token_urlsafe(32)  # the engines' control plane always needs one


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(ROOT / "runs" / "models" / "smollm2"), help="HF model directory")
    p.add_argument("--root", help="publish directory (default: a temp dir under runs/)")
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per dtype, after one warm-up")
    p.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"]
    )
    p.add_argument("--engines", type=int, default=1, help="engines updated together")
    p.add_argument("--engine", choices=["process", "thread"], default="process")
    p.add_argument("--keep", type=int, default=3, help="DiskPublisher keep")
    p.add_argument("--json", help="write the figures here")
    p.add_argument(
        "--step-seconds", type=float, help="a trainer step's seconds, to print the publish's share"
    )
    return p.parse_args(argv)


def load_state(model_dir: str) -> dict:
    """The trainer's view: every tensor its own fp32 CPU allocation, tied weights once."""
    import torch
    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        state.update({name: t.to(torch.float32).clone() for name, t in load_file(f).items()})
    state.pop("lm_head.weight", None)  # tied to the input embedding: published once
    return state


def start_engine_process(model_dir: str, weights_root: str) -> tuple[subprocess.Popen, str]:
    import httpx
    from engine_server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "asyncrl.services.ops.cli", "engine", "--model", model_dir, "--port", str(port),
           "--num-threads", "1", "--device", "cpu", "--dtype", "float32", "--log-level", "warning",
           "--weights-root", weights_root]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ASYNCRL_ENGINE_API_TOKEN": ENGINE_TOKEN}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ENGINE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("engine did not start")


def update_engine(http, url: str, path: str, version: int) -> None:
    body = {
        "model_path": path,
        "weight_version": str(version),
        "abort_all_requests": True,
        "flush_cache": True,
    }
    resp = http.post(f"{url}/update_weights_from_disk", json=body)
    if resp.status_code != 200 or not resp.json().get("success"):
        raise RuntimeError(f"{url}: HTTP {resp.status_code} {resp.text[:300]}")
    served = http.get(f"{url}/get_model_info").json()["weight_version"]
    if served != str(version):
        raise RuntimeError(f"{url} serves {served!r} after updating to {version}")


class RawBound:
    """Write `blob` with one write + fsync, read it back with one readinto, copy into `dst`."""

    def __init__(self, state: dict, engine_dtype, directory: Path):
        import torch

        flat = [t.contiguous().view(-1).view(torch.uint8) for t in state.values()]
        self.blob = torch.cat(flat)  # prepared outside the timing: the bytes the publisher writes
        self.buf = torch.empty_like(self.blob)
        self.views = []
        offset = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            self.views.append(self.buf[offset : offset + n].view(t.dtype).view(t.shape))
            offset += n
        self.dst = [torch.empty(t.shape, dtype=engine_dtype) for t in state.values()]
        self.path = directory / ".raw-bound.bin"

    @property
    def nbytes(self) -> int:
        return self.blob.numel()

    def write(self) -> float:
        t0 = time.perf_counter()
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            written = os.write(fd, memoryview(self.blob.numpy()))
            os.fsync(fd)
        finally:
            os.close(fd)
        assert written == self.nbytes, "short write"
        return time.perf_counter() - t0

    def read(self) -> float:
        t0 = time.perf_counter()
        with open(self.path, "rb", buffering=0) as f:
            got = f.readinto(memoryview(self.buf.numpy()))
        assert got == self.nbytes, "short read"
        for src, dst in zip(self.views, self.dst):
            dst.copy_(src)
        seconds = time.perf_counter() - t0
        self.path.unlink()
        return seconds


def run_round(pub, state, dtype: str, version: int, raw: RawBound, urls, http, pool, raw_first: bool) -> dict:
    """One publish → engines serving `version`, and the raw bound on the same bytes; which goes
    first alternates between rounds, so neither always meets the other's disk writeback."""
    import torch

    from asyncrl.trainer.publish import cast_state

    if raw_first:
        raw_write, raw_read = raw.write(), raw.read()
    t0 = time.perf_counter()
    cast = cast_state(state, getattr(torch, dtype))
    t1 = time.perf_counter()
    out = pub.write(version, cast)
    t2 = time.perf_counter()
    list(pool.map(lambda u: update_engine(http, u, out.path, version), urls))
    t3 = time.perf_counter()
    del cast
    if not raw_first:
        raw_write, raw_read = raw.write(), raw.read()
    total = t3 - t0
    return {
        "version": version,
        "raw_first": raw_first,
        "bytes": out.nbytes,
        "cast_s": t1 - t0,
        "publish_s": t2 - t0,
        "engine_load_s": t3 - t2,
        "total_s": total,
        "raw_write_s": raw_write,
        "raw_read_s": raw_read,
        "raw_total_s": raw_write + raw_read,
        "ratio": (raw_write + raw_read) / total,
        "ratio_io": (raw_write + raw_read) / (total - (t1 - t0)),
        "mb_per_s": out.nbytes / total / 1e6,
        "raw_mb_per_s": raw.nbytes / (raw_write + raw_read) / 1e6,
    }


def median_row(rounds: list[dict]) -> dict:
    keys = [
        k for k in rounds[0] if k.endswith("_s") or k in ("ratio", "ratio_io", "mb_per_s", "raw_mb_per_s")
    ]
    return {k: statistics.median(r[k] for r in rounds) for k in keys} | {"bytes": rounds[0]["bytes"]}


def main(argv=None) -> int:
    args = parse_args(argv)
    import httpx
    import torch

    from asyncrl.buffer.malloc_tuning import tune_malloc
    from asyncrl.trainer.publish import DiskPublisher, cast_state

    torch.set_num_threads(1)  # the engines run with 1 thread, the trainer with OMP_NUM_THREADS (1)
    tune_malloc()  # as in the trainer's rank 0, whose `Buffer` applies it: cast_state's allocations
    load_at_start = os.getloadavg()
    state = load_state(args.model)
    nparams = sum(t.numel() for t in state.values())
    runs = ROOT / "runs"
    runs.mkdir(exist_ok=True)
    tmp = None if args.root else tempfile.TemporaryDirectory(prefix="publish-real-", dir=runs)
    root = Path(args.root or tmp.name)
    procs, urls, threads = [], [], []
    try:
        for _ in range(args.engines):
            if args.engine == "process":
                proc, url = start_engine_process(args.model, str(root))
                procs.append(proc)
            else:
                from engine_server import serve_in_thread

                running = serve_in_thread(
                    args.model,
                    device="cpu",
                    dtype="float32",
                    log_level="warning",
                    api_token=ENGINE_TOKEN,
                    weights_root=str(root),
                )
                threads.append(running)
                url = running.url
            urls.append(url)
        engine_dtype = torch.float32  # the engines' parameters (CPU, float32: the "auto" on CPU)
        pub = DiskPublisher(root, args.model, keep=args.keep)
        http = httpx.Client(timeout=UPDATE_TIMEOUT_S, headers={"Authorization": f"Bearer {ENGINE_TOKEN}"})
        pool = ThreadPoolExecutor(max_workers=len(urls))
        raws = {d: RawBound(cast_state(state, getattr(torch, d)), engine_dtype, root) for d in args.dtypes}
        version = 0
        results: dict[str, list[dict]] = {d: [] for d in args.dtypes}
        for dtype in args.dtypes:  # warm-up: first touch of every path
            version += 1
            run_round(pub, state, dtype, version, raws[dtype], urls, http, pool, raw_first=False)
        for i in range(args.rounds):  # dtypes interleaved, so both see the same background load
            for dtype in args.dtypes:
                version += 1
                row = run_round(
                    pub, state, dtype, version, raws[dtype], urls, http, pool, raw_first=i % 2 == 1
                )
                results[dtype].append(row)
                print(f"[{dtype} v{version}] publish {row['publish_s']:.3f}s engine {row['engine_load_s']:.3f}s "
                      f"raw {row['raw_total_s']:.3f}s ratio {row['ratio']:.2f} load {os.getloadavg()[0]:.2f}",
                      flush=True)  # fmt: skip
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        for running in threads:
            running.stop()
        if tmp is not None:
            tmp.cleanup()
    load = os.getloadavg()
    summary = {d: median_row(rows) for d, rows in results.items()}
    print(f"\nmodel {args.model}: {nparams / 1e6:.1f}M parameters published (tied weights once), "
          f"{len(urls)} engine(s) ({args.engine}, 1 torch thread, fp32), median of {args.rounds} rounds "
          f"after 1 warm-up; load average {load_at_start[0]:.2f} at the start, {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} at the end, on {os.cpu_count()} cores")  # fmt: skip
    print("| dtype | MB | cast s | publish s (incl. cast) | engine load s | total s | raw write s | raw read s "
          "| raw total s | ratio raw/total | ratio raw/(total - cast) | MB/s | raw MB/s |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for dtype, m in summary.items():
        print(f"| {dtype} | {m['bytes'] / 1e6:.0f} | {m['cast_s']:.3f} | {m['publish_s']:.3f} | "
              f"{m['engine_load_s']:.3f} | {m['total_s']:.3f} | {m['raw_write_s']:.3f} | {m['raw_read_s']:.3f} | "
              f"{m['raw_total_s']:.3f} | {m['ratio']:.2f} | {m['ratio_io']:.2f} | {m['mb_per_s']:.0f} | "
              f"{m['raw_mb_per_s']:.0f} |")  # fmt: skip
    for dtype, rows in results.items():
        print(f"ratio {dtype} round by round: " + " ".join(f"{r['ratio']:.2f}" for r in rows))
    if args.step_seconds:
        for dtype, m in summary.items():
            print(f"share of a {args.step_seconds:g} s trainer step, {dtype}: publish (the trainer blocks on it) "
                  f"{m['publish_s'] / args.step_seconds:.1%}, publish → engines serving "
                  f"{m['total_s'] / args.step_seconds:.1%}")  # fmt: skip
    else:
        print("share of a trainer step: publish s (the trainer blocks on it) / step s; "
              "publish → engines serving: total s / step s (--step-seconds prints it)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "parameters": nparams, "engines": len(urls), "engine_mode": args.engine,
            "rounds": args.rounds, "step_seconds": args.step_seconds, "loadavg_start": load_at_start, "loadavg": load, "cpus": os.cpu_count(),
            "median": summary, "per_round": results,
        }, indent=2))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
