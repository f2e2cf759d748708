"""The cyclic garbage collector in long-running services.

After start-up a service's heap holds a few hundred thousand objects that live as long as the
process (torch, transformers and their modules, the model, the app). Python 3.11's full
collection walks all of them: ~140 ms each in the rollout service, which ran one every ~2 s
of the CPU demo (benchmarks/RESULTS.md, "Frozen start-up heap"). `freeze_startup_heap`, called once when a
service is built and before it serves, moves them to the collector's permanent generation, so
later collections look only at what the service allocated since. Nothing frozen is ever
collected: call it once, after start-up, never from a library or a test process.
"""

from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object alive; returns how many are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
