"""Which LoRA adapters an engine holds, which requests use them, and when one may go: the
lifecycle behind `/load_lora_adapter`, `/unload_lora_adapter` and `/generate`'s `lora_path`.
`AdapterRegistry` holds that state; `AdapterControlMixin` is the part of `InferenceEngine` that
answers the load and unload routes (`/generate` resolves its names in `engine.py`). Lives on the
event loop (every method is called from it); an adapter's tensors are read and checked by
`lora.read_adapter`, on a thread of its own within `weight_update_timeout_s`.

Guarantees:
* A request is served by the adapter it names, or refused: `acquire` resolves every name of a
  request before any of it runs, and the request holds its adapter object until it ends, so an
  unload or eviction meanwhile cannot change what it is served with.
* An adapter that requests in flight use stays until they end. `unregister` (an explicit
  unload) hides it from new requests at once and drops it when its last request is released;
  its caller waits for that, as SGLang's unload waits for the adapter's requests to finish.
* Eviction takes the least recently used adapter (a request naming it or its load counts as a
  use) that no request in flight uses and is not pinned; when there is none, the load is refused.
* Loads are confined as disk weights are: `lora_path` must be an absolute directory inside
  `weights_root` whose adapter files resolve inside it too (`lora.resolve_adapter_dir`), and
  every refused path gets the same answer (`REFUSED_ADAPTER_PATH`). A load refused or failed
  changes nothing, and is counted (`asyncrl_engine_lora_updates_total`).

Differs from SGLang 0.5.23 (`sglang/srt/lora/lora_registry.py`, `managers/tokenizer_control_mixin.py`
`load_lora_adapter`): SGLang evicts the least recently used unpinned adapter even when requests
use it, and its load then waits for them to finish; here the load never waits, it skips adapters
in use. SGLang also reloads an evicted adapter from its path when a request names it again; here
such a request is refused until the adapter is loaded again (its directory may hold other weights
by then).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from asyncrl.proto.sglang import LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput
from asyncrl.services.engine import lora, metrics
from asyncrl.services.engine.config import EngineSettings
from asyncrl.services.engine.lora import LoraAdapter
from asyncrl.services.engine.model_runner import ModelRunner
from asyncrl.services.engine.updates import UpdateTimeout, in_thread
from asyncrl.services.runtime.logging import log_event

log = logging.getLogger(__name__)

# SGLang 0.5.23's LoRA answers (managers/tokenizer_control_mixin.py, tokenizer_manager.py), word for word
LORA_DISABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."
# One answer for every lora_path refused, as `updates.REFUSED_PATH` for weights.
REFUSED_ADAPTER_PATH = (
    "lora_path refused: not a directory with adapter_config.json and adapter_model.safetensors "
    "inside the engine's weights_root"
)


@dataclass(frozen=True)
class LoraResult:
    """What `/load_lora_adapter` and `/unload_lora_adapter` answer (SGLang's `LoRAUpdateOutput`):
    `loaded_adapters` None when refused before reaching the adapters, as SGLang does."""

    ok: bool
    error_message: str
    status: int  # 200, or 400 (SGLang's status for every failed LoRA update)
    loaded_adapters: dict[str, str] | None = None


@dataclass
class _Use:
    in_flight: int = 0  # request items that hold the adapter now
    requests: int = 0  # request items served with it since its load


class AdapterRegistry:
    def __init__(self, *, max_loaded: int | None):
        self.max_loaded = max_loaded
        # name → adapter, least recently used first
        self._loaded: OrderedDict[str, LoraAdapter] = OrderedDict()
        self._use: dict[LoraAdapter, _Use] = {}
        # unloaded by name but still used: dropped when their last request is released
        self._leaving: dict[str, tuple[LoraAdapter, asyncio.Event]] = {}
        self.lock = asyncio.Lock()  # one load or unload at a time (their checks span an await)

    # --- requests ---------------------------------------------------------------------------

    def missing(self, names: Iterable[str | None]) -> list[str]:
        """The names in `names` that are not loaded (in order, once each)."""
        return [n for n in dict.fromkeys(names) if n is not None and n not in self._loaded]

    def acquire(self, names: list[str | None]) -> list[LoraAdapter | None]:
        """The adapter of each name (None: the base model), each marked in use by one request
        until `release`. Every name must be loaded (`missing` first); raises KeyError if not."""
        if self.missing(names):
            raise KeyError(self.missing(names))
        adapters = []
        for name in names:
            adapter = None
            if name is not None:
                adapter = self._loaded[name]
                self._loaded.move_to_end(name)
                use = self._use[adapter]
                use.in_flight += 1
                use.requests += 1
            adapters.append(adapter)
        return adapters

    def release(self, adapters: Iterable[LoraAdapter | None]) -> None:
        for adapter in adapters:
            if adapter is None:
                continue
            use = self._use[adapter]
            use.in_flight -= 1
            leaving = self._leaving.get(adapter.name)
            if use.in_flight == 0 and leaving is not None and leaving[0] is adapter:
                del self._leaving[adapter.name], self._use[adapter]
                leaving[1].set()

    # --- loads and unloads (under `lock`) ---------------------------------------------------

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    def is_leaving(self, name: str) -> bool:
        return name in self._leaving

    def room_needed(self) -> bool:
        return self.max_loaded is not None and len(self._loaded) >= self.max_loaded

    def victim(self) -> str | None:
        """The adapter to evict for one more: the least recently used one that no request uses
        and is not pinned; None when every one is in use or pinned."""
        for name, adapter in self._loaded.items():
            if not adapter.pinned and self._use[adapter].in_flight == 0:
                return name
        return None

    def add(self, adapter: LoraAdapter) -> None:
        assert adapter.name not in self._loaded and adapter.name not in self._leaving
        self._loaded[adapter.name] = adapter
        self._use[adapter] = _Use()

    def evict(self, name: str) -> None:
        adapter = self._loaded.pop(name)
        assert self._use[adapter].in_flight == 0, "evicting an adapter in use"
        del self._use[adapter]

    def unregister(self, name: str) -> asyncio.Event:
        """Hide `name` from new requests; the event is set once no request uses it (at once
        when none does), when it is gone. A name already leaving gives the same event."""
        if name in self._leaving:
            return self._leaving[name][1]
        adapter = self._loaded.pop(name)
        gone = asyncio.Event()
        if self._use[adapter].in_flight == 0:
            del self._use[adapter]
            gone.set()
        else:
            self._leaving[name] = (adapter, gone)
        return gone

    # --- reporting --------------------------------------------------------------------------

    @property
    def num_pinned(self) -> int:
        return sum(a.pinned for a in self._loaded.values())

    def loaded_paths(self) -> dict[str, str]:
        """Name → path as given at load, of every adapter requests may name (SGLang's
        `loaded_adapters`)."""
        return {name: a.path for name, a in self._loaded.items()}

    def state(self) -> list[dict]:
        """Every adapter held, least recently used first; `leaving`: unloaded, waiting for its
        requests to end."""
        held = [(a, False) for a in self._loaded.values()] + [(a, True) for a, _ in self._leaving.values()]
        return [
            {
                "name": a.name,
                "path": a.path,
                "rank": a.rank,
                "scale": a.scale,
                "pinned": a.pinned,
                "leaving": leaving,
                "in_flight": self._use[a].in_flight,
                "requests": self._use[a].requests,
                "bytes": a.nbytes,
            }
            for a, leaving in held
        ]


class AdapterControlMixin:
    """The LoRA routes of `InferenceEngine`, which it is mixed into (module docstring). The
    registry they change lives on the engine (`adapters`, None when LoRA is off)."""

    settings: EngineSettings
    runner: ModelRunner
    adapters: AdapterRegistry | None

    async def load_lora_adapter(self, req: LoadLoRAAdapterReqInput) -> LoraResult:
        """Read, check and register an adapter; past `max_loaded_loras`, evict the least
        recently used one that no request uses and is not pinned (`AdapterRegistry.victim`), or refuse."""
        registry = self.adapters
        if registry is None:
            return self._lora_refused("load", LORA_DISABLED)
        root = self.settings.weights_root
        if root is None:
            return self._lora_refused("load", "load_lora_adapter is disabled: the engine has no weights_root")
        name = req.lora_name
        async with registry.lock:
            if registry.is_leaving(name):
                return self._lora_refused(
                    "load",
                    f"LoRA adapter '{name}' is being unloaded: requests in flight still use it. "
                    "Load it again once its unload has returned.",
                )
            if registry.is_loaded(name):
                return self._lora_refused(
                    "load", f"Failed to load LoRA adapter {name} because it is already loaded", listed=True
                )
            if req.pinned and registry.num_pinned >= self.settings.max_loras_per_batch - 1:
                return self._lora_refused(
                    "load",
                    f"Failed to load LoRA adapter {name} as a pinned adapter. It is not allowed to pin all "
                    "slots in the LoRA memory pool to avoid starvation for unpinned adapters and base models. "
                    "Please increase your `--max-loras-per-batch` or load it as unpinned LoRA adapters.",
                    listed=True,
                )
            if registry.room_needed() and registry.victim() is None:
                return self._lora_refused("load", self._no_room(name))

            def read() -> lora.LoraAdapter | None:
                real = lora.resolve_adapter_dir(root, req.lora_path)
                if real is None:
                    return None
                return lora.read_adapter(
                    name,
                    req.lora_path,
                    real_path=real,
                    linears=self.runner.lora_linears,
                    max_rank=self.settings.max_lora_rank,  # type: ignore[arg-type]  # set with enable_lora
                    allowed=self.settings.lora_targets,
                    vocab_size=self.runner.vocab_size,
                    dtype=self.runner.dtype,
                    device=self.runner.device,
                    pinned=req.pinned,
                )

            deadline = time.monotonic() + self.settings.weight_update_timeout_s
            try:
                adapter = await in_thread(read, deadline, "lora-read")
            except UpdateTimeout:
                return self._lora_failed(name, "timeout", f"reading LoRA adapter {name} timed out")
            except lora.AdapterError as exc:
                return self._lora_failed(name, "error", str(exc))
            if adapter is None:
                return self._lora_refused("load", REFUSED_ADAPTER_PATH, listed=True)
            if registry.room_needed():
                victim = registry.victim()  # requests may have started using the one seen above
                if victim is None:
                    return self._lora_refused("load", self._no_room(name))
                registry.evict(victim)
                metrics.LORA_UPDATES.labels(operation="evict", result="ok").inc()
                log_event(log, "LoRA adapter evicted", name=victim, for_adapter=name)
            registry.add(adapter)
            metrics.LORA_ADAPTERS.set(len(registry.loaded_paths()))
        metrics.LORA_UPDATES.labels(operation="load", result="ok").inc()
        log_event(log, "LoRA adapter loaded", name=name, path=req.lora_path, rank=adapter.rank)
        return LoraResult(True, "", 200, registry.loaded_paths())

    async def unload_lora_adapter(self, req: UnloadLoRAAdapterReqInput) -> LoraResult:
        """Hide the adapter from new requests at once, and answer once the requests in flight
        that use it have ended and it is gone (SGLang's order)."""
        registry = self.adapters
        if registry is None:
            return self._lora_refused("unload", LORA_DISABLED)
        name = req.lora_name
        async with registry.lock:
            if not registry.is_loaded(name) and not registry.is_leaving(name):
                return self._lora_refused(
                    "unload",
                    f"LoRA with name {name} does not exist. Loaded LoRAs: {list(registry.loaded_paths())}",
                )
            gone = registry.unregister(name)
            metrics.LORA_ADAPTERS.set(len(registry.loaded_paths()))
        await gone.wait()  # outside the lock: other loads and unloads go on meanwhile
        metrics.LORA_UPDATES.labels(operation="unload", result="ok").inc()
        log_event(log, "LoRA adapter unloaded", name=name)
        return LoraResult(True, "", 200, registry.loaded_paths())

    def _no_room(self, name: str) -> str:
        return (
            f"cannot load LoRA adapter {name}: all {self.settings.max_loaded_loras} loaded adapters "
            "(max_loaded_loras) are in use by requests in flight or pinned; unload one, or retry once "
            "their requests have ended"
        )

    def _lora_refused(self, operation: str, message: str, *, listed: bool = False) -> LoraResult:
        """Refused before any adapter was read or changed. `listed`: answer with the adapters
        loaded, as SGLang does for what its LoRA manager refuses (not for what its tokenizer
        manager refuses first: LoRA off, an unload under way, no room, an unknown unload)."""
        metrics.LORA_UPDATES.labels(operation=operation, result="refused").inc()
        log_event(log, "LoRA update refused", logging.WARNING, operation=operation, message=message)
        loaded = self.adapters.loaded_paths() if listed and self.adapters is not None else None
        return LoraResult(False, message, 400, loaded)

    def _lora_failed(self, name: str, result: str, message: str) -> LoraResult:
        """A load whose adapter could not be read or does not fit the model: nothing changed."""
        metrics.LORA_UPDATES.labels(operation="load", result=result).inc()
        log_event(log, "LoRA adapter load failed", logging.WARNING, name=name, message=message)
        return LoraResult(False, message, 400, self.adapters.loaded_paths() if self.adapters else None)
