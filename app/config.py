"""The application's configuration: the `args` of a Serve config file, validated once at the boundary.

`build_app` turns the `args` mapping into an `AppConfig` (`AppConfig.from_args`),
resolves the model directory, and hands the frozen result to every deployment.
The model is a checkpoint directory (`model.path`) or, for shape-only runs, an
architecture (`model.architecture` plus `overrides`) served with seeded random
weights; the second needs `random_weights: true` said explicitly, so a production
config naming a checkpoint never falls back to random numbers.
Unknown fields are refused with their path and the names allowed there, so a typo
never falls back to a default in silence. `engine_config` passes only the fields
`EngineConfig` has and logs any others as not applied.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from engine.config import EngineConfig, check_device
from engine.model_config import ModelConfig
from engine.tiny import make_tiny, shaped_config, write_architecture
from residency.config import HiSparseConfig

logger = logging.getLogger(__name__)
_ARCHITECTURE_DIR_FORMAT = 2  # bumped when write_architecture writes a folder differently


class ConfigError(ValueError):
    """The Serve config's `args` are invalid; the message names the field and the fix."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class HiSparseArgs(_Section):
    """Hybrid HiSparse residency: where KV goes when GPU pages run short (vLLM's flag names)."""

    policy: Literal["hybrid", "offload", "preempt", "off"] = "off"
    """hybrid: demote mirrored pages, load selected rows back; offload: swap requests out; preempt; off: no host."""
    host_pool_gib: float = Field(0.0, ge=0)
    """Pinned host memory per replica for mirrored, demoted and swapped pages (hybrid and offload need > 0)."""
    offload_pool_gib: float = Field(0.0, ge=0)
    """Separate host budget for the indexer pages of waiting requests."""
    hot_rows: int | None = Field(None, ge=1)
    """Hot-buffer slots per demoted request; None = twice the model's top-K; at least top-K."""
    promote_free_fraction: float = Field(0.25, ge=0, lt=1)
    """A demoted request moves back to the GPU only if this share of the GPU pool stays free."""

    @field_validator("policy", mode="before")
    @classmethod
    def _yaml_off(cls, policy: Any) -> Any:
        """YAML 1.1 reads an unquoted `off` as the boolean false: `policy: off` means the policy `off`."""
        return "off" if policy is False else policy


class AttentionArgs(_Section):
    """Attention back-end settings."""

    hisparse_config: HiSparseArgs = HiSparseArgs()
    """Residency of the sparse-MLA KV cache."""


class EngineArgs(_Section):
    """One replica's engine."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Weights and activations; float32 is the reference mode."""
    kv_dtype: Literal["auto", "float32", "bf16", "fp8"] = "auto"
    """KV row format; auto = the model dtype; fp8 = 656-byte MLA rows at GLM shape."""
    device: str = "cpu"
    """Torch device of the replica: cpu or cuda."""
    num_gpu_pages: int | None = Field(None, ge=1)
    """KV pool size in pages; None = sized from kv_cache_gib."""
    kv_cache_gib: float = Field(0.25, gt=0)
    """KV pool size in GiB on a CPU when num_gpu_pages is not given."""
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    """Share of GPU memory for weights, KV pool and activations (sizes the pool on a GPU)."""
    activation_reserve_gib: float = Field(4.0, ge=0)
    """GPU workspace kept out of the KV pool."""
    max_num_seqs: int = Field(64, ge=1)
    """Most requests running at once in one replica."""
    max_num_batched_tokens: int = Field(2048, ge=1)
    """Token budget of one engine step (chunked prefill plus decodes)."""
    max_model_len: int | None = Field(None, ge=2)
    """Longest prompt plus output; None = the model's max_position_embeddings."""
    enable_prefix_cache: bool = True
    """Reuse computed pages of equal prompt prefixes (needed for P/D and multi-turn reuse)."""
    seed: int = 0
    """Seeds requests that bring no seed of their own."""
    random_weights: bool = False
    """Seeded random weights instead of loading the checkpoint (shape-only runs)."""
    quantization: Literal["auto", "fp8", "none"] = "auto"
    """Linear weights: auto keeps an FP8 block-quantised checkpoint FP8 in bfloat16; fp8 forces FP8; none dequantises."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one replica spans (the model's heads and MLP features are split over them)."""
    executor: Literal["mp", "ray"] = "mp"
    """How tensor-parallel ranks run: processes the replica spawns, or Ray actors in its placement group."""
    enforce_eager: bool = False
    """Decode steps run eagerly instead of as captured CUDA graphs over persistent buffers (debugging)."""
    async_scheduling: bool = True
    """The host prepares each step while the device runs the one before (off: strictly one after another)."""
    num_speculative_tokens: int = Field(0, ge=0)
    """Draft tokens per step from the model's MTP layers; 0 = off."""
    attention_config: AttentionArgs = AttentionArgs()
    """Attention and KV residency."""

    _device_spelling = field_validator("device")(check_device)

    @model_validator(mode="after")
    def _host_pool_for_policy(self) -> EngineArgs:
        hs = self.attention_config.hisparse_config
        if hs.policy in ("hybrid", "offload") and hs.host_pool_gib <= 0:
            raise ValueError(f"attention_config.hisparse_config.policy {hs.policy!r} needs host_pool_gib > 0")
        return self


class DeploymentArgs(_Section):
    """Ray Serve options of one deployment."""

    num_replicas: int = Field(1, ge=0)
    """Replicas of the deployment."""
    max_ongoing_requests: int = Field(64, ge=1)
    """Requests one replica serves at once; beyond it the router queues or picks another replica."""
    max_queued_requests: int = Field(-1, ge=-1)
    """Requests waiting for a replica before new ones are refused (HTTP 503); -1 = unbounded. Serve counts a
    request as waiting while it is being routed, even to an idle replica: a burst larger than this can see 503s
    before any replica is busy, so size it for bursts (tiny.yaml: 64)."""
    num_cpus: float = Field(1.0, ge=0)
    """CPUs Ray reserves per replica."""
    num_gpus: float = Field(0.0, ge=0)
    """GPUs Ray reserves per replica."""
    health_check_period_s: float = Field(10.0, gt=0)
    """Seconds between health checks (an engine whose loop died fails them)."""
    health_check_timeout_s: float = Field(30.0, gt=0)
    """Seconds a health check may take before the replica counts as unhealthy."""
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0)
    """Seconds a stopping replica waits for running requests before it is killed."""
    placement_group_bundles: list[dict[str, float]] | None = None
    """Resources of a placement group per replica (first bundle: the replica), e.g. one GPU bundle per rank."""
    placement_group_strategy: Literal["PACK", "STRICT_PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    """How the placement group's bundles are placed; STRICT_PACK keeps a replica's ranks on one node."""

    def serve_options(self) -> dict[str, Any]:
        """Keyword arguments for `Deployment.options`."""
        return {
            "num_replicas": self.num_replicas,
            "max_ongoing_requests": self.max_ongoing_requests,
            "max_queued_requests": self.max_queued_requests,
            "ray_actor_options": {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus},
            "health_check_period_s": self.health_check_period_s,
            "health_check_timeout_s": self.health_check_timeout_s,
            "graceful_shutdown_timeout_s": self.graceful_shutdown_timeout_s,
            **({"placement_group_bundles": self.placement_group_bundles,
                "placement_group_strategy": self.placement_group_strategy} if self.placement_group_bundles else {}),
        }


class IngressArgs(DeploymentArgs):
    """Ray Serve options of the ingress deployment (light: tokenizing, parsing, streaming)."""

    num_cpus: float = Field(0.0, ge=0)
    """CPUs Ray reserves per ingress replica."""
    max_ongoing_requests: int = Field(256, ge=1)
    """Requests one ingress replica serves at once (streams in flight)."""


class PrefillArgs(DeploymentArgs):
    """Ray Serve options of the prefill deployment."""

    num_replicas: int = Field(0, ge=0)
    """Prefill replicas; 0 = colocated (decode replicas prefill themselves)."""


class ApiArgs(_Section):
    """The OpenAI-compatible HTTP API."""

    api_key: str | None = None
    """Bearer key clients must send; prefer api_key_env or api_key_sha256, since Serve shows args in its dashboard."""
    api_key_env: str = "HISPARSE_API_KEY"
    """Environment variable holding the key, read where the app is built and where the ingress runs."""
    api_key_sha256: str | None = Field(None, pattern="^[0-9a-f]{64}$")
    """SHA-256 hex digest of the key: a config can require a key without holding it."""
    require_api_key: bool = False
    """Refuse to start the ingress when no key is found (instead of serving without one)."""
    max_body_bytes: int | None = Field(None, ge=1024)
    """Largest request body; None = 1 MiB plus 16 bytes per admissible prompt token."""
    body_timeout_s: float = Field(30.0, gt=0)
    """Seconds from a request's start within which its whole body must arrive, else HTTP 408: a request waiting on
    its body holds one of the ingress's max_ongoing_requests slots."""
    default_max_tokens: int = Field(256, ge=1)
    """Output tokens of a request that names no max_tokens."""
    max_prompt_tokens: int | None = Field(None, ge=1)
    """Admission limit: longer prompts get HTTP 400 at the ingress; None = only max_model_len applies."""

    @model_validator(mode="after")
    def _body_holds_the_longest_prompt(self) -> ApiArgs:
        """Each prompt token takes at least a byte of the body: a smaller body limit refuses prompts (413) that the
        admission limit says are welcome."""
        if self.max_body_bytes is not None and self.max_prompt_tokens is not None:
            if self.max_body_bytes < self.max_prompt_tokens:
                raise ValueError(f"max_body_bytes {self.max_body_bytes} cannot hold a prompt of max_prompt_tokens "
                                 f"{self.max_prompt_tokens} tokens (a byte a token at least); raise it or leave it "
                                 "unset (1 MiB plus 16 bytes a token)")
        return self

    def key_digest(self) -> str | None:
        """SHA-256 digest of the key from api_key, else api_key_sha256, else the api_key_env variable here."""
        if self.api_key is None and self.api_key_sha256 is not None:
            return self.api_key_sha256
        key = self.api_key or os.environ.get(self.api_key_env)
        return hashlib.sha256(key.encode()).hexdigest() if key else None

    def body_limit(self, max_model_len: int) -> int:
        """Bytes a request body may have: room for the longest admissible prompt as JSON, tools included."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return 2**20 + 16 * (self.max_prompt_tokens or max_model_len)


class DisaggArgs(_Section):
    """Prefill/decode disaggregation (used when prefill.num_replicas > 0)."""

    min_transfer_tokens: int | None = Field(None, ge=1)
    """Remote prefill only when this many prompt tokens are uncached on the decode replica; None = one indexer page."""
    prefill_timeout_s: float = Field(120.0, gt=0)
    """Seconds the decode replica waits for remote prefill and the export before prefilling locally."""
    prefill_accept_timeout_s: float = Field(10.0, gt=0)
    """Of those, seconds it waits for a prefill replica to accept the request (every one busy, or none running: one
    died and its replacement is starting) before prefilling locally. Meanwhile the request holds a decode slot."""


class RoutingArgs(_Section):
    """How the ingress picks a decode replica."""

    affinity: bool = True
    """Send the turns of one conversation to the replica that holds its prefix, unless it is saturated."""
    session_header: str = Field("x-session-id", pattern=r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
    """Request header naming a conversation (any case); without it the conversation's opening is the key."""
    prefix_tokens: int = Field(512, ge=1)
    """Completions without a session header: the first this many prompt tokens are the affinity key."""

    @field_validator("session_header")
    @classmethod
    def _lower_case(cls, name: str) -> str:
        """HTTP header names are case-insensitive and read lower-cased: `X-Session-Id` matched no chat request."""
        return name.lower()


class ModelSource(_Section):
    """Where the weights come from: a checkpoint directory (`path`), or an architecture that a shape-only
    run fills with seeded random weights (`architecture`, with `engine.random_weights: true`)."""

    path: str | None = None
    """Local Hugging Face model directory; $VAR and ${VAR} are read from the environment at build time."""
    create_tiny: bool = False
    """Write the tiny random-weight model to `path` when it has no config.json (the CPU demo)."""
    architecture: str | None = None
    """Instead of `path`: a config.json (or its directory) served at its shapes with random weights, tiny tokenizer."""
    overrides: dict[str, Any] = Field(default_factory=dict)
    """Fields replaced in `architecture`, e.g. num_hidden_layers (per-layer lists keep their first entries)."""

    @model_validator(mode="after")
    def _one_source(self) -> ModelSource:
        if (self.path is None) == (self.architecture is None):
            raise ValueError("give path (a checkpoint directory) or architecture (a config.json for random weights), "
                             "exactly one")
        if self.architecture is not None and self.create_tiny:
            raise ValueError("create_tiny writes a checkpoint to path; architecture needs none")
        if self.path is not None and self.overrides:
            raise ValueError("overrides change an architecture; a checkpoint in path keeps its own config.json")
        return self


class AppConfig(_Section):
    """Everything `build_app` needs: the `args` of the Serve application."""

    model_id: str = "glm-tiny"
    """Name clients send as `model` and see in /v1/models."""
    model: ModelSource
    """The checkpoint, or the architecture a shape-only run serves with random weights."""
    engine: EngineArgs = EngineArgs()
    """Engine of the decode replicas, and of the prefill replicas unless prefill_engine is set."""
    prefill_engine: EngineArgs | None = None
    """Engine of the prefill replicas when they differ (batch size, no host pool); same KV row format."""
    ingress: IngressArgs = IngressArgs()
    """The HTTP ingress deployment."""
    decode: DeploymentArgs = DeploymentArgs()
    """Decode replicas: own an engine, orchestrate remote prefill, generate."""
    prefill: PrefillArgs = PrefillArgs()
    """Prefill replicas: compute prompts and export their KV."""
    api: ApiArgs = ApiArgs()
    """HTTP API behaviour."""
    disagg: DisaggArgs = DisaggArgs()
    """Prefill/decode transfer."""
    routing: RoutingArgs = RoutingArgs()
    """Decode replica choice."""
    metrics_interval_s: float = Field(2.0, gt=0)
    """Seconds between engine gauge updates (running, waiting, pages)."""

    @model_validator(mode="after")
    def _needs_decode(self) -> AppConfig:
        if self.decode.num_replicas < 1:
            raise ValueError("decode.num_replicas must be at least 1")
        return self

    @model_validator(mode="after")
    def _same_rows_for_prefill(self) -> AppConfig:
        prefill = self.prefill_engine
        if prefill is not None and (prefill.dtype, prefill.kv_dtype) != (self.engine.dtype, self.engine.kv_dtype):
            raise ValueError("prefill_engine must keep engine's dtype and kv_dtype: their KV pages are exchanged")
        if prefill is not None and bool(prefill.num_speculative_tokens) != bool(self.engine.num_speculative_tokens):
            raise ValueError("prefill_engine and engine must both draft (num_speculative_tokens > 0) or neither: "
                             "drafting adds the MTP layer's rows to the KV pages they exchange")
        if prefill is not None and prefill.max_model_len is not None and (
                self.engine.max_model_len is None or prefill.max_model_len < self.engine.max_model_len):
            raise ValueError("prefill_engine.max_model_len must be at least engine's: the decode replicas send the "
                             "prefill replicas every prompt they admit")
        return self

    @model_validator(mode="after")
    def _prefix_cache_for_prefill(self) -> AppConfig:
        """A decode replica lands a prefill replica's KV in its prefix cache; with the cache off every long prompt
        would be computed twice, once there and once here."""
        if self.prefill.num_replicas and not self.engine.enable_prefix_cache:
            raise ValueError("engine.enable_prefix_cache must be true when prefill.num_replicas > 0: decode replicas "
                             "reuse prefilled KV through their prefix cache (or set prefill.num_replicas: 0)")
        return self

    @model_validator(mode="after")
    def _random_weights_for_architecture(self) -> AppConfig:
        """An architecture has no weights to load: the config must say so, so a production config that names
        a checkpoint never serves random numbers by accident."""
        if self.model.architecture is None:
            return self
        engines = {"engine": self.engine, "prefill_engine": self.prefill_engine}
        missing = [name for name, args in engines.items() if args is not None and not args.random_weights]
        if missing:
            raise ValueError(f"model.architecture has no weights: set {missing[0]}.random_weights: true for a "
                             "shape-only run, or give model.path (a checkpoint directory)")
        if self.prefill_engine is not None and self.prefill_engine.seed != self.engine.seed:
            raise ValueError("prefill_engine.seed must equal engine.seed: it seeds the random weights, and the "
                             "KV a prefill replica exports is only valid for the same model")
        return self

    @model_validator(mode="after")
    def _placement_groups_for_ray_ranks(self) -> AppConfig:
        """Ray ranks go into the replica's placement group, bundle 0 the replica and one bundle per rank."""
        pairs = (("decode", self.decode, self.engine), ("prefill", self.prefill, self.prefill_engine or self.engine))
        for name, deployment, args in pairs:
            bundles = deployment.placement_group_bundles
            if args.executor != "ray" or args.tensor_parallel_size == 1 or not deployment.num_replicas:
                continue
            if bundles is None or len(bundles) != args.tensor_parallel_size + 1:
                raise ValueError(f"{name}.placement_group_bundles needs {args.tensor_parallel_size + 1} bundles "
                                 f"(the replica, then one per rank) for executor ray at tensor_parallel_size "
                                 f"{args.tensor_parallel_size}")
        return self

    @classmethod
    def from_args(cls, args: dict[str, Any] | None) -> AppConfig:
        """Validates Serve `args`; raises `ConfigError` listing every problem."""
        try:
            return cls.model_validate(args or {})
        except ValidationError as exc:
            raise ConfigError(_describe(exc)) from None

    def resolved(self) -> AppConfig:
        """The config with an absolute, existing model directory (the tiny model, or an architecture's
        weightless directory, is written if asked) and the API key, if one is set here, carried as its digest
        (so it reaches the ingress in every mode)."""
        path = self._checkpoint_dir() if self.model.architecture is None else self._architecture_dir()
        model = ModelSource(path=str(path))
        api = self.api.model_copy(update={"api_key": None, "api_key_sha256": self.api.key_digest()})
        return self.model_copy(update={"model": model, "api": api})

    def _checkpoint_dir(self) -> Path:
        path = Path(_expand_env(self.model.path, "model.path")).expanduser().resolve()
        if not (path / "config.json").is_file():
            if not self.model.create_tiny:
                raise ConfigError(f"model.path {str(path)!r} has no config.json (set model.create_tiny for the demo)")
            logger.info("writing the tiny model to %s", path)
            make_tiny(path)
        return path

    def _architecture_dir(self) -> Path:
        """The architecture with its overrides, written once beside the tiny tokenizer under the temporary
        directory of the machine that builds the app (the replicas of a one-node app read it there), in a
        folder named by the content, so equal configs share it and a changed one never reads a stale one."""
        source = Path(_expand_env(self.model.architecture, "model.architecture")).expanduser().resolve()
        source = source / "config.json" if source.is_dir() else source
        if not source.is_file():
            raise ConfigError(f"model.architecture {str(source)!r} is not a config.json file")
        try:
            architecture = json.loads(source.read_text())
        except ValueError as exc:
            raise ConfigError(f"model.architecture {str(source)!r} is not JSON: {exc}") from None
        try:
            raw = shaped_config(architecture, self.model.overrides)
        except ValueError as exc:
            raise ConfigError(f"model.overrides: {exc}") from None
        # The directory's format is hashed too: a folder written before its tokenizer covered the whole
        # vocabulary is never read again.
        content = {"config": raw, "format": _ARCHITECTURE_DIR_FORMAT}
        digest = hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()[:16]
        out = Path(tempfile.gettempdir()) / "hisparse-models" / f"{raw.get('model_type', 'model')}-{digest}"
        if not (out / "config.json").is_file():
            try:
                _write_atomically(out, lambda tmp: write_architecture(tmp, raw))
            except ValueError as exc:  # the engine's own checks of the shapes
                raise ConfigError(f"model.architecture with model.overrides: {exc}") from None
        logger.info("serving %s with random weights from %s", source, out)
        return out

    def engine_config(self, role: Literal["decode", "prefill"] = "decode") -> EngineConfig:
        """The `EngineConfig` of a replica: fields the engine has; the others are logged as not applied.
        Needs a model directory: of an architecture, the one `resolved` writes."""
        if self.model.path is None:
            raise ConfigError("model.architecture: call resolved() first, which writes the model directory")
        args = self.prefill_engine if role == "prefill" and self.prefill_engine is not None else self.engine
        engine = args.model_dump(exclude={"attention_config"})
        hisparse = args.attention_config.hisparse_config.model_dump()
        try:
            config = EngineConfig(
                model=self.model.path,
                hisparse=HiSparseConfig(**_applicable(HiSparseConfig, hisparse, HiSparseArgs().model_dump())),
                **_applicable(EngineConfig, engine, EngineArgs().model_dump(exclude={"attention_config"})),
            )
            # checked against the model, as the engine does when it starts (the replica would fail there)
            config.hisparse.hot_rows_for(ModelConfig.from_dir(config.model).index_topk)
        except ValueError as exc:
            raise ConfigError(f"engine: {exc}") from None
        return config


def _applicable(target: type, values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The `values` that `target` (a dataclass) has fields for; set values it lacks are logged."""
    known = {f.name for f in dataclasses.fields(target)}
    skipped = sorted(k for k, v in values.items() if k not in known and v != defaults[k])
    if skipped:
        logger.warning("%s fields not applied (this engine does not have them yet): %s", target.__name__, skipped)
    return {k: v for k, v in values.items() if k in known}


def _expand_env(value: str, field: str) -> str:
    missing = [m.group(1) or m.group(2) for m in re.finditer(r"\$\{(\w+)\}|\$(\w+)", value)
               if (m.group(1) or m.group(2)) not in os.environ]
    if missing:
        raise ConfigError(f"{field} {value!r} names unset environment variables: {missing}")
    return os.path.expandvars(value)


def _write_atomically(out: Path, write: Callable[[Path], Any]) -> None:
    """Runs `write` into a fresh sibling of `out`, then renames it to `out`: a reader never sees half a
    directory, and of two builders writing the same content at once the second one's copy is dropped."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        write(tmp)
        tmp.rename(out)
    except OSError:
        if not (out / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _allowed_fields(loc: tuple[Any, ...]) -> list[str]:
    """Field names allowed at the section holding `loc`'s last key."""
    model: type[BaseModel] = AppConfig
    for key in loc[:-1]:
        field = model.model_fields.get(str(key))
        annotation = field.annotation if field else None
        sections = [a for a in (annotation, *typing.get_args(annotation))
                    if isinstance(a, type) and issubclass(a, BaseModel)]
        if not sections:
            return []
        model = sections[0]
    return sorted(model.model_fields)


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        loc = tuple(error["loc"])
        where = ".".join(["args", *(str(part) for part in loc)])  # a check across sections names no field
        if error["type"] == "extra_forbidden":
            lines.append(f"{where}: unknown field; allowed here: {', '.join(_allowed_fields(loc))}")
        else:
            lines.append(f"{where}: {error['msg']}")
    return "invalid application args:\n  " + "\n  ".join(lines)
