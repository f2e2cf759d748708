"""Delta versions on disk: what changed between two published versions, and how a receiver
rebuilds the new version from the old one and checks the result.

Why: after one optimizer step most weights are bit-identical once rounded to the publish dtype
(bf16 keeps 8 bits of mantissa; an update below half an ulp vanishes), so a version can ship
only the tensors, or fixed-size blocks of the flattened tensors, whose bytes changed.

A delta directory (`<root>/<version_dir_name>/`, beside full ones) holds the source config and
tokenizer files like a full version, plus
* `DELTA_FILE` (safetensors): tensor granularity, the whole new tensor under its own name;
  block granularity, `<name>::blocks` (int64 indices of the changed blocks of `block_elems`
  elements of the flattened tensor) and `<name>::data` (those blocks' new values,
  concatenated; the last block of a tensor may be short);
* `MANIFEST_FILE` (JSON, `DeltaManifest`): its version and epoch, the `base` version it
  applies to (exactly that one), the `anchor` (the last full version of its chain: every
  version from anchor+1 to this one is a delta on its predecessor), and for every tensor it
  touches the sha256 of the tensor's bytes AFTER applying (in the publish dtype). With blocks
  that checks the base's unchanged blocks of the touched tensors as well as the delta; with
  whole tensors only the delta (the base is checked by version: the receiver applies a delta
  only on top of the version it names).
There is no `model.safetensors` in a delta directory: a receiver that only loads full
checkpoints (SGLang) must be given full versions (docs/architecture.md §6).

Comparison is bitwise (integer views of the same width): -0.0 vs 0.0 and NaN payloads count as
changes, so applying a delta reproduces the sender's bytes exactly.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DELTA_FILE = "delta.safetensors"
MANIFEST_FILE = "delta.json"
FORMAT = "asyncrl-delta/1"
BLOCKS_SUFFIX = "::blocks"
DATA_SUFFIX = "::data"
SAMPLE_ELEMS = 4096  # per tensor, for the size estimate that stops a hopeless delta early
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class DeltaError(ValueError):
    """A delta that cannot be applied: wrong base, a malformed file, or a hash that differs."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason  # base | hash | malformed: the label of the engine's resync counter


@dataclass
class DeltaManifest:
    version: int
    epoch: int
    base: int
    anchor: int
    granularity: str  # tensor | block
    block_elems: int
    sha256: dict[str, str]  # tensor name → hash of its bytes after applying
    tensors_total: int = 0  # tensors in the full version (for the bytes-saved figures)
    format: str = FORMAT
    changed_bytes: int = 0  # bytes of tensor data in DELTA_FILE
    full_bytes: int = 0  # bytes of the full version
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DeltaManifest:
        try:
            raw = json.loads(text)
            if raw.get("format") != FORMAT:
                raise ValueError(f"unknown delta format {raw.get('format')!r}")
            m = cls(**raw)
        except (TypeError, ValueError) as exc:
            raise DeltaError("malformed", f"bad delta manifest: {exc}") from exc
        if m.granularity not in ("tensor", "block") or m.block_elems < 1:
            raise DeltaError("malformed", f"bad delta manifest: granularity {m.granularity!r}")
        return m


def tensor_sha256(t: torch.Tensor) -> str:
    """sha256 of the tensor's bytes in its own dtype, row-major."""
    return hashlib.sha256(memoryview(_flat_bits(t).numpy())).hexdigest()  # no copy of the bytes


def _flat_bits(t: torch.Tensor) -> torch.Tensor:
    """The flattened tensor as integers of the same width (bitwise comparison), on the CPU."""
    flat = t.detach().reshape(-1).contiguous().cpu()
    return flat.view(_INT_OF_SIZE[flat.element_size()])


def compute_delta(
    prev: Mapping[str, torch.Tensor],
    new: Mapping[str, torch.Tensor],
    *,
    granularity: str = "tensor",
    block_elems: int = 65536,
    max_bytes: int | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    """(tensors for DELTA_FILE, sha256 of every touched tensor after applying) turning `prev`
    into `new`; None as soon as the delta's tensors exceed `max_bytes` (the rest is not
    compared, nothing is hashed). Both must hold the same names, shapes and dtypes (a change of
    any of these is a new anchor, not a delta: ValueError)."""
    if set(prev) != set(new):
        raise ValueError("a delta needs the same tensor names in both versions")
    if max_bytes is not None:
        if granularity == "tensor":  # a lower bound: stop as soon as it is over
            if _sampled_changed_bytes(prev, new, whole_tensors=True) > max_bytes:
                return None
        elif _sampled_changed_bytes(prev, new) > 1.25 * max_bytes:
            return None
    out: dict[str, torch.Tensor] = {}
    touched: list[str] = []
    size = 0
    for name, t in new.items():
        if max_bytes is not None and size > max_bytes:
            return None
        p = prev[name]
        if p.shape != t.shape or p.dtype != t.dtype:
            raise ValueError(f"{name}: shape or dtype changed; publish a full version")
        a, b = _flat_bits(p), _flat_bits(t)
        if granularity == "tensor":
            if not torch.equal(a, b):
                out[name] = t.detach().contiguous().cpu()
                touched.append(name)
                size += out[name].numel() * out[name].element_size()
            continue
        if granularity != "block":
            raise ValueError(f"unknown granularity {granularity!r}")
        n = a.numel()
        nblocks = -(-n // block_elems)
        diff = _padded(a != b, nblocks * block_elems)
        if block_elems > 1:
            diff = diff.view(nblocks, block_elems).any(dim=1)
        if max_bytes is not None:  # surely over budget: stop before gathering indices and values
            count = int(torch.count_nonzero(diff))
            if size + 4 * count + max(count - 1, 0) * block_elems * t.element_size() > max_bytes:
                return None
        changed = diff.nonzero().flatten()
        if changed.numel() == 0:
            continue
        values = _padded(t.detach().reshape(-1).contiguous().cpu(), nblocks * block_elems)
        data = values.view(nblocks, block_elems)[changed].reshape(-1)
        if int(changed[-1]) == nblocks - 1:  # the last block is short: drop its padding
            data = data[: data.numel() - (nblocks * block_elems - n)]
        out[name + BLOCKS_SUFFIX] = changed.to(torch.int32 if nblocks < 2**31 else torch.int64)
        out[name + DATA_SUFFIX] = data.contiguous()
        touched.append(name)
        size += sum(
            out[name + k].numel() * out[name + k].element_size() for k in (BLOCKS_SUFFIX, DATA_SUFFIX)
        )
    if max_bytes is not None and size > max_bytes:
        return None
    return out, {name: tensor_sha256(new[name]) for name in touched}


def apply_delta(
    base: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor], manifest: DeltaManifest
) -> dict[str, torch.Tensor]:
    """The new values of every tensor the delta touches (new tensors; `base` is not modified),
    each checked against the manifest's hash. `base[name]` is read in the delta's dtype (an
    engine's fp32 parameters hold bf16 values exactly). Raises DeltaError."""
    touched: dict[str, torch.Tensor] = {}
    if manifest.granularity == "tensor":
        for name, t in delta.items():
            if name not in base:
                raise DeltaError("malformed", f"delta names unknown tensor {name!r}")
            if t.shape != base[name].shape:
                raise DeltaError(
                    "malformed", f"{name}: delta shape {tuple(t.shape)} != {tuple(base[name].shape)}"
                )
            touched[name] = t
    else:
        names = {k[: -len(BLOCKS_SUFFIX)] for k in delta if k.endswith(BLOCKS_SUFFIX)}
        for name in sorted(names):
            data = delta.get(name + DATA_SUFFIX)
            if name not in base or data is None:
                raise DeltaError("malformed", f"delta block entry {name!r} has no tensor or no data")
            b = base[name]
            n = b.numel()
            be = manifest.block_elems
            nblocks = -(-n // be)
            idx = delta[name + BLOCKS_SUFFIX].to(torch.int64)
            if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= nblocks):
                bad = int(idx.max()) if int(idx.max()) >= nblocks else int(idx.min())
                raise DeltaError("malformed", f"{name}: block {bad} out of range")
            if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
                raise DeltaError("malformed", f"{name}: block indices not increasing")
            short = nblocks * be - n if idx.numel() and int(idx[-1]) == nblocks - 1 else 0
            if data.numel() != idx.numel() * be - short:
                raise DeltaError("malformed", f"{name}: {data.numel()} block values for {idx.numel()} blocks")
            flat = _padded(b.detach().reshape(-1).to(device="cpu", dtype=data.dtype, copy=True), nblocks * be)
            flat.view(nblocks, be)[idx] = _padded(data, idx.numel() * be).view(-1, be)
            flat = flat[:n]
            touched[name] = flat.view(b.shape)
    if set(touched) != set(manifest.sha256):
        raise DeltaError("malformed", "the delta's tensors and the manifest's hashes name different tensors")
    for name, t in touched.items():
        if tensor_sha256(t) != manifest.sha256[name]:
            raise DeltaError("hash", f"{name}: sha256 after applying differs from the manifest's")
    return touched


def _sampled_changed_bytes(
    prev: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], *, whole_tensors: bool = False
) -> float:
    """An estimate, from at most SAMPLE_ELEMS evenly strided elements per tensor, of the bytes
    of the changed values alone (a lower bound of any delta's size, up to sampling): under
    Adam every fp32 element moves, and this says so for ~1% of a full comparison's work.
    `whole_tensors`: the bytes of every tensor with a sampled element changed, a true lower
    bound of a tensor-granularity delta (a bf16 step changes a few % of the elements, which
    touches every large tensor: this finds that for the same ~1%)."""
    total = 0.0
    for name, t in new.items():
        p = prev[name]
        if p.shape != t.shape or p.dtype != t.dtype:
            raise ValueError(f"{name}: shape or dtype changed; publish a full version")
        n = t.numel()
        if n == 0:
            continue
        stride = max(1, n // SAMPLE_ELEMS)
        a, b = _flat_bits(p)[::stride], _flat_bits(t)[::stride]
        changed = float((a != b).float().mean())
        if whole_tensors:
            changed = 1.0 if changed > 0 else 0.0
        total += changed * n * t.element_size()
    return total


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """1-D `t` extended with zeros to `length` elements (itself when it is that long)."""
    if t.numel() == length:
        return t
    return torch.cat([t, t.new_zeros(length - t.numel())])


def read_delta(path: str | Path) -> tuple[DeltaManifest, dict[str, torch.Tensor]]:
    """The manifest and tensors of a delta directory (DeltaError for a malformed one)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    manifest = DeltaManifest.from_json((path / MANIFEST_FILE).read_text())
    try:
        tensors = load_file(str(path / DELTA_FILE))
    except (SafetensorError, OSError) as exc:
        raise DeltaError("malformed", f"cannot read {DELTA_FILE}: {exc}") from exc
    return manifest, tensors


def is_delta_dir(path: str | Path) -> bool:
    return (Path(path) / MANIFEST_FILE).is_file()
