"""Reference engine throughput vs `transformers.generate` on the same model, same run.

The engine runs as its own process (`asyncrl engine`, 1 torch thread) and is driven over HTTP
with B concurrent `/generate` requests (input_ids, sampling at temperature 1, ignore_eos,
fixed max_new_tokens, return_logprob) sent as one burst on fresh connections, so its figure
includes HTTP, JSON, scheduling and per-token logprobs.
The baseline is one `model.generate` call on a [B, prompt_len] batch with the same sampling
(do_sample, temperature 1, top_k 0, min_new_tokens = max_new_tokens), 1 torch thread, in
this process. A third column drives the engine's scheduler and model runner directly in this
process (no HTTP, no second process) to separate the batching engine from the serving stack.
All count generated tokens / wall seconds; the ratios are engine / generate.

    .venv/bin/python benchmarks/engine_throughput.py [--batches 1 8 32] [--new-tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(
    0, str(ROOT / "tests")
)  # the in-thread test servers: tests/engine_server.py, rollout_server.py


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5, help="best of N per measurement (interleaved)")
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--model", help="an existing HF model directory instead of a tiny one")
    return p.parse_args(argv)


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    return [[1] + [3 + (7 * b + 3 * i) % (vocab - 3) for i in range(length - 1)] for b in range(batch)]


async def engine_run(url: str, batch: int, args, vocab: int) -> tuple[float, int]:
    """A burst of B concurrent requests (fresh connections, so they reach the engine together)."""
    import httpx

    params = {"max_new_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True}
    bodies = [
        {"input_ids": p, "sampling_params": {**params, "sampling_seed": i}, "return_logprob": True}
        for i, p in enumerate(prompts(batch, args.prompt_len, vocab))
    ]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        start = time.perf_counter()
        outs = await asyncio.gather(*(client.post("/generate", json=body) for body in bodies))
        elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.json()["output_ids"]) for o in outs)


def generate_run(model, batch: int, args, vocab: int) -> tuple[float, int]:
    import torch

    ids = torch.tensor(prompts(batch, args.prompt_len, vocab))
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            pad_token_id=0,
        )
    elapsed = time.perf_counter() - start
    return elapsed, (out.shape[1] - ids.shape[1]) * batch


def core_run(model_dir: str, batch: int, args, vocab: int) -> tuple[float, int]:
    """The engine's scheduler and model runner driven directly in this process (no HTTP)."""
    from asyncrl.services.engine.model_runner import ModelRunner
    from asyncrl.services.engine.sampling import RowSampling
    from asyncrl.services.engine.scheduler import Request, Scheduler

    global _RUNNER
    if _RUNNER is None:
        _RUNNER = ModelRunner(
            model_dir, slots=max(args.batches), context_length=None, device="cpu", dtype="float32"
        )
    sched = Scheduler(_RUNNER, max_running=max(args.batches), max_prefill_tokens=1 << 20, weight_version="0")
    for i, p in enumerate(prompts(batch, args.prompt_len, vocab)):
        sched.waiting.append(
            Request(
                rid=str(i),
                prompt_ids=p,
                max_new_tokens=args.new_tokens,
                stop_ids=frozenset(),
                sampling=RowSampling(1.0, 1.0, -1, 0.0),
                seed=i,
                on_finish=lambda r: None,
            )
        )
    start = time.perf_counter()
    while sched.running or sched.waiting:  # the scheduler loop's admit / prefill / decode, inline
        admitted = sched._admit()
        if admitted:
            sched._prefill(admitted)
        if sched.running:
            sched._decode()
    return time.perf_counter() - start, sched.stats["generated_tokens"]


_RUNNER = None


def start_engine(model_dir: str, max_running: int, *extra: str) -> tuple[subprocess.Popen, str]:
    import httpx
    from engine_server import free_port

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "asyncrl.services.ops.cli",
        "engine",
        "--model",
        model_dir,
        "--port",
        str(port),
        "--max-running-requests",
        str(max_running),
        "--num-threads",
        "1",
        "--log-level",
        "warning",
        *extra,
    ]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("engine did not start")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.services.ops.tinymodel import build_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or tmp
        if not args.model:
            build_tiny_model(
                tmp,
                hidden_size=args.hidden_size,
                num_layers=args.layers,
                intermediate_size=2 * args.hidden_size,
                max_position_embeddings=1024,
            )
        model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        vocab = model.config.vocab_size
        proc, url = start_engine(model_dir, max(args.batches))
        try:
            asyncio.run(engine_run(url, 2, args, vocab))  # warm-up
            generate_run(model, 2, args, vocab)
            rows = []
            for batch in args.batches:
                eng = core = ref = 0.0
                for _ in range(args.repeats):  # interleaved, so all see the same background load
                    seconds, tokens = asyncio.run(engine_run(url, batch, args, vocab))
                    eng = max(eng, tokens / seconds)
                    seconds, tokens = core_run(model_dir, batch, args, vocab)
                    core = max(core, tokens / seconds)
                    seconds, tokens = generate_run(model, batch, args, vocab)
                    ref = max(ref, tokens / seconds)
                rows.append((batch, eng, core, ref))
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.2f}M params (hidden {model.config.hidden_size}, {model.config.num_hidden_layers} layers), "
        f"prompt {args.prompt_len} tokens, {args.new_tokens} new tokens, 1 thread, best of {args.repeats}"
    )
    print(f"load average at the end: {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(
        "| batch | engine over HTTP tok/s | engine core (no HTTP) tok/s | transformers generate tok/s "
        "| ratio HTTP / generate | ratio core / generate |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for batch, eng, core, ref in rows:
        print(f"| {batch} | {eng:.0f} | {core:.0f} | {ref:.0f} | {eng / ref:.2f} | {core / ref:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
