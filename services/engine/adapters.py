"""Which LoRA adapters an engine holds, which requests use them, and when one may go: the
lifecycle behind `/load_lora_adapter`, `/unload_lora_adapter` and `/generate`'s `lora_path`.
Lives on the event loop (every method is called from it); the adapters' tensors are read
elsewhere (`lora.read_adapter`).

Guarantees:
* A request is served by the adapter it names, or refused: `acquire` resolves every name of a
  request before any of it runs, and the request holds its adapter object until it ends, so an
  unload or eviction meanwhile cannot change what it is served with.
* An adapter that requests in flight use stays until they end. `unregister` (an explicit
  unload) hides it from new requests at once and drops it when its last request is released;
  its caller waits for that, as SGLang's unload waits for the adapter's requests to finish.
* Eviction takes the least recently used adapter (a request naming it or its load counts as a
  use) that no request in flight uses and is not pinned; when there is none, the load is refused.

Differs from SGLang 0.5.23 (`sglang/srt/lora/lora_registry.py`, `managers/tokenizer_control_mixin.py`
`load_lora_adapter`): SGLang evicts the least recently used unpinned adapter even when requests
use it, and its load then waits for them to finish; here the load never waits, it skips adapters
in use. SGLang also reloads an evicted adapter from its path when a request names it again; here
such a request is refused until the adapter is loaded again (its directory may hold other weights
by then).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from asyncrl.services.engine.lora import LoraAdapter


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
