"""Continuous batching: one background thread owns the model and runs the loop

    take commands (new requests, aborts, control ops) → admit waiting requests into free slots
    → one batched prefill of the admitted → one batched decode step of every running request
    → finish the requests that hit a stop token, their length or an abort.

LoRA: a request may run with an adapter (`Request.adapter`, resolved by the engine before it is
submitted); a running batch holds at most `max_loras_per_batch` distinct adapters, the base
model counted as one, and a waiting request whose adapter would exceed that waits while later
ones that fit are admitted (SGLang's `can_schedule_lora_req`).

Control operations (weight updates, flush, pause) run on the same thread between two steps,
so a forward never sees a mix of weight versions. A weight update waits for the running
requests to drain (SGLang's behaviour: new requests wait, running ones finish) unless the
engine is paused or the update asks to abort them. When an update happens while requests are
frozen by `pause_generation(in_place)`, their KV (computed under the old weights) is dropped
and recomputed from their tokens on continue: old-weight KV is never reused.

Callers talk to the scheduler from any thread: `submit`, `abort`, `call` are thread-safe and
report back through callbacks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from asyncrl.services.engine import metrics
from asyncrl.services.engine.lora import LoraAdapter
from asyncrl.services.engine.model_runner import ForwardRow, ModelRunner
from asyncrl.services.engine.sampling import RowSampling, sample_next, uniforms_at
from asyncrl.services.runtime.cores import CoreShare

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # how long the loop blocks on its inbox when there is nothing to run
GAUGE_PERIOD_S = 0.1  # gauges are refreshed at most this often while busy, and whenever idle


@dataclass(eq=False)  # identity: `running.index` must not compare every field
class Request:
    rid: str
    prompt_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    sampling: RowSampling
    seed: int  # of the SplitMix64 stream its tokens are sampled with (sampling.py)
    on_finish: Callable[[Request], None]
    return_logprob: bool = False
    logprob_start_len: int = -1
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    finish_reason: dict[str, Any] | None = None
    weight_version: str = ""
    # (old version, output tokens so far) at each weight update it lived through: its tokens'
    # versions, reported as SGLang 0.5.23's `weight_versions` spans (`version_spans`).
    version_events: list[tuple[str, int]] = field(default_factory=list)
    kv_len: int = 0  # tokens of this request whose KV is in its slot
    cached_tokens: int = 0  # prompt tokens not computed for it (SGLang's meta_info field; see _prefill)
    submitted_at: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    finished_at: float | None = None
    # Stop strings (SGLang's `stop`): matched against the text of the last tokens after each one.
    stop_strs: tuple[str, ...] = ()
    detokenize: Callable[[list[int]], str] | None = None
    adapter: LoraAdapter | None = (
        None  # the LoRA adapter it runs with from start to end; None: the base model
    )

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


STOP_WINDOW_SLACK = 4  # tokens beyond a stop string's length: a token may be a partial character


def stop_string_matched(r: Request) -> str | None:
    """The stop string the last token completed, else None. Only the text of the last tokens is
    decoded (a stop string of n characters spans at most n tokens, plus a partial character's
    slack), and a match counts only when that token made it: without it, the text had none."""
    window = r.output_ids[-(max(map(len, r.stop_strs)) + STOP_WINDOW_SLACK) :]
    text = r.detokenize(window)
    found = [s for s in r.stop_strs if s in text]
    if not found:
        return None
    before = r.detokenize(window[:-1])
    new = [s for s in found if s not in before]
    return new[0] if new else None


def version_spans(r: Request) -> list[dict[str, Any]]:
    """`meta_info.weight_versions` of a finished request: `{"version", "start", "end"}` over
    its output tokens, one span per version in order (the shape of SGLang 0.5.23's
    `compute_weight_version_spans` + `add_weight_versions_to_meta_info`)."""
    n = len(r.output_ids)
    spans: list[dict[str, Any]] = []
    for version, end in [*r.version_events, (r.weight_version, n)]:
        end = min(end, n)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = end
        else:
            spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return spans


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_running: int,
        max_prefill_tokens: int,
        weight_version: str,
        continuous_decode_steps: int = 1,
        logit_noise_std: float = 0.0,
        seed: int = 0,
        cores: CoreShare | None = None,
        max_loras_per_batch: int | None = None,
    ):
        self.runner = runner
        # None: LoRA is off, and no step looks at adapters at all.
        self.max_loras_per_batch = max_loras_per_batch
        # Core sharing with the trainer (services/runtime/cores.py): claimed before each step
        # with work, given up while there is none; called from this thread only.
        self.cores = cores
        # A controlled mismatch for studies (EngineSettings.logit_noise_std): noise on the
        # sampling logits, from a generator of its own (the requests' uniforms stay as they are).
        self.logit_noise_std = logit_noise_std
        self._noise = torch.Generator().manual_seed(seed) if logit_noise_std > 0 else None
        self.continuous_decode_steps = continuous_decode_steps
        self._steps_since_admit = 0
        self.max_running = max_running
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = weight_version
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # running[i] lives in KV slot i
        self.paused: str | None = None  # None or the pause_generation mode
        self._inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self._exclusive: deque[tuple[Callable[[], Any], Future, bool]] = deque()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-scheduler", daemon=True)
        self._throughput = metrics.Throughput()
        self._gauges_at = 0.0
        # The engine's own counters (per instance; Prometheus metrics are per process).
        self.stats = {
            "prefill_steps": 0,
            "decode_steps": 0,
            "generated_tokens": 0,
            "max_decode_batch": 0,
            "forward_seconds": 0.0,  # time in prefill + decode + sampling
        }

    # --- thread-safe API ------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        if self.cores is not None and not self._thread.is_alive():
            self.cores.close()  # its slot claims nothing once the loop is gone

    def submit(self, req: Request) -> None:
        self._inbox.put(("submit", req))

    def abort(self, rid: str = "", abort_all: bool = False, message: str | None = None) -> None:
        self._inbox.put(("abort", (rid, abort_all, message)))

    def call(self, fn: Callable[[], Any], *, drain: bool = False) -> Future:
        """Run `fn()` on the scheduler thread between two steps. `drain`: first let running
        requests finish while admitting no new ones (skipped when paused)."""
        fut: Future = Future()
        self._inbox.put(("call", (fn, fut, drain)))
        return fut

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- the loop -------------------------------------------------------------------------

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while not self._stop.is_set():
            try:
                self._take_commands(block=not self._has_work())
                self._run_exclusive()
                if self.cores is not None:
                    computing = not self.paused and bool(
                        self.running or (self.waiting and not self._draining())
                    )
                    if computing:
                        self.cores.work()
                    else:
                        self.cores.rest()
                if self.paused:
                    continue
                admitted = [] if self._draining() else self._admit()
                started = time.perf_counter()
                if admitted:
                    self._prefill(admitted)
                if self.running:
                    self._decode()
                busy = time.perf_counter() - started
                self.stats["forward_seconds"] += busy
                metrics.BUSY_SECONDS.inc(busy)
            except Exception:  # the policy owner: a failed step fails its requests, not the engine
                log.exception("scheduler step failed; aborting the requests in flight")
                metrics.STEP_FAILURES.inc()
                self._fail_all("engine step failed; see engine logs")
            self._publish_gauges()

    def _has_work(self) -> bool:
        if self._exclusive:
            return True
        return not self.paused and bool(self.running or self.waiting)

    def _take_commands(self, *, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=IDLE_WAIT_S) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self.waiting.append(payload)
            elif kind == "abort":
                rid, abort_all, message = payload
                text = message or ("aborted by abort_all" if abort_all else "aborted by /abort_request")
                self._abort_matching(lambda r, rid=rid, every=abort_all: every or r.rid == rid, text)
            else:
                self._exclusive.append(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _draining(self) -> bool:
        return any(drain for _, _, drain in self._exclusive)

    def _run_exclusive(self) -> None:
        while self._exclusive:
            fn, fut, drain = self._exclusive[0]
            if drain and self.running and not self.paused:
                return  # keep decoding the running requests until they are done
            self._exclusive.popleft()
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 — handed to the caller, who owns the policy
                    fut.set_exception(exc)

    # --- admission, prefill, decode -------------------------------------------------------

    def _admit(self) -> list[Request]:
        """Requests for the next prefill: free slots permitting, while the padded prefill
        (rows × longest row) stays within `max_prefill_tokens` (at least one request).
        While requests are decoding, new ones are admitted at most every
        `continuous_decode_steps` steps, so a trickle of arrivals shares prefills."""
        if self.running and self._steps_since_admit < self.continuous_decode_steps:
            self._steps_since_admit += 1
            return []
        admitted: list[Request] = []
        longest = 0
        # the adapters of the batch (None: the base model) and the requests passed over for theirs
        limit = self.max_loras_per_batch
        adapters = None if limit is None else {r.adapter for r in self.running}
        passed: list[Request] = []
        while self.waiting and len(self.running) + len(admitted) < self.max_running:
            head = self.waiting[0]
            if adapters is not None and head.adapter not in adapters and len(adapters) >= limit:
                passed.append(self.waiting.popleft())
                continue
            longest_with = max(longest, len(head.tokens))
            if admitted and longest_with * (len(admitted) + 1) > self.max_prefill_tokens:
                break
            longest = longest_with
            admitted.append(self.waiting.popleft())
            if adapters is not None:
                adapters.add(head.adapter)
        self.waiting.extendleft(reversed(passed))
        if admitted:
            self._steps_since_admit = 1
        return admitted

    def _prefill(self, reqs: list[Request]) -> None:
        first = len(self.running)
        rows = [
            ForwardRow(
                r.tokens,
                full_logits=r.return_logprob and r.logprob_start_len >= 0 and not r.output_ids,
                adapter=r.adapter,
            )
            for r in reqs
        ]
        self.running.extend(reqs)
        last_logits, full = self.runner.prefill(first, rows)
        self.stats["prefill_steps"] += 1
        metrics.PREFILL_STEPS.inc()
        metrics.PROMPT_TOKENS.inc(sum(len(r.prompt_ids) for r in reqs if not r.output_ids))
        cached = 0
        for r, row, logits in zip(reqs, rows, full):
            r.kv_len = len(r.tokens)
            if row.copied and not r.output_ids:
                # Its prompt was computed once for an identical one of this prefill (a group's
                # samples). Counted as SGLang counts a prefix-cache hit: at most the prompt's
                # length - 1 (SGLang always computes the last position, for its logits).
                r.cached_tokens = len(r.prompt_ids) - 1
                cached += r.cached_tokens
            if logits is not None:
                r.input_logprobs = _input_logprobs(logits, r.prompt_ids, r.logprob_start_len)
        metrics.CACHED_TOKENS.inc(cached)
        self._sample_and_finish(reqs, last_logits)

    def _decode(self) -> None:
        batch = list(self.running)
        adapters = None if self.max_loras_per_batch is None else [r.adapter for r in batch]
        logits = self.runner.decode([r.output_ids[-1] for r in batch], [r.kv_len for r in batch], adapters)
        for r in batch:
            r.kv_len += 1
        self.stats["decode_steps"] += 1
        self.stats["max_decode_batch"] = max(self.stats["max_decode_batch"], len(batch))
        metrics.DECODE_STEPS.inc()
        metrics.DECODE_BATCH.observe(len(batch))
        self._sample_and_finish(batch, logits)

    def _sample_and_finish(self, reqs: list[Request], logits: torch.Tensor) -> None:
        active = [i for i, r in enumerate(reqs) if r.max_new_tokens > len(r.output_ids)]
        now = time.monotonic()
        if active:
            logits = logits[active]
            if self._noise is not None:
                noise = torch.randn(logits.shape, generator=self._noise, dtype=torch.float32)
                logits = logits.float() + self.logit_noise_std * noise.to(logits.device)
            rows = [reqs[i] for i in active]
            tokens, logprobs = sample_next(
                logits,
                [r.sampling for r in rows],
                uniforms_at([r.seed for r in rows], [len(r.output_ids) for r in rows]),
            )
            for i, tok, lp in zip(active, tokens.tolist(), logprobs.tolist()):
                r = reqs[i]
                r.output_ids.append(tok)
                r.output_logprobs.append(lp)
                if r.first_token_at is None:
                    r.first_token_at = now
                    metrics.TIME_TO_FIRST_TOKEN.observe(now - r.submitted_at)
            self.stats["generated_tokens"] += len(active)
            metrics.GENERATED_TOKENS.inc(len(active))
            self._throughput.add(len(active))
        done = [r for r in reqs if self._check_finished(r)]
        if done:
            self._release_many(done)

    def _check_finished(self, r: Request) -> bool:
        if r.output_ids and r.output_ids[-1] in r.stop_ids:
            r.finish_reason = {"type": "stop", "matched": r.output_ids[-1]}
        elif r.stop_strs and (matched := stop_string_matched(r)) is not None:
            r.finish_reason = {"type": "stop", "matched": matched}
        elif len(r.output_ids) >= r.max_new_tokens:
            r.finish_reason = {"type": "length", "length": r.max_new_tokens}
        elif r.kv_len + 1 >= self.runner.context_length:
            r.finish_reason = {"type": "length", "length": len(r.output_ids)}
        return r.finish_reason is not None

    # --- finishing, aborting, retracting --------------------------------------------------

    def _release_many(self, reqs: list[Request]) -> None:
        """`_release` each, highest slot first: a finished request at the tail frees its slot
        without moving another into it, so a batch that finishes together moves no KV at all."""
        slots = {id(r): i for i, r in enumerate(self.running)}
        for r in sorted(reqs, key=lambda r: slots[id(r)], reverse=True):
            self._release(r, slots[id(r)])

    def _release(self, r: Request, i: int | None = None) -> None:
        """Free the slot of a running request (moving the last slot's request into it); `i`:
        its slot, if the caller knows it."""
        i = self.running.index(r) if i is None else i
        last = len(self.running) - 1
        if i != last:
            moved = self.running[last]
            self.runner.cache.move(last, i, moved.kv_len)
            self.running[i] = moved
        self.running.pop()
        self._finish(r)

    def _finish(self, r: Request) -> None:
        r.finished_at = time.monotonic()
        r.weight_version = self.weight_version
        metrics.REQUESTS_FINISHED.labels(finish_reason=r.finish_reason["type"]).inc()
        metrics.E2E_LATENCY.observe(r.finished_at - r.submitted_at)
        try:
            r.on_finish(r)
        except Exception:  # a broken callback must not take the scheduler down
            log.exception("finish callback failed for rid %s", r.rid)

    def _abort_matching(self, match: Callable[[Request], bool], message: str) -> int:
        count = 0
        for r in [r for r in self.waiting if match(r)]:
            self.waiting.remove(r)
            r.finish_reason = {"type": "abort", "message": message}
            self._finish(r)
            count += 1
        for r in [r for r in self.running if match(r)]:
            r.finish_reason = {"type": "abort", "message": message}
            self._release(r)
            count += 1
        return count

    def _fail_all(self, message: str) -> None:
        """Answer every request with an abort, without touching the (possibly broken) KV cache."""
        failed = self.running + list(self.waiting)
        self.running.clear()
        self.waiting.clear()
        for r in failed:
            r.finish_reason = {"type": "abort", "message": message}
            self._finish(r)

    def retract_running(self) -> int:
        """Drop the KV of running requests and put them back at the head of the queue; their
        prompt + tokens so far are prefilled again (under the current weights) when admitted."""
        retracted = list(self.running)
        self.running.clear()
        for r in reversed(retracted):
            r.kv_len = 0
            self.waiting.appendleft(r)
        return len(retracted)

    # --- control operations (call these through `call`, on the scheduler thread) ---------

    def pause(self, mode: str) -> int:
        self.paused = mode
        if mode == "abort":
            return self._abort_matching(lambda r: True, "aborted by pause_generation")
        return self.retract_running() if mode == "retract" else len(self.running)

    def resume(self) -> None:
        self.paused = None

    def set_weights(self, apply: Callable[[], None], version: str | None) -> int:
        """Apply new weights now; returns how many frozen requests lost their old-weight KV."""
        apply()
        if version is not None and version != self.weight_version:
            for r in [*self.running, *self.waiting]:
                if r.output_ids:
                    r.version_events.append((self.weight_version, len(r.output_ids)))
            self.weight_version = version
            metrics.set_weight_version(version)
        return self.retract_running() if self.running else 0

    def _publish_gauges(self) -> None:
        now = time.monotonic()
        if now - self._gauges_at < GAUGE_PERIOD_S and (self.running or self.waiting):
            return
        self._gauges_at = now
        metrics.RUNNING.set(len(self.running))
        metrics.QUEUED.set(len(self.waiting))
        metrics.TOKENS_PER_SECOND.set(self._throughput.rate())


def _input_logprobs(logits: torch.Tensor, prompt: list[int], start: int) -> list[float | None]:
    """SGLang's `input_token_logprobs` from `start`: position j holds log p(prompt[j] | prompt[:j]);
    position 0 has none."""
    logp = torch.log_softmax(logits[:-1] if len(prompt) > 1 else logits[:0], dim=-1)
    targets = torch.tensor(prompt[1:], dtype=torch.long, device=logits.device)
    values = logp.gather(1, targets[:, None]).squeeze(1).tolist() if len(prompt) > 1 else []
    per_position: list[float | None] = [None, *values]
    return per_position[start:]
