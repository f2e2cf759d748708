"""Shared by the engine and reward clients' request coalescing."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


def chunk_by_size(items: Iterable[T], size: Callable[[T], int], limit: int) -> list[list[T]]:
    """Consecutive chunks whose sizes add up to at most `limit` (an item larger than `limit`
    gets a chunk of its own)."""
    chunks: list[list[T]] = []
    total = limit
    for item in items:
        if total + size(item) > limit:
            chunks.append([])
            total = 0
        chunks[-1].append(item)
        total += size(item)
    return chunks
