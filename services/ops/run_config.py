"""The run config: one TOML file, every table of it typed and checked before anything starts.

A run config holds the launcher's tables (`[run]`, `[model]`, `[launch]`, `[submit]`), the
demo's (`[demo]`) and each service's own (`[engine]`, `[rollout]`, `[reward]`, `[trainer]`,
the latter with `[trainer.loss]` and `[trainer.wandb]`). `RunConfig` validates all of them at
once with the services' own settings classes, so an unknown key or a wrong type in any table is
refused by whichever `asyncrl` command reads the file, with the table and the field named.

What the check covers: the file's values, over the `ASYNCRL_…` environment the command sees,
and for a service being started, its own table as its flags leave it (the flags replace the
file's values, as they do when the service loads its settings). Other services' flags are not
known here: the fields every launch passes on the command line (`COMMAND_LINE_FIELDS`) may be
left out of the file; the check fills them with `[model] path`, or a placeholder when the file
has no `[model]` table (compose and k8s pass them per container).

Importing this module pulls no torch: each service's settings module is torch-free.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from asyncrl.services.engine.config import LORA_TARGET_ALL, LORA_TARGET_NAMES, EngineSettings
from asyncrl.services.reward.config import RewardSettings
from asyncrl.services.rollout.config import RolloutSettings
from asyncrl.trainer.config import TrainerSettings

# SGLang flags that pick GPUs or multiply them: the launcher sets the GPUs from [launch] (engine_tp,
# engine_gpus; one engine per data-parallel replica), so engine_args may not (`--tp` and `--dp` are
# argparse's abbreviations of --tp-size and --dp-size).
SGLANG_PLACEMENT_FLAGS = frozenset(
    {
        "--tp",
        "--tp-size",
        "--tensor-parallel-size",
        "--base-gpu-id",
        "--dp",
        "--dp-size",
        "--data-parallel-size",
    }
)
GpuIndex = Annotated[int, Field(ge=0, le=1023)]


class RunSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field("default", min_length=1, max_length=64, description="run id: buffer namespace")
    dir: str = Field("runs/default", description="logs, model, weights, checkpoints and embedded Redis")
    redis_url: str | None = Field(None, description="external Redis; unset starts an embedded one")


class ModelSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="local HF model directory used by engines, rollout and trainer")
    build_tiny: bool = Field(False, description="build a tiny Qwen2 model + char tokenizer there if absent")
    tiny_chars: str | None = Field(None, description="vocabulary of the tiny model's char tokenizer")
    tiny_hidden_size: int = Field(128, gt=0)
    tiny_layers: int = Field(2, gt=0)
    tiny_tie_embeddings: bool = Field(
        True, description="share input embedding and LM head (Qwen2 default: no)"
    )
    seed: int = Field(0)


class LaunchSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    engine_kind: Literal["reference", "sglang"] = Field("reference", description="what `engines` starts")
    engine_args: list[str] = Field(default_factory=list, description="extra flags for each started engine")
    engines: int = Field(1, ge=0, le=64, description="engines to start")
    engine_urls: list[str] = Field(default_factory=list, description="external engines (SGLang) instead")
    engine_port: int = Field(30000, gt=0, lt=65536, description="port of engine 0; engine i uses +i")
    reward_replicas: int = Field(1, ge=1, le=64)
    reward_port: int = Field(8002, gt=0, lt=65536)
    rollout_replicas: int = Field(1, ge=1, le=64)
    rollout_port: int = Field(8001, gt=0, lt=65536)
    trainer: bool = Field(True, description="start the trainer")
    trainer_nproc_per_node: int = Field(1, ge=1, le=64)
    trainer_metrics_port: int = Field(8003, gt=0, lt=65536)
    health_timeout_s: float = Field(180.0, gt=0)
    # supervision (see the module docstring)
    max_restarts: int = Field(
        5,
        ge=0,
        le=10_000,
        description="restarts of each service (and of the embedded "
        "Redis) before one more crash stops the run; 0: the first crash stops it",
    )
    restart_backoff_s: float = Field(
        1.0,
        gt=0,
        le=600,
        description="delay before a service's first restart; doubles with each restart of that service",
    )
    restart_backoff_max_s: float = Field(30.0, gt=0, le=3600, description="longest delay before a restart")
    trainer_max_restarts: int = Field(
        3,
        ge=0,
        le=1000,
        description="torchrun --max-restarts: worker restarts "
        "within one trainer launch (each resumes from the last checkpoint)",
    )
    liveness_interval_s: float = Field(
        10.0,
        ge=0,
        description="probe running services' health this often; "
        "0: only an exit counts as a crash (the trainer is left to torchrun)",
    )
    liveness_failures: int = Field(
        6, ge=1, le=10_000, description="failed probes in a row that count as a crash"
    )
    redis_appendfsync: Literal["always", "everysec"] = Field(
        "always",
        description="embedded Redis AOF fsync: "
        "`always` keeps every acknowledged write across a Redis "
        "crash (exactly-once); `everysec` may lose the last ~1 s",
    )
    redis_reconnect_s: float = Field(
        120.0,
        gt=0,
        description="how long every client retries a lost Redis "
        "before it gives up (ASYNCRL_REDIS_RECONNECT_S)",
    )
    core_share: Literal["auto", "on", "off"] = Field(
        "off",
        description="a CPU engine and a one-rank CPU trainer lend each other their core while idle "
        "(services/runtime/cores.py); auto: on where both run on the CPU of a machine of at most "
        "4 cores, with one reference engine. Off by default: slower in every run measured so far "
        "(benchmarks/RESULTS.md)",
    )
    metrics_port: int = Field(
        8004,
        ge=0,
        lt=65536,
        description="the launcher's /metrics on 127.0.0.1 (restarts per service, up); 0: not served",
    )
    # GPU placement (services/ops/placement.py): engines on GPUs 0..k-1, the trainer on the next ones
    gpus: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="GPUs the run may use; unset: those the "
        "launcher's CUDA_VISIBLE_DEVICES lists, else `nvidia-smi -L`'s; 0: CPU, no placement",
    )
    engine_tp: int = Field(
        1,
        ge=1,
        le=64,
        description="GPUs per started SGLang engine, passed as its --tp-size (the reference engine uses one)",
    )
    engine_gpus: list[GpuIndex] | None = Field(
        None,
        max_length=1024,
        description="GPU indices of the started "
        "engines, engine i on entries [i*engine_tp, (i+1)*engine_tp); "
        "unset: the first engines*engine_tp GPUs",
    )
    trainer_gpus: list[GpuIndex] | None = Field(
        None,
        max_length=1024,
        description="GPU indices of the "
        "trainer, one per rank (as many as trainer_nproc_per_node); "
        "unset: the GPUs after the engines'",
    )
    allow_shared_gpus: bool = Field(
        False,
        description="let engines and the trainer share GPUs (models small "
        "enough for one GPU's memory together); otherwise a shared GPU is refused",
    )

    @model_validator(mode="after")
    def _one_tp_setting(self) -> LaunchSection:
        if self.engine_tp > 1 and self.engine_kind != "sglang":
            raise ValueError('engine_tp > 1 needs engine_kind = "sglang" (the reference engine uses one GPU)')
        for arg in self.engine_args:
            if arg.split("=")[0] in SGLANG_PLACEMENT_FLAGS:
                raise ValueError(
                    f"engine_args may not set {arg.split('=')[0]}: the launcher places engines on "
                    "GPUs itself; set [launch] engine_tp for tensor parallelism, engines for "
                    "data parallelism, engine_gpus to choose the GPUs"
                )
        return self


class ReasoningGymSource(BaseModel):
    """Prompts generated from a reasoning-gym dataset (`asyncrl submit --reasoning-gym`)."""

    model_config = ConfigDict(extra="forbid")
    dataset: str = Field(min_length=1, description="a reasoning-gym dataset name, e.g. gsm_symbolic")
    size: int = Field(ge=1, description="entries generated")
    seed: int = Field(0, ge=0, description="the dataset's seed")
    config: dict = Field(default_factory=dict, description="the dataset's other config fields")
    system_prompt: str = Field("default", description="one of reasoning-gym's SYSTEM_PROMPTS, or none")
    boxed_fallback: bool = Field(False, description="score a \\boxed{} answer when there is no <answer> tag")


class SubmitSection(BaseModel):
    """A dataset posted to rollout-0 once everything is healthy (`asyncrl submit`'s options)."""

    model_config = ConfigDict(extra="forbid")
    file: str | None = Field(
        None, description="JSONL of prompts: text | messages | input_ids, optional reward_spec"
    )
    reasoning_gym: ReasoningGymSource | None = Field(None, description="instead of `file`: generated prompts")
    group_size: int | None = Field(None, ge=1)
    sampling_params: dict | None = None
    reward_spec: dict | None = None
    idempotency_key: str | None = None

    @model_validator(mode="after")
    def _one_source(self) -> SubmitSection:
        if (self.file is None) == (self.reasoning_gym is None):
            raise ValueError("[submit] needs exactly one of `file` or `reasoning_gym`")
        if self.reasoning_gym is not None and self.reward_spec is not None:
            raise ValueError("[submit] reasoning_gym prompts carry their own reward spec; drop reward_spec")
        return self

    def source_args(self) -> list[str]:
        """The `asyncrl submit` arguments that name the prompts."""
        if self.file is not None:
            return [str(Path(self.file).resolve())]
        rg = self.reasoning_gym
        assert rg is not None
        args = ["--reasoning-gym", rg.dataset, "--size", str(rg.size), "--seed", str(rg.seed)]
        args += ["--config", json.dumps(rg.config), "--system-prompt", rg.system_prompt]
        return args + (["--boxed-fallback"] if rg.boxed_fallback else [])


class DemoEvalSet(BaseModel):
    """A math held-out set beside the main one (`[demo.eval_sets.NAME]`), evaluated at the same
    versions and reported under its own name (services/ops/tasks.py `HeldoutSet`); its problems
    are never trained on either."""

    model_config = ConfigDict(extra="forbid")
    level: Literal["easy", "hard"] = Field("hard", description="difficulty (services/ops/tasks.py LEVELS)")
    size: int = Field(200, ge=1, le=10_000, description="problems")
    seed: int = Field(1234, description="seed of the set (fixed across runs)")
    word_fraction: float = Field(0.4, ge=0, le=1, description="share of word problems")
    worked_example: bool = Field(
        False, description="ask each problem after one worked exchange that answers in \\boxed{}"
    )


class DemoSection(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task: Literal["reverse", "math", "secret"] = Field(
        "reverse",
        description="what to train on (services/ops/tasks.py; secret: a tool-use episode, configs/demo-tools.toml)",
    )
    prompts_per_step: int = Field(32, ge=1)
    group_size: int = Field(8, ge=2)
    letters: str = Field("abcdefghij", min_length=2, description="reverse: the alphabet")
    prompt_len: int = Field(
        3,
        ge=1,
        le=128,
        description="reverse: letters per prompt (= answer tokens; over 64 needs "
        "[rollout] and [engine] max_new_tokens_cap raised); secret: letters of the word",
    )
    tools: bool = Field(
        True, description="secret: the policy may call the lookup tool (false: the no-tool baseline)"
    )
    max_turns: int = Field(2, ge=1, le=8, description="secret: policy turns per episode")
    max_new_tokens: int = Field(256, ge=1, description="math: answer budget (EOS-terminated)")
    temperature: float = Field(1.0, gt=0, description="math: sampling temperature of training rollouts")
    word_fraction: float = Field(0.4, ge=0, le=1, description="math: share of word problems")
    level: Literal["easy", "hard"] = Field(
        "easy", description="math: difficulty (services/ops/tasks.py LEVELS)"
    )
    worked_example: bool = Field(
        False,
        description="math: ask every training problem and the main held-out set's after one worked "
        "exchange that answers in \\boxed{} (what strict math pays for), so rewards reach the "
        "arithmetic from the first step",
    )
    eval_size: int = Field(200, ge=0, description="math: held-out problems (0: no evaluation)")
    eval_seed: int = Field(1234, description="math: seed of the held-out set (fixed across runs)")
    eval_every: int = Field(
        10,
        ge=0,
        description="math: evaluate at version 0 and every this many versions "
        "(0: no evaluations; the held-out problems are still never trained on)",
    )
    eval_sets: dict[str, DemoEvalSet] = Field(
        default_factory=dict,
        description="math: more held-out sets by name, evaluated with the main one (named heldout)",
    )
    final_eval: bool = Field(True, description="math: evaluate the last served version before stopping")
    final_eval_timeout_s: float = Field(
        900, gt=0, description="math: how long to wait for the final evaluation"
    )
    target_reward: float | None = Field(
        None, gt=0, le=1, description="stop when the windowed reward reaches it (none: run to the time limit)"
    )
    target_window: int = Field(5, ge=1)
    time_limit_s: float = Field(300, gt=0)
    seed: int = 0

    @model_validator(mode="after")
    def _eval_set_names(self) -> DemoSection:
        from asyncrl.proto.evals import EVAL_NAME_PATTERN

        for name in self.eval_sets:
            if name == "heldout" or not re.fullmatch(EVAL_NAME_PATTERN, name):
                raise ValueError(
                    f"eval set name {name!r}: must match {EVAL_NAME_PATTERN} and not be the main set's, heldout"
                )
        return self


# The fields of a service's table that every launch gives on the command line (the launcher
# from `[model] path`; compose and k8s per container), so a run config may leave them out.
COMMAND_LINE_FIELDS = {"engine": ("model",), "rollout": ("tokenizer",), "trainer": ("model_path",)}
# What stands in for them when the file has no [model] table (the service is given the real one).
COMMAND_LINE_PLACEHOLDER = "<given on the command line>"


class RunConfig(BaseModel):
    """Every table of a run config; a table left out takes its defaults, an unknown table or key
    is refused."""

    model_config = ConfigDict(extra="forbid")

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection | None = Field(None, description="required by `asyncrl up` and `asyncrl demo`")
    launch: LaunchSection = Field(default_factory=LaunchSection)
    submit: SubmitSection | None = None
    demo: DemoSection = Field(default_factory=DemoSection)
    engine: EngineSettings
    rollout: RolloutSettings
    reward: RewardSettings = Field(default_factory=RewardSettings)
    trainer: TrainerSettings

    @model_validator(mode="before")
    @classmethod
    def _command_line_fields(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        model = data.get("model")
        path = model.get("path") if isinstance(model, dict) else None
        data = dict(data)
        for section, fields in COMMAND_LINE_FIELDS.items():
            table = data.get(section, {})
            if not isinstance(table, dict):
                continue  # the section's own validation names the wrong type
            data[section] = {**dict.fromkeys(fields, path or COMMAND_LINE_PLACEHOLDER), **table}
        return data

    @model_validator(mode="after")
    def _deltas_reach_sglang_by_broadcast(self) -> RunConfig:
        trainer = self.trainer
        if self.launch.engine_kind == "sglang" and trainer.publish == "disk" and trainer.publish_delta:
            raise ValueError(
                '[trainer] publish_delta with publish = "disk" cannot feed SGLang engines: SGLang\'s '
                "/update_weights_from_disk loads every *.safetensors of a directory with no base version "
                "to check, so an engine that skipped a version would serve a mix of two; use "
                'publish = "distributed" (deltas of whole tensors reach SGLang there)'
            )
        return self

    @model_validator(mode="after")
    def _engines_serve_the_trainers_adapters(self) -> RunConfig:
        lora, engine = self.trainer.lora, self.engine
        if not lora.enabled:
            return self
        self.lora_target_modules()  # (refuses a target no engine adapts)
        if engine.enable_lora and (engine.max_lora_rank or 0) < lora.rank:
            raise ValueError(
                f"[engine] max_lora_rank {engine.max_lora_rank} is below [trainer.lora] rank {lora.rank}: "
                "the engines would refuse every adapter the trainer publishes"
            )
        if engine.max_loaded_loras is not None and self.rollout.max_loaded_adapters > engine.max_loaded_loras:
            raise ValueError(
                f"[rollout] max_loaded_adapters {self.rollout.max_loaded_adapters} exceeds [engine] "
                f"max_loaded_loras {engine.max_loaded_loras}: the engine would evict adapters the rollout "
                "still counts on"
            )
        return self

    def lora_target_modules(self) -> str:
        """`[trainer.lora] target_modules` as the engines' `lora_target_modules` (SGLang's names)."""
        targets = self.trainer.lora.target_modules
        if isinstance(targets, str):  # all-linear: every linear layer of the decoder layers
            return LORA_TARGET_ALL
        names = list(dict.fromkeys(t.split(".")[-1] for t in targets))
        unknown = [n for n in names if n not in LORA_TARGET_NAMES]
        if unknown:
            raise ValueError(
                f"[trainer.lora] target_modules {unknown}: the engines adapt only {list(LORA_TARGET_NAMES)}"
            )
        return ",".join(names)

    def engine_lora_args(self) -> list[str]:
        """The flags a started engine needs to serve the trainer's adapters (none without
        `[trainer.lora]`): SGLang's `--enable-lora --max-lora-rank --lora-target-modules
        --max-loras-per-batch` (and `--max-loaded-loras` when [engine] sets it), taken from
        `[trainer.lora]` and `[engine]`. A reference engine reads them from `[engine]` when that
        table turns LoRA on; otherwise it gets them here too."""
        lora, engine = self.trainer.lora, self.engine
        if not lora.enabled:
            return []
        if self.launch.engine_kind == "reference" and engine.enable_lora:
            return []
        if self.launch.engine_kind == "sglang" and "--enable-lora" in self.launch.engine_args:
            return []
        rank = max(lora.rank, engine.max_lora_rank or 0)
        args = ["--enable-lora", "--max-lora-rank", str(rank), "--lora-target-modules"]
        # (SGLang takes the modules as separate arguments, the reference engine as one list)
        targets = self.lora_target_modules()
        args += targets.split(",") if self.launch.engine_kind == "sglang" else [targets]
        if self.launch.engine_kind == "sglang":
            args += ["--max-loras-per-batch", str(engine.max_loras_per_batch)]
            if engine.max_loaded_loras is not None:
                args += ["--max-loaded-loras", str(engine.max_loaded_loras)]
        return args

    @property
    def engine_on_gpu(self) -> bool:
        """Whether a started reference engine uses a GPU ([engine] device; SGLang always does)."""
        return self.engine.device != "cpu"

    @property
    def trainer_on_gpu(self) -> bool:
        return self.trainer.device != "cpu"

    @property
    def nccl_weight_group(self) -> bool:
        """The trainer publishes weights over an NCCL group, which constrains where engines run."""
        trainer = self.trainer
        return (
            self.trainer_on_gpu and trainer.publish == "distributed" and trainer.broadcast_backend != "gloo"
        )


class RunConfigError(ValueError):
    """A run config refused: one line per problem, each naming its table and field."""

    def __init__(self, path: Path | str, problems: list[str]):
        self.path, self.problems = path, problems
        lines = [f"{path}: {problems[0]}"] if len(problems) == 1 else [f"{path}:", *problems]
        super().__init__("\n  ".join(lines))


# The table each service reads, and its settings (`asyncrl <command> --config FILE`).
SERVICE_TABLES: dict[str, tuple[str, type[BaseModel]]] = {
    "engine": ("engine", EngineSettings),
    "rollout": ("rollout", RolloutSettings),
    "reward": ("reward", RewardSettings),
    "train": ("trainer", TrainerSettings),
}


def load_run_config(
    path: Path, *, require: tuple[str, ...] = (), command: str | None = None, argv: list[str] = ()
) -> RunConfig:
    """Read and validate the whole run config at `path`; `require` names tables that must be there
    (`("model",)` for the commands that launch a topology). For a service `command` started with
    `argv`, its own table is checked as the service will see it: the fields its flags set
    replace the file's. Raises RunConfigError."""
    try:
        data = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise RunConfigError(path, [f"cannot read it: {exc.strerror}"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise RunConfigError(path, [f"not TOML: {exc}"]) from None
    if command in SERVICE_TABLES:
        data = _with_flags(data, *SERVICE_TABLES[command], list(argv))
    return validate_run_config(data, path, require=require)


def _with_flags(data: dict, table: str, settings: type[BaseModel], argv: list[str]) -> dict:
    """`data` with the fields that `argv` sets (the service's own flags) in `table`."""
    from asyncrl.services.runtime.config import flag_values, settings_parser

    args, _ = settings_parser(settings, prog=table).parse_known_args(argv)  # (others: the command's own)
    flags = flag_values(args)
    if not flags or not isinstance(data.get(table, {}), dict):
        return data
    return {**data, table: {**data.get(table, {}), **flags}}


def validate_run_config(
    data: dict, path: Path | str = "run config", *, require: tuple[str, ...] = ()
) -> RunConfig:
    """`RunConfig` of parsed TOML `data`, its problems raised as one RunConfigError."""
    missing = [f"[{name}]: this table is required here" for name in require if name not in data]
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise RunConfigError(path, missing + [describe(error, data) for error in exc.errors()]) from None
    if missing:
        raise RunConfigError(path, missing)
    return config


def describe(error: dict, data: dict) -> str:
    """One pydantic error as `[table.subtable] field: message`: the leading parts of its location
    that are tables of `data` name the table, the rest the field."""
    loc = [str(part) for part in error["loc"]]
    tables: list[str] = []
    node: Any = data
    for part in loc:
        if not isinstance(node, dict) or not isinstance(node.get(part), dict):
            break
        tables.append(part)
        node = node[part]
    field = ".".join(loc[len(tables) :])
    message = error["msg"].removeprefix("Value error, ")
    if not loc:  # a check across tables: its message names them
        return message
    if not field and error["type"] == "extra_forbidden":
        return f"[{'.'.join(tables)}]: unknown table"
    if not tables:  # a top-level key that is not a table (or a whole table of the wrong type)
        return f"[{field}]: {message}"
    return f"[{'.'.join(tables)}] {field}: {message}" if field else f"[{'.'.join(tables)}]: {message}"
