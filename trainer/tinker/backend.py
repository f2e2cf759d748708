"""`TinkerTrainer`: the training side of the Tinker-compatible API, in process, several LoRA
models on one process's base models.

A Tinker client drives the loop itself, so this is the async trainer's parts without its loop:
`build_model` (trainer/model.py) with LoRA (trainer/lora.py), the chunked log-probs
(`token_logprobs`, trainer/batch.py), the sharded checkpoints (trainer/checkpoint.py via
state.py) and the adapter publisher (trainer/publish.py `DiskPublisher`), called per command.

Guarantees: a forward_backward's gradients add to the model's until its optim_step, which
applies AdamW with that call's AdamParams and clears them; models share nothing that trains (a
model's adapters, optimizer state, gradients and versions are its own; the frozen base may be
shared, models.py); a call's data is checked whole before any compute (data.py), so a refused
call changes nothing. Not thread-safe: the service calls it from one worker thread, each
model's commands in order (`metrics` alone may be read from another thread).
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from asyncrl.trainer.tinker import data as tdata
from asyncrl.trainer.tinker import state
from asyncrl.trainer.tinker.errors import (
    CapacityError,
    InvalidInputError,
    UnknownModelError,
    UnsupportedError,
)
from asyncrl.trainer.tinker.losses import elementwise_loss
from asyncrl.trainer.tinker.models import (
    TINKER_BETAS,
    TINKER_EPS,
    TinkerModel,
    fresh_adam_state,
    frozen_parameters,
    is_sharded,
    lora_request,
    lora_settings,
    share_base,
)

ADAM_KEYS = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
KEPT_DIR = "kept"  # named sampler versions, beside the pruned ones (not a `v…` name: never listed)


@dataclass(frozen=True)
class TinkerSettings:
    base_models: dict[str, str]  # model name a client sends -> local HF directory
    weights_root: str  # sampler adapters: <weights_root>/<model_id>/v<version>/ (the engines read them)
    checkpoints_root: str  # save_state: <checkpoints_root>/<model_id>/<name>/
    max_models: int = 4  # more -> CapacityError
    max_lora_rank: int = 64  # larger -> UnsupportedError
    max_tokens_per_call: int = 32768  # forward/forward_backward batch larger -> CapacityError
    mixed_precision: str = (
        "float32"  # "auto" resolves as the trainer's does; not float32: FSDP2, no base sharing
    )
    chunk_tokens: int = 1024  # LM-head tokens per chunk of the log-probs (trainer/logprobs.py)
    threads: int = 1  # torch threads of the process
    micro_batch_tokens: int = 4096  # padded positions per forward (rows x longest): bounds activations
    lora_alpha: float = 32.0  # Tinker's adapters' α (models.py)
    keep_sampler_versions: int = 20  # newest sampler versions kept per model (older ones deleted)
    publish_dtype: str = "float32"  # of the sampler adapters' tensors
    unembed_without_adapter: bool = False  # accept train_unembed=True without an lm_head adapter (models.py)
    share_base: bool = True  # models of one base share its frozen weights (models.py)


@dataclass
class ForwardResult:
    outputs: list[dict[str, np.ndarray]]  # per datum: "logprobs" (and cross_entropy's "elementwise_loss")
    metrics: dict[str, float] = field(default_factory=dict)  # "loss:sum": the SDK reduces by the suffix


class TinkerTrainer:
    def __init__(self, settings: TinkerSettings):
        from asyncrl.trainer.model import init_distributed

        torch.set_num_threads(settings.threads)
        self.settings = settings
        self.ranks = init_distributed("cpu")  # a world of one (gloo), joined if already there
        if self.ranks.world != 1:
            raise RuntimeError(f"the Tinker backend runs in a world of one, not {self.ranks.world}")
        self.weights_root = Path(settings.weights_root)
        self.checkpoints_root = Path(settings.checkpoints_root)
        self._models: dict[str, TinkerModel] = {}

    # ---- models -------------------------------------------------------------------------

    def create_model(
        self, model_id: str, base_model: str, lora: dict | None, seed: int | None = None
    ) -> dict:
        from transformers import AutoConfig

        from asyncrl.trainer.lora import adapter_config
        from asyncrl.trainer.model import build_model, resolve_mixed_precision
        from asyncrl.trainer.publish import DiskPublisher

        state.check_name(model_id, "model_id")
        if model_id in self._models:
            raise InvalidInputError(f"model {model_id!r} exists already")
        if base_model not in self.settings.base_models:
            raise UnsupportedError(
                f"base model {base_model!r} is not served here; served: {sorted(self.settings.base_models)}"
            )
        if len(self._models) >= self.settings.max_models:
            raise CapacityError(
                f"{len(self._models)} models are loaded, the most this service holds (max_models); "
                "unload one first"
            )
        req = lora_request(lora, seed, self.settings.max_lora_rank, self.settings.unembed_without_adapter)
        path = self.settings.base_models[base_model]
        precision = resolve_mixed_precision(self.settings.mixed_precision, self.ranks.device)
        try:
            module = build_model(
                path,
                self.ranks,
                seed=req.seed,
                mixed_precision=precision,
                lora=lora_settings(req, self.settings.lora_alpha),
            )
        except ValueError as exc:  # peft: a target module the model does not have
            raise UnsupportedError(f"LoRA {req.targets()} on {base_model}: {exc}") from exc
        shares = False
        if self.settings.share_base and not is_sharded(module):
            donor = next(
                (m for m in self._models.values() if m.base_model == base_model and m.shares_base), None
            )
            if donor is not None:
                share_base(module, frozen_parameters(donor.module))
            shares = True
        optimizer = torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad],
            lr=1e-4,
            betas=TINKER_BETAS,
            eps=TINKER_EPS,
            weight_decay=0.0,
        )
        fresh_adam_state(optimizer)
        config = AutoConfig.from_pretrained(path)
        publisher = DiskPublisher(
            self.weights_root / model_id,
            path,
            keep=self.settings.keep_sampler_versions,
            adapter_config=adapter_config(module, path),
        )
        from asyncrl.services.transport.weights.filesystem import published_versions

        published = [v for (_, v), _ in published_versions(self.weights_root / model_id)]
        self._models[model_id] = TinkerModel(
            model_id=model_id,
            base_model=base_model,
            base_path=str(path),
            lora=req,
            module=module,
            optimizer=optimizer,
            scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0),
            publisher=publisher,
            vocab=int(module.get_output_embeddings().weight.shape[0]),
            pad_id=int(config.pad_token_id or 0),
            shares_base=shares,
            sampler_version=max(published, default=0),  # a reused id never rewrites a version
        )
        return self.info(model_id)

    def info(self, model_id: str) -> dict:
        m = self._get(model_id)
        return {
            "model_id": m.model_id,
            "model_name": m.base_model,
            "is_lora": True,
            "lora_rank": m.lora.rank,
            "lora": m.lora.as_dict(),
            "tokenizer_path": m.base_path,
            "arch": type(m.module.get_base_model()).__name__,
            "step": m.step,
            "sampler_version": m.sampler_version,
        }

    def unload(self, model_id: str) -> None:
        self._get(model_id)
        del self._models[model_id]

    def models(self) -> list[str]:
        return list(self._models)

    def model(self, model_id: str) -> TinkerModel:
        """A model's live state (module, optimizer, counters): for tests and tools, read-only."""
        return self._get(model_id)

    def _get(self, model_id: str) -> TinkerModel:
        m = self._models.get(model_id)
        if m is None:
            raise UnknownModelError(f"no model {model_id!r}")
        return m

    # ---- forward, backward, step --------------------------------------------------------

    def forward(
        self, model_id: str, data: list[tdata.Datum], loss_fn: str, loss_fn_config: dict | None
    ) -> ForwardResult:
        with torch.no_grad():
            return self._run(model_id, data, loss_fn, loss_fn_config, backward=False)

    def forward_backward(
        self, model_id: str, data: list[tdata.Datum], loss_fn: str, loss_fn_config: dict | None
    ) -> ForwardResult:
        return self._run(model_id, data, loss_fn, loss_fn_config, backward=True)

    def _run(self, model_id, data, loss_fn, loss_fn_config, backward: bool) -> ForwardResult:
        from asyncrl.trainer.batch import token_logprobs

        m = self._get(model_id)
        spec, config = tdata.loss_config(loss_fn, loss_fn_config)
        tokens = tdata.check(data, loss_fn, spec, m.vocab, self.settings.max_tokens_per_call)
        t0 = time.perf_counter()
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total = 0.0
        for chunk in tdata.micro_batches(data, spec, self.settings.micro_batch_tokens, m.pad_id):
            b = chunk.batch.to(self.ranks.device)
            lp, _ = token_logprobs(m.module, b, 1.0, chunk_tokens=self.settings.chunk_tokens)
            inputs = {k: v.to(self.ranks.device) for k, v in chunk.inputs.items()}
            token_loss = elementwise_loss(loss_fn, lp, inputs, config, b.present)
            loss = token_loss.sum()
            if backward:
                loss.backward()
            total += float(loss.detach())
            lp_np, el_np = lp.detach().cpu().numpy(), token_loss.detach().cpu().numpy()
            for row, (i, shape) in enumerate(zip(chunk.index, chunk.shapes)):
                width = int(np.prod(shape))
                outputs[i]["logprobs"] = lp_np[row, :width].reshape(shape).copy()
                if loss_fn == "cross_entropy":
                    outputs[i]["elementwise_loss"] = el_np[row, :width].reshape(shape).copy()
        seconds = time.perf_counter() - t0
        kind = "forward_backward" if backward else "forward"
        m.count(f"{kind}_calls")
        m.count(f"{kind}_tokens", tokens)
        m.count(f"{kind}_seconds", seconds)
        m.counters["last_loss_sum"] = total
        return ForwardResult(outputs, {"loss:sum": total})

    def optim_step(self, model_id: str, adam: dict) -> dict:
        """One AdamW step (torch's, which is Tinker's) with these AdamParams on the gradients
        accumulated since the last step, which it then clears. `grad_clip_norm` > 0 clips their
        global norm first. A step with no gradient accumulated changes nothing; one on gradients
        that are not finite is refused (InvalidInputError) and drops them."""
        m = self._get(model_id)
        params = _adam_params(adam)
        t0 = time.perf_counter()
        for group in m.optimizer.param_groups:
            group["lr"] = params["learning_rate"]
            group["betas"] = (params["beta1"], params["beta2"])
            group["eps"] = params["eps"]
            group["weight_decay"] = params["weight_decay"]
        trainable = m.trainable()
        with_grad = [p for p in trainable if p.grad is not None]
        clip = params["grad_clip_norm"] if params["grad_clip_norm"] > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(with_grad, clip) if with_grad else torch.zeros(())
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # a DTensor under FSDP2
        if not np.isfinite(norm):  # AdamW would write NaN into every adapter, for good
            m.optimizer.zero_grad(set_to_none=True)
            m.count("optim_steps_refused")
            raise InvalidInputError(
                f"the accumulated gradients are not finite (norm {norm}): the step is not applied and they "
                "are dropped; the loss inputs overflowed (see the forward_backward's loss:sum)"
            )
        if with_grad:
            m.optimizer.step()
            m.step += 1
        m.optimizer.zero_grad(set_to_none=True)
        m.count("optim_steps", 1.0 if with_grad else 0.0)
        m.count("optim_step_seconds", time.perf_counter() - t0)
        m.counters["last_grad_norm"] = norm
        return {"grad_norm": norm, "learning_rate": params["learning_rate"], "step": float(m.step)}

    # ---- weights ------------------------------------------------------------------------

    def save_for_sampler(self, model_id: str, name: str, keep: bool = False) -> dict:
        """The adapter as a PEFT directory `<weights_root>/<model_id>/v<version>`, written as the
        async LoRA path writes its versions (`DiskPublisher`): a new version per call, never
        rewritten; the engines load it with /load_lora_adapter under `adapter_name`. The
        publisher keeps the newest `keep_sampler_versions` of them; `keep` (a save the client
        named) also links the version into `<weights_root>/<model_id>/kept/`, which nothing
        prunes, and that is the path returned: a named sampler checkpoint outlives later saves."""
        from asyncrl.services.transport.weights import adapter_name
        from asyncrl.trainer.lora import adapter_state_dict
        from asyncrl.trainer.model import DTYPES
        from asyncrl.trainer.publish import cast_state

        m = self._get(model_id)
        state.check_name(name, "sampler weights name")
        tensors = cast_state(adapter_state_dict(m.module), DTYPES[self.settings.publish_dtype])
        version = m.sampler_version + 1
        out = m.publisher.write(version, tensors)
        m.sampler_version = version
        m.count("sampler_bytes", out.nbytes)
        path = _kept(Path(out.path), self.weights_root / model_id / KEPT_DIR) if keep else out.path
        return {
            "name": name,
            "adapter_name": adapter_name(model_id, version),
            "adapter_path": path,
            "version": version,
            "lora_rank": m.lora.rank,
            "bytes": out.nbytes,
        }

    def save_state(self, model_id: str, name: str, optimizer: bool, extra: dict) -> str:
        """A checkpoint of the adapters and the AdamW state (state.py); `optimizer` False is
        accepted and the state saved anyway (a load chooses whether to use it)."""
        m = self._get(model_id)
        return state.save(self.checkpoints_root, self.ranks, m, name, extra)

    def load_state(self, model_id: str, path: str, optimizer: bool) -> dict:
        return state.load(self.checkpoints_root, self.ranks, self._get(model_id), path, optimizer)

    def checkpoint_info(self, path: str) -> dict:
        """What a checkpoint was saved from (base model, lora_config, step, extra): for creating
        a model to load it into (the SDK's create_training_client_from_state)."""
        return state.read_meta(state.resolve(self.checkpoints_root, path))

    # ---- metrics ------------------------------------------------------------------------

    def metrics(self) -> dict[str, dict[str, float]]:
        out = {}
        for model_id, m in list(self._models.items()):
            out[model_id] = {
                **m.counters,
                "step": float(m.step),
                "sampler_version": float(m.sampler_version),
                "adapter_parameters": float(sum(p.numel() for p in m.trainable())),
                "shares_base": float(m.shares_base),
            }
        return out


def _kept(version_dir: Path, kept_root: Path) -> str:
    """`version_dir` hard-linked (no bytes copied; its files were fsynced when written) into
    `kept_root`, published whole (`atomic_publish_dir`)."""
    from asyncrl.trainer.checkpoint import atomic_publish_dir

    kept_root.mkdir(parents=True, exist_ok=True)
    final, tmp = kept_root / version_dir.name, kept_root / f".tmp-{version_dir.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(version_dir, tmp, copy_function=os.link)
    atomic_publish_dir(tmp, final, written=[])
    return str(final)


def _adam_params(adam: dict) -> dict[str, float]:
    """The SDK's AdamParams (its defaults for keys left out), checked."""
    given = dict(adam or {})
    if given.get("type", "adamw") not in ("adam", "adamw"):
        raise UnsupportedError(f"optimizer {given['type']!r} is not supported: AdamW only")
    given.pop("type", None)
    unknown = sorted(set(given) - set(ADAM_KEYS))
    if unknown:
        raise InvalidInputError(f"adam_params {unknown} are unknown; AdamParams has {list(ADAM_KEYS)}")
    defaults = {"learning_rate": 1e-4, "beta1": TINKER_BETAS[0], "beta2": TINKER_BETAS[1], "eps": TINKER_EPS}
    out = {k: given.get(k, defaults.get(k, 0.0)) for k in ADAM_KEYS}
    for key, value in out.items():
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not np.isfinite(value)
            or value < 0
        ):
            raise InvalidInputError(f"adam_params {key} must be a finite number >= 0, not {value!r}")
    for key in ("beta1", "beta2"):
        if out[key] >= 1.0:
            raise InvalidInputError(f"adam_params {key} must be below 1, not {out[key]}")
    return {k: float(v) for k, v in out.items()}
