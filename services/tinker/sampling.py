"""Sampling through this stack's engines (SGLang's native API: `proto/sglang.py`).

A sampling session names an immutable version: the base model, or one sampler adapter that
`save_weights_for_sampler` wrote (a PEFT directory under the engines' `weights_root`, never
rewritten). A sample loads that adapter on an engine if it does not hold it yet
(`/load_lora_adapter`, under the adapter's own name), then asks `/generate` for
`num_samples` copies of the prompt naming it (`lora_path`), with per-token logprobs and, when
asked, the prompt's. Engines are used round robin; each keeps at most `max_loaded` of this
service's adapters, the least recently used ones not in use unloaded first. An engine that
lost an adapter (restarted) refuses the request with SGLang's "not loaded" message: the
adapter is loaded again and the request sent once more.

What a request cannot have here is refused with a message naming it: top-k logprobs, target
prompt logprobs, prompt alternative tokens, stability records, stop token ids mixed with stop
strings.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import OrderedDict, defaultdict
from pathlib import Path

import httpx

from asyncrl.proto import tinker as wire
from asyncrl.proto.sglang import (
    GenerateResponse,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    UnloadLoRAAdapterReqInput,
    lora_not_loaded,
)
from asyncrl.services.runtime.auth import engine_auth_headers

MAX_ERROR_CHARS = 500  # of an engine's refusal quoted back
# The engine answers that say the request itself is wrong (the client's error); any other status
# (401/403: the service's engine token; 408/429: the engine busy; 5xx) is the service's.
REQUEST_REFUSED = frozenset({400, 404, 413, 422})


class SampleRefused(ValueError):
    """The request asks for something the engines cannot do (a user error)."""


class EngineError(RuntimeError):
    """An engine failed or answered garbage (a server error)."""


class Sampler:
    def __init__(self, urls: list[str], *, timeout_s: float, max_loaded: int, max_tokens: int):
        self.urls, self.max_loaded, self.max_tokens = list(urls), max_loaded, max_tokens
        self.http = httpx.AsyncClient(timeout=timeout_s, headers=engine_auth_headers())
        self._next = itertools.cycle(range(len(self.urls))) if self.urls else None
        self.loaded: dict[int, OrderedDict[str, str]] = defaultdict(
            OrderedDict
        )  # engine -> name -> path (LRU)
        self.in_use: defaultdict[tuple[int, str], int] = defaultdict(int)
        self.locks: defaultdict[int, asyncio.Lock] = defaultdict(asyncio.Lock)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def sample(self, request: wire.SampleRequest, session: dict) -> dict:
        """The result of one sample call: `{"sequences": [...], "prompt_logprobs": [...] | None}`."""
        if self._next is None:
            raise SampleRefused("this tinker service has no engines (engine_urls), so it cannot sample")
        refused = request.refused()
        if refused:
            raise SampleRefused(f"not supported by this service: {', '.join(refused)}")
        prompt = request.prompt.tokens()
        if not prompt:
            raise SampleRefused("the prompt is empty")
        body = self._generate_body(request, prompt)
        engine = next(self._next)
        adapter = session.get("adapter_name")
        if adapter is None:
            answers = await self._generate(engine, body)
        else:
            await self._ensure_loaded(engine, adapter, session["adapter_path"])
            self.in_use[(engine, adapter)] += 1
            try:
                body["lora_path"] = adapter
                try:
                    answers = await self._generate(engine, body)
                except SampleRefused as exc:
                    if adapter not in lora_not_loaded(str(exc)):
                        raise
                    self.loaded[engine].pop(adapter, None)  # the engine lost it: load it again, once
                    await self._ensure_loaded(engine, adapter, session["adapter_path"])
                    answers = await self._generate(engine, body)
            finally:
                self.in_use[(engine, adapter)] -= 1
        return _result(answers, prompt, request)

    def _generate_body(self, request: wire.SampleRequest, prompt: list[int]) -> dict:
        p = request.sampling_params
        max_tokens = p.max_tokens if p.max_tokens is not None else self.max_tokens
        if max_tokens > self.max_tokens:
            raise SampleRefused(
                f"max_tokens {max_tokens} is above this service's max_sample_tokens ({self.max_tokens})"
            )
        params: dict = {
            "max_new_tokens": max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,
        }
        if isinstance(p.stop, str):
            params["stop"] = [p.stop]
        elif p.stop is not None and all(isinstance(s, str) for s in p.stop):
            params["stop"] = list(p.stop)
        elif p.stop is not None and all(isinstance(s, int) for s in p.stop):
            params["stop_token_ids"] = list(p.stop)
            params["ignore_eos"] = not p.stop  # `[]` disables every stop, EOS included (the SDK's rule)
        elif p.stop is not None:
            raise SampleRefused("stop mixes strings and token ids")
        n = request.num_samples
        per_item = []
        for i in range(n):  # one item per sample; a seed is spread so the samples differ
            item = dict(params)
            if p.seed is not None:
                item["sampling_seed"] = (p.seed + i) % (1 << 63)
            per_item.append(item)
        start = -1
        if request.prompt_logprobs:
            start = (
                0 if request.prompt_logprobs_last_n is None else len(prompt) - request.prompt_logprobs_last_n
            )
            if start < 1 and request.prompt_logprobs_last_n is not None:
                raise SampleRefused(
                    f"prompt_logprobs_last_n {request.prompt_logprobs_last_n} must be below the prompt length {len(prompt)}"
                )
        return {
            "input_ids": [prompt] * n,
            "sampling_params": per_item,
            "return_logprob": True,
            "logprob_start_len": [start if i == 0 else -1 for i in range(n)],
        }

    async def _generate(self, engine: int, body: dict) -> list[GenerateResponse]:
        url = self.urls[engine] + "/generate"
        try:
            resp = await self.http.post(url, json=body)
        except httpx.HTTPError as exc:
            raise EngineError(
                f"engine {self.urls[engine]} unreachable: {type(exc).__name__}: {exc}"
            ) from None
        if resp.status_code in REQUEST_REFUSED:
            raise SampleRefused(f"the engine refused the request: {resp.text[:MAX_ERROR_CHARS]}")
        if resp.status_code != 200:
            raise EngineError(
                f"engine {self.urls[engine]} answered {resp.status_code}: {resp.text[:MAX_ERROR_CHARS]}"
            )
        try:
            return [GenerateResponse.model_validate(item) for item in resp.json()]
        except ValueError as exc:
            raise EngineError(
                f"engine {self.urls[engine]} answered a body that is not SGLang's: {exc}"
            ) from None

    async def _ensure_loaded(self, engine: int, name: str, path: str) -> None:
        async with self.locks[engine]:
            held = self.loaded[engine]
            if name in held:
                held.move_to_end(name)
                return
            if not await asyncio.to_thread(Path(path).is_dir):
                raise SampleRefused(
                    f"the sampler weights of {name} are gone ({path}): only the newest unnamed "
                    "save_weights_for_sampler versions of a model are kept; save with a name to keep one"
                )
            while len(held) >= self.max_loaded:
                victim = next((n for n in held if not self.in_use[(engine, n)]), None)
                if victim is None:
                    break  # every one is in use: the engine's own bound decides
                held.pop(victim)
                await self._adapter_call(
                    engine, "/unload_lora_adapter", UnloadLoRAAdapterReqInput(lora_name=victim)
                )
            answer = await self._adapter_call(
                engine, "/load_lora_adapter", LoadLoRAAdapterReqInput(lora_name=name, lora_path=path)
            )
            if answer.success or (answer.loaded_adapters or {}).get(name) == path:
                held[name] = path
                return
            raise EngineError(
                f"engine {self.urls[engine]} could not load adapter {name}: {answer.error_message}"
            )

    async def _adapter_call(self, engine: int, route: str, body) -> LoRAUpdateOutput:
        try:
            resp = await self.http.post(self.urls[engine] + route, json=body.model_dump())
            return LoRAUpdateOutput.model_validate(resp.json())
        except (httpx.HTTPError, ValueError) as exc:
            raise EngineError(
                f"engine {self.urls[engine]}{route} failed: {type(exc).__name__}: {exc}"
            ) from None


def _result(answers: list[GenerateResponse], prompt: list[int], request: wire.SampleRequest) -> dict:
    sequences = []
    for answer in answers:
        meta = answer.meta_info
        finish = meta.finish_reason.type
        if finish == "abort":
            raise EngineError(f"the engine aborted the request: {meta.finish_reason.message}")
        logprobs = [lp for lp, _, _ in meta.output_token_logprobs or []]
        if len(logprobs) != len(answer.output_ids):
            raise EngineError("the engine's logprobs do not line up with its tokens")
        sequences.append({"tokens": answer.output_ids, "logprobs": logprobs, "stop_reason": finish})
    prompt_logprobs = None
    if request.prompt_logprobs:
        listed = answers[0].meta_info.input_token_logprobs or []
        values = [lp for lp, _, _ in listed]
        prompt_logprobs = [None] * (len(prompt) - len(values)) + values
    return {"sequences": sequences, "prompt_logprobs": prompt_logprobs}
