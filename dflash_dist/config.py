"""The typed config tree: schema defaults <- YAML file <- key=value overrides.

Everything a run does is decided here, before any process group forms, so a bad key or value is
reported once (exit code 2) instead of as a hang on some other rank.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key."""


@dataclass
class TargetConfig:
    kind: str = "tiny"  # tiny: built-in Qwen3-style LM with seeded random weights; hf: transformers
    path: str = ""  # local directory for kind=hf
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    seed: int = 1234  # weights of the tiny target
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 192
    num_layers: int = 6
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    tensor_parallel: int = 1  # ranks per target replica (one node); the replica's first rank sends


@dataclass
class DraftConfig:
    num_layers: int = 1
    # 0 = same as the target (the drafter's hidden size always follows the target's).
    intermediate_size: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    # Empty = the DFlash rule: one id spread per drafted feature layer over [1, L-3].
    target_layer_ids: list[int] = field(default_factory=list)
    num_feature_layers: int = 3  # used only when target_layer_ids is empty
    mask_token_id: int = -1  # -1: the tokenizer's mask token / first unused row (hf), last row (tiny)
    seed: int = 4321  # drafter initialisation
    checkpoint_layers: bool = False  # recompute each draft layer in backward (activations: one layer's)


@dataclass
class ModelConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)


@dataclass
class SyntheticConfig:
    num_samples: int = 1200
    min_len: int = 40
    max_len: int = 160
    prompt_frac: float = 0.3  # leading share of each sample that is prompt (not supervised)
    noise: float = 0.1  # share of tokens drawn at random; the rest follow a seeded rule
    seed: int = 7
    # Replace each response by the target's own greedy continuation of its prompt, as DFlash data is
    # made in practice, so that a trained drafter can be accepted by its target (cached on disk).
    regenerate: bool = True


@dataclass
class DataConfig:
    path: str = ""  # prepared dataset directory; empty = the seeded synthetic corpus
    cache_dir: str = "runs/cache"  # regenerated corpora, keyed by target and corpus settings
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


@dataclass
class PlanConfig:
    token_budget: int = 1024  # real tokens per batch (49,152 in the reference run)
    max_seqs: int = 64
    max_anchors: int = 0  # 0 = no cap on anchors per batch
    packing: str = "fill"  # fill: next-fit of the long half, gaps filled with the short half; next_fit; sorted (plan.py)


@dataclass
class RolesConfig:
    mode: str = "disaggregated"  # colocated: every rank runs target then drafter (N=1 allowed)
    drafters_per_node: int = 1
    drafter_sharding: str = "ddp"  # ddp: replicas, gradients averaged; fsdp: FSDP2 shards among drafters


@dataclass
class ObjectiveConfig:
    block_size: int = 16
    num_anchors: int = 16  # per sequence (512 in the reference recipes)
    gamma: float = 0.0  # 0 = the paper's rule: 7 for B=16, 5 for B=10, 4 for B=8
    # data: the corpus tokens; target_argmax / target_soft: distillation from the target's logits
    # (its greedy token / its top-k softmax), which makes every target run its whole forward.
    labels: str = "data"
    soft_top_k: int = 8  # logits per token sent for target_soft
    # Drafter memory follows these, not the batch: anchors per forward/backward inside one optimizer
    # step (0 = all of the batch's at once), and block rows per LM-head + cross-entropy chunk.
    anchor_chunk: int = 0
    loss_rows: int = 8192
    # step: the step's summed weighted loss over all drafters' batches divided by the all-reduced sum of
    # weights (every trained (token, slot) of a step counts the same, as SpecForge does); batch: the mean
    # over the step's batches of each batch's own weighted mean.
    loss_norm: str = "step"


@dataclass
class OptimConfig:
    lr: float = 1e-2
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_ratio: float = 0.05
    grad_clip: float = 1.0


@dataclass
class TransportConfig:
    max_in_flight: int = 2  # packets a target may run ahead of each drafter
    dtype: str = "auto"  # feature transfer dtype; auto = the target's compute dtype


@dataclass
class DistConfig:
    backend: str = "auto"  # auto: nccl with CUDA, gloo otherwise
    # Collectives may legitimately wait through a compile or a checkpoint save; dead peers are found by
    # the heartbeats within dead_after_s, so this is only the last resort.
    timeout_s: float = 1800.0
    heartbeat_s: float = 1.0
    dead_after_s: float = 15.0  # a peer whose heartbeat is older than this is reported dead
    # Memory pre-flight: the device size the memory model checks the worst batch against. 0 = the
    # device's own (CUDA only; no check on CPU); a value forces the check at that size anywhere.
    device_memory_gib: float = 0.0


@dataclass
class MonitorConfig:
    interval_s: float = 2.0


@dataclass
class WandbConfig:
    mode: str = "offline"  # online | offline | disabled; WANDB_MODE in the environment overrides it
    init_timeout_s: float = 20.0  # online start-up wait; then wandb logs offline (upload later: wandb sync)
    project: str = "dflash_dist"
    name: str = ""


@dataclass
class TrainConfig:
    epochs: int = 3
    seed: int = 0  # plan shuffle and anchor draws
    run_dir: str = "runs/default"
    export: bool = True
    eval_prompts: int = 12  # held-out prompts for tau before/after training (rank 0; 0 = skip)
    eval_new_tokens: int = 40
    resume: str = "auto"  # auto: newest complete checkpoint of run_dir; none; or a checkpoint directory
    checkpoint_every_steps: int = 0  # 0 = off
    checkpoint_every_min: float = 0.0  # 0 = off
    keep_last: int = 3  # checkpoints kept (0 = all)
    sync_every: int = 2  # steps between stop votes (>= transport.max_in_flight); a stop lands within 3 windows
    max_nonfinite_steps: int = 3  # steps skipped for a non-finite loss or gradient norm before the run stops


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    roles: RolesConfig = field(default_factory=RolesConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    transport: TransportConfig = field(default_factory=TransportConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


_CHOICES = {
    "model.target.kind": ("tiny", "hf"),
    "model.target.dtype": ("auto", "float32", "bfloat16", "float16"),
    "plan.packing": ("fill", "next_fit", "sorted"),
    "roles.mode": ("disaggregated", "colocated"),
    "roles.drafter_sharding": ("ddp", "fsdp"),
    "objective.labels": ("data", "target_argmax", "target_soft"),
    "objective.loss_norm": ("step", "batch"),
    "transport.dtype": ("auto", "float32", "bfloat16", "float16"),
    "dist.backend": ("auto", "gloo", "nccl"),
    "wandb.mode": ("online", "offline", "disabled"),
}


def _error_key(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
    return str(key) if key else "?"


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Schema <- YAML <- dotlist. Raises ConfigError naming the offending key or file."""
    schema = OmegaConf.structured(Config)
    layers = [schema]
    if path:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            layers.append(OmegaConf.load(p))
        except Exception as exc:  # yaml errors carry line numbers in their text
            raise ConfigError(f"cannot parse config file {path}: {exc}") from exc
    for item in overrides or []:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} is not key=value")
    try:
        if overrides:
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"config key '{_error_key(exc)}': {msg}") from exc
    validate(cfg)
    return cfg


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def validate(cfg: Config) -> None:
    """Checks that need no process group and no model weights (those come in `models.build.draft_spec`)."""
    for key, choices in _CHOICES.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(f"config key '{key}': {_get(cfg, key)!r} is not one of {choices}")
    positive = [
        "plan.token_budget", "plan.max_seqs", "objective.num_anchors", "train.epochs",
        "transport.max_in_flight", "dist.timeout_s", "monitor.interval_s", "optim.lr", "wandb.init_timeout_s",
        "model.target.vocab_size", "model.target.hidden_size", "model.target.num_layers",
        "model.target.num_heads", "model.target.num_kv_heads", "model.target.head_dim",
        "model.draft.num_layers", "data.synthetic.num_samples", "data.synthetic.min_len",
        "objective.loss_rows", "train.max_nonfinite_steps", "model.target.tensor_parallel",
    ]
    for key in positive:
        if not _get(cfg, key) > 0:
            raise ConfigError(f"config key '{key}': must be > 0, got {_get(cfg, key)!r}")
    if cfg.objective.block_size < 2:
        raise ConfigError(f"config key 'objective.block_size': must be >= 2, got {cfg.objective.block_size}")
    if cfg.objective.soft_top_k < 1:
        raise ConfigError(f"config key 'objective.soft_top_k': must be >= 1, got {cfg.objective.soft_top_k}")
    if cfg.objective.labels == "target_soft" and cfg.model.target.kind == "tiny" \
            and cfg.objective.soft_top_k > cfg.model.target.vocab_size:
        raise ConfigError(f"config key 'objective.soft_top_k': {cfg.objective.soft_top_k} exceeds the target's "
                          f"vocabulary ({cfg.model.target.vocab_size})")
    if cfg.roles.drafters_per_node < 1:
        raise ConfigError("config key 'roles.drafters_per_node': must be >= 1")
    if cfg.train.sync_every < cfg.transport.max_in_flight:
        raise ConfigError("config key 'train.sync_every': must be >= transport.max_in_flight "
                          f"({cfg.train.sync_every} < {cfg.transport.max_in_flight})")
    for key in ("train.checkpoint_every_steps", "train.keep_last", "train.checkpoint_every_min"):
        if _get(cfg, key) < 0:
            raise ConfigError(f"config key '{key}': must be >= 0")
    if not 0 < cfg.dist.heartbeat_s < cfg.dist.dead_after_s:
        raise ConfigError("config key 'dist.dead_after_s': must exceed dist.heartbeat_s > 0")
    if cfg.objective.anchor_chunk < 0:
        raise ConfigError("config key 'objective.anchor_chunk': must be >= 0 (0 = all anchors at once)")
    if cfg.plan.max_anchors < 0:
        raise ConfigError("config key 'plan.max_anchors': must be >= 0")
    s = cfg.data.synthetic
    if s.max_len < s.min_len:
        raise ConfigError("config key 'data.synthetic.max_len': must be >= data.synthetic.min_len")
    if not 0.0 <= s.prompt_frac < 1.0:
        raise ConfigError("config key 'data.synthetic.prompt_frac': must be in [0, 1)")
    if not 0.0 <= s.noise <= 1.0:
        raise ConfigError("config key 'data.synthetic.noise': must be in [0, 1]")
    if not 0.0 <= cfg.optim.warmup_ratio < 1.0:
        raise ConfigError("config key 'optim.warmup_ratio': must be in [0, 1)")
    if cfg.model.target.kind == "hf" and not cfg.model.target.path:
        raise ConfigError("config key 'model.target.path': required when model.target.kind=hf")
    t = cfg.model.target
    if t.num_heads % t.num_kv_heads:
        raise ConfigError("config key 'model.target.num_kv_heads': must divide model.target.num_heads")


def loss_gamma(cfg: ObjectiveConfig) -> float:
    """The paper's decay: gamma 7 for B=16, 5 for B=10, 4 for B=8; else interpolate linearly."""
    if cfg.gamma > 0:
        return cfg.gamma
    table = {16: 7.0, 10: 5.0, 8: 4.0}
    if cfg.block_size in table:
        return table[cfg.block_size]
    return max(1.0, 4.0 + (cfg.block_size - 8) * 3.0 / 8.0)


def default_target_layer_ids(num_target_layers: int, num_feature_layers: int) -> list[int]:
    """The DFlash rule: one layer -> [L // 2]; otherwise n ids spread evenly over [1, L - 3], rounded
    with Python's `round` (half to even) on start + i * span / (n - 1), as z-lab's reference, SpecForge and
    SGLang compute it: 94 layers and 5 ids give [1, 24, 46, 68, 91] (half up would say 69)."""
    if num_feature_layers == 1:
        return [num_target_layers // 2]
    lo, hi = 1, num_target_layers - 3
    if hi < lo:
        raise ConfigError(
            f"config key 'model.draft.num_feature_layers': a {num_target_layers}-layer target is too "
            f"shallow for {num_feature_layers} feature layers; give model.draft.target_layer_ids")
    span = hi - lo
    return [int(round(lo + (i * span) / (num_feature_layers - 1))) for i in range(num_feature_layers)]


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def from_dict(d: dict) -> Config:
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), d))  # type: ignore[return-value]
