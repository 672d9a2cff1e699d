"""The typed config tree: schema defaults <- YAML file <- key=value overrides.

Everything a run does is decided here, before any process group forms, so a bad key or value is
reported once (exit code 2) instead of as a hang on some other rank.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import logging
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config key or value is wrong; the message names the key."""


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: finite (NaN and infinities never are), within the bounds given
    (`ge`/`gt` below, `le`/`lt` above). Declared on the schema's fields by `num`, checked by `validate`."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def allows(self, v: float) -> bool:
        return (math.isfinite(v) and (self.ge is None or v >= self.ge) and (self.gt is None or v > self.gt)
                and (self.le is None or v <= self.le) and (self.lt is None or v < self.lt))

    def __str__(self) -> str:
        lo = f"[{self.ge:g}" if self.ge is not None else f"({self.gt:g}" if self.gt is not None else None
        hi = f"{self.le:g}]" if self.le is not None else f"{self.lt:g})" if self.lt is not None else None
        if lo and hi:
            return f"a finite number in {lo}, {hi}"
        if lo:
            return f"a finite number {'>=' if lo[0] == '[' else '>'} {lo[1:]}"
        return f"a finite number {'<=' if hi[-1] == ']' else '<'} {hi[:-1]}" if hi else "a finite number"


def num(default, *, ge=None, gt=None, le=None, lt=None):
    """A numeric schema field with its range: the one place where a key's allowed values are declared."""
    return field(default=default, metadata={"range": Range(ge=ge, gt=gt, le=le, lt=lt)})


def one_of(default: str, *choices: str):
    """A string schema field and the values it may take: the one place where they are declared
    (`choices()` reads them; `validate` checks them; PACKINGS and the like are views of it)."""
    if default not in choices:
        raise ValueError(f"default {default!r} is not one of {choices}")
    return field(default=default, metadata={"choices": tuple(choices)})


def ranged(kind: type, *, ge=None, gt=None, le=None, lt=None):
    """An argparse `type=` for a numeric command-line flag with its range (the `num` of flags): the text
    is parsed as `kind` (int or float) and must lie in the Range, NaN and infinities never do. A bad value
    is argparse's usage error, exit 2: "argument --nodes: must be a finite number >= 1, got 0"."""
    rng = Range(ge=ge, gt=gt, le=le, lt=lt)

    def parse(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not {'a whole number' if kind is int else 'a number'}") from None
        if not rng.allows(v):
            raise argparse.ArgumentTypeError(f"must be {rng}, got {text}")
        return v

    parse.__name__ = kind.__name__  # what argparse names in its own messages
    parse.range = rng
    return parse


@dataclass
class TargetConfig:
    kind: str = one_of("tiny", "tiny", "hf")  # tiny: built-in Qwen3-style LM with seeded random weights; hf: transformers
    path: str = ""  # local directory for kind=hf
    dtype: str = one_of("auto", "auto", "float32", "bfloat16", "float16")  # auto: bfloat16 on CUDA, float32 on CPU
    seed: int = num(1234, ge=0)  # weights of the tiny target
    vocab_size: int = num(128, ge=1)
    hidden_size: int = num(64, ge=1)
    intermediate_size: int = num(192, ge=1)
    num_layers: int = num(6, ge=1)
    num_heads: int = num(4, ge=1)
    num_kv_heads: int = num(2, ge=1)
    head_dim: int = num(16, ge=1)
    rope_theta: float = num(10000.0, gt=0)
    rms_eps: float = num(1e-6, gt=0)
    tensor_parallel: int = num(1, ge=1)  # ranks per target replica (one node); the replica's first rank sends


@dataclass
class DraftConfig:
    num_layers: int = num(1, ge=1)
    # 0 = same as the target (the drafter's hidden size always follows the target's).
    intermediate_size: int = num(0, ge=0)
    num_heads: int = num(0, ge=0)
    num_kv_heads: int = num(0, ge=0)
    head_dim: int = num(0, ge=0)
    # Empty = the DFlash rule: one id spread per drafted feature layer over [1, L-3].
    target_layer_ids: list[int] = field(default_factory=list)
    num_feature_layers: int = num(3, ge=1)  # used only when target_layer_ids is empty
    mask_token_id: int = num(-1, ge=-1)  # -1: the tokenizer's mask token / first unused row (hf), last row (tiny)
    seed: int = num(4321, ge=0)  # drafter initialisation
    checkpoint_layers: bool = False  # recompute each draft layer in backward (activations: one layer's)
    # A name of models/variants' registry: dflash (the DFlash drafter), dflash2, dspark, domino, and any
    # registered through DFLASH_VARIANTS. Its options (model and loss knobs) are the config's `variant`
    # section, typed and checked by the variant (`models.variants.check_config`); config.py names none.
    variant: str = "dflash"


@dataclass
class ModelConfig:
    target: TargetConfig = field(default_factory=TargetConfig)
    draft: DraftConfig = field(default_factory=DraftConfig)


@dataclass
class SyntheticConfig:
    num_samples: int = num(1200, ge=1)
    min_len: int = num(40, ge=1)
    max_len: int = num(160, ge=1)
    prompt_frac: float = num(0.3, ge=0, lt=1)  # leading share of each sample that is prompt (not supervised)
    noise: float = num(0.1, ge=0, le=1)  # share of tokens drawn at random; the rest follow a seeded rule
    seed: int = num(7, ge=0)
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
    token_budget: int = num(1024, ge=1)  # real tokens per batch (49,152 in the reference run)
    max_seqs: int = num(64, ge=1)
    max_anchors: int = num(0, ge=0)  # 0 = no cap on anchors per batch
    packing: str = one_of("fill", "fill", "next_fit", "sorted")  # fill: next-fit of the long half, gaps filled with the short half; next_fit; sorted (plan/epochs.py)
    # A sample longer than token_budget: skip (counted by the plan) or truncate (its first token_budget
    # tokens, or the target's max_position_embeddings if fewer, are trained; counted). plan/long_samples.py.
    long_samples: str = one_of("skip", "skip", "truncate")
    # The share of the dataset's supervised tokens the plan may skip: more refuses the run at start (exit 2),
    # any is a WARNING; both name the plan.token_budget that keeps every sample. 1 = never refuse.
    max_skipped_share: float = num(0.05, ge=0, le=1)


@dataclass
class RolesConfig:
    mode: str = one_of("disaggregated", "disaggregated", "colocated")  # colocated: every rank runs target then drafter (N=1 allowed)
    drafters_per_node: int = num(1, ge=1)
    drafter_sharding: str = one_of("ddp", "ddp", "fsdp")  # ddp: replicas, gradients averaged; fsdp: FSDP2 shards among drafters


@dataclass
class ObjectiveConfig:
    block_size: int = num(16, ge=2)
    num_anchors: int = num(16, ge=1)  # per sequence (512 in the reference recipes)
    gamma: float = num(0.0, ge=0)  # 0 = the paper's rule: 7 for B=16, 5 for B=10, 4 for B=8
    # data: the corpus tokens; target_argmax / target_soft: distillation from the target's logits
    # (its greedy token / its top-k softmax), which makes every target run its whole forward.
    # target_full: from the target's whole next-token distribution, softmax(lm_head(last)), which the
    # drafter computes in its loss's row chunks from the target's final-normed last hidden state (sent as
    # one more feature block): forward KL and the L1 distance, weighted by the two keys below.
    labels: str = one_of("data", "data", "target_argmax", "target_soft", "target_full")
    soft_top_k: int = num(8, ge=1)  # logits per token sent for target_soft
    distill_kl_weight: float = num(1.0, ge=0)  # target_full: KL(p_target || q_drafter) per trained slot
    distill_l1_weight: float = num(0.0, ge=0)  # target_full: ||q_drafter - p_target||_1 per trained slot
    # Drafter memory follows these, not the batch: anchors per forward/backward inside one optimizer
    # step (0 = all of the batch's at once), and block rows per LM-head + cross-entropy chunk.
    anchor_chunk: int = num(0, ge=0)
    loss_rows: int = num(8192, ge=1)
    # step: the step's summed weighted loss over all drafters' batches divided by the all-reduced sum of
    # weights (every trained (token, slot) of a step counts the same, as SpecForge does); batch: the mean
    # over the step's batches of each batch's own weighted mean.
    loss_norm: str = one_of("step", "step", "batch")
    # gamma: the fixed decay exp(-(k-1)/gamma) per block slot k; dpace: D-PACE (arXiv 2605.18810), each
    # block's weights from the drafter's own confidences (training/objective.py), the summed loss then
    # divided by the step's (or batch's) number of blocks instead of its weight sum. Hard labels only.
    position_weights: str = one_of("gamma", "gamma", "dpace")
    dpace_alpha: float = num(0.5, gt=0, le=1)  # D-PACE's confidence smoothing (1 - a) * q + a (the paper's 0.5)


@dataclass
class OptimConfig:
    lr: float = num(1e-2, gt=0)
    min_lr_ratio: float = num(0.1, ge=0, le=1)  # the cosine decays to lr * this
    weight_decay: float = num(0.0, ge=0)
    beta1: float = num(0.9, ge=0, lt=1)
    beta2: float = num(0.95, ge=0, lt=1)
    warmup_ratio: float = num(0.05, ge=0, lt=1)
    grad_clip: float = num(1.0, ge=0)  # 0 = no clipping


@dataclass
class TransportConfig:
    max_in_flight: int = num(2, ge=1)  # packets a target may run ahead of each drafter
    dtype: str = one_of("auto", "auto", "float32", "bfloat16", "float16")  # feature transfer dtype; auto = the target's compute dtype


@dataclass
class DistConfig:
    backend: str = one_of("auto", "auto", "gloo", "nccl")  # auto: nccl with CUDA, gloo otherwise
    # Collectives may legitimately wait through a compile or a checkpoint save; dead peers are found by
    # the heartbeats within dead_after_s, so this is only the last resort.
    timeout_s: float = num(1800.0, gt=0)  # must exceed dead_after_s + 2 * heartbeat_s (see `validate`)
    heartbeat_s: float = num(1.0, ge=0.05)
    dead_after_s: float = num(15.0, ge=1)  # a peer whose heartbeat is older than this is reported dead
    # Memory pre-flight: the device size the memory model checks the worst batch against. 0 = the
    # device's own (CUDA only; no check on CPU); a value forces the check at that size anywhere.
    device_memory_gib: float = num(0.0, ge=0)


@dataclass
class MonitorConfig:
    interval_s: float = num(2.0, gt=0)


@dataclass
class WandbConfig:
    mode: str = one_of("offline", "online", "offline", "disabled")  # online | offline | disabled; WANDB_MODE in the environment overrides it
    init_timeout_s: float = num(20.0, gt=0)  # online start-up wait; then wandb logs offline (upload later: wandb sync)
    project: str = "dflash_dist"
    name: str = ""


@dataclass
class TrainConfig:
    epochs: int = num(3, ge=1)
    seed: int = num(0, ge=0)  # plan shuffle and anchor draws
    run_dir: str = "runs/default"
    export: bool = True
    eval_prompts: int = num(12, ge=0)  # held-out prompts for tau before/after training (rank 0; 0 = skip)
    eval_new_tokens: int = num(40, ge=1)
    # {"turns": [...]} JSONL (or token-id JSONL) tau is measured on, through the target's chat template;
    # "" = the synthetic held-out set (prepared data has none: set this). Rank 0 then holds the whole target.
    eval_bench: str = ""
    eval_every_steps: int = num(0, ge=0)  # tau also every N optimizer steps (0: before and after training only)
    resume: str = "auto"  # auto: newest complete checkpoint of run_dir; none; or a checkpoint directory
    checkpoint_every_steps: int = num(0, ge=0)  # 0 = off
    checkpoint_every_min: float = num(0.0, ge=0)  # 0 = off
    keep_last: int = num(3, ge=0)  # checkpoints kept (0 = all)
    sync_every: int = num(2, ge=1)  # steps between stop votes (>= transport.max_in_flight); a stop lands within 3 windows
    max_nonfinite_steps: int = num(3, ge=1)  # steps skipped for a non-finite loss or gradient norm before the run stops


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
    # The drafter variant's options (model.draft.variant names it): given as a mapping, made the variant's
    # typed options value (its `Options` dataclass, defaults filled) by the registry's rule when the config
    # is validated, so a loaded config, its summary and its checkpoints carry every option's value.
    variant: Any = field(default_factory=dict)


def _error_key(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or getattr(exc, "key", None)
    return str(key) if key else "?"


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Schema <- YAML <- dotlist. Raises ConfigError naming the offending key or file. A key a variant
    renamed (`add_aliases`) is taken under its new name in the same layer, with a WARNING."""
    schema = OmegaConf.structured(Config)
    layers, lifted = [schema], []
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
        for i in range(1, len(layers)):
            layers[i], used = _lift_aliases(OmegaConf.to_container(layers[i]))
            lifted += used
        merged = OmegaConf.merge(*layers)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as exc:
        msg = str(exc).splitlines()[0]
        raise ConfigError(f"config key '{_error_key(exc)}': {msg}") from exc
    _check_lifted(lifted, cfg.model.draft.variant)
    validate(cfg)
    return cfg


# Keys a variant renamed when its knobs became its `variant` section: old dotted key -> (the variant,
# its option's name). The registry adds them (`add_aliases`), so config.py still names no variant.
_ALIASES: dict[str, tuple[str, str]] = {}
_WARNED: set[str] = set()


def add_aliases(variant: str, keys: dict[str, str]) -> None:
    """Take each old dotted key of `keys` as `variant.<its new name>` (variant `variant`'s option)."""
    for old, new in keys.items():
        _ALIASES[old] = (variant, new)


def _pop(d: dict, dotted: str):
    """Remove and return d's nested value at `dotted` (KeyError where there is none); empty parents go too."""
    head, _, rest = dotted.partition(".")
    if not rest:
        return d.pop(head)
    if not isinstance(d.get(head), dict):
        raise KeyError(dotted)
    value = _pop(d[head], rest)
    if not d[head]:
        del d[head]
    return value


def _renamed(d: dict):
    """(old key, its variant, its option, value) of each renamed key `d` holds, removed from `d`."""
    for old, (variant, new) in _ALIASES.items():
        try:
            yield old, variant, new, _pop(d, old)
        except KeyError:
            continue


def _lift_aliases(layer: dict) -> tuple[dict, list[tuple[str, str, str]]]:
    """One config layer with its renamed keys moved to their `variant.` names; (old, variant, new) each."""
    used = []
    for old, variant, new, value in _renamed(layer):
        section = layer.setdefault("variant", {})
        if not isinstance(section, dict):
            raise ConfigError(f"config key 'variant': a mapping of the variant's options, got {section!r}")
        if new in section and section[new] != value:
            raise ConfigError(f"config key '{old}': is 'variant.{new}' now, and both are given ({value!r}, "
                              f"{section[new]!r}): give 'variant.{new}' only")
        section[new] = value
        used.append((old, variant, new))
    return layer, used


def _check_lifted(lifted: list[tuple[str, str, str]], variant: str) -> None:
    """A renamed key is its variant's option: under another variant it is refused, naming both keys."""
    for old, owner, new in lifted:
        if owner != variant:
            raise ConfigError(f"config key '{old}': an option of model.draft.variant={owner} (now 'variant.{new}'), "
                              f"and model.draft.variant is {variant}")
        if old not in _WARNED:
            _WARNED.add(old)
            log.warning("config key '%s' is 'variant.%s' now: taken as that (write the new key)", old, new)


def upgrade_dict(d: dict) -> dict:
    """A config dict written before the variants' options became the `variant` section (a checkpoint's,
    a summary's), in today's form: the renamed keys of its own variant under `variant`, every other
    variant's (a flat schema carried them all, at their defaults) dropped."""
    d = copy.deepcopy(d)
    own = (d.get("model", {}).get("draft") or {}).get("variant", "dflash")
    for _, variant, new, value in _renamed(d):
        if variant == own:
            d.setdefault("variant", {}).setdefault(new, value)
    return d


def parse_section(node: type, data: Any, prefix: str, owner: str) -> Any:
    """`data` (a mapping, or a dataclass value of any type) as the typed dataclass `node`, its defaults
    filled, each value checked as the schema's are (type, `one_of`, `num`): a ConfigError names the key
    `prefix.<field>`, and a key `node` does not have names what `owner` takes."""
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        data = dataclasses.asdict(data)
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix}': a mapping of {owner}'s options, got {data!r}")
    names = [f.name for f in dataclasses.fields(node)]
    unknown = sorted(set(data) - set(names))
    if unknown:
        raise ConfigError(f"config key '{prefix}.{unknown[0]}': not an option of {owner} (its options: "
                          f"{', '.join(names) or 'none'})")
    try:
        value = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(node), data))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config key '{prefix}.{_error_key(exc)}': {str(exc).splitlines()[0]}") from exc
    _check_values(value, node, prefix + ".")
    return value


def _get(cfg: Config, dotted: str) -> Any:
    obj: Any = cfg
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def ranges(node: Any = Config, prefix: str = "") -> dict[str, "Range"]:
    """Every numeric key of the schema (dotted) -> its declared Range; a numeric key without one is None."""
    out: dict[str, Range | None] = {}
    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        key, tp = f"{prefix}{f.name}", hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(ranges(tp, key + "."))
        elif tp in (int, float):
            out[key] = f.metadata.get("range")
    return out


def choices(node: Any = Config, prefix: str = "") -> dict[str, tuple[str, ...]]:
    """Every key of the schema declared with `one_of` (dotted) -> the values it may take."""
    out: dict[str, tuple[str, ...]] = {}
    hints = typing.get_type_hints(node)
    for f in dataclasses.fields(node):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(choices(hints[f.name], key + "."))
        elif "choices" in f.metadata:
            out[key] = f.metadata["choices"]
    return out


def _check_values(obj: Any, node: type, prefix: str = "") -> None:
    """Each `one_of` key of `obj` (a `node` value) among its choices, each numeric key in its Range."""
    for key, allowed in choices(node, prefix).items():
        if _get(obj, key[len(prefix):]) not in allowed:
            raise ConfigError(f"config key '{key}': {_get(obj, key[len(prefix):])!r} is not one of {allowed}")
    for key, rng in ranges(node, prefix).items():
        v = _get(obj, key[len(prefix):])
        if rng is not None and not rng.allows(v):
            raise ConfigError(f"config key '{key}': must be {rng}, got {v!r}")


# Rules a layer above adds to `validate`: config.py imports nothing of the project and names no variant,
# so the variant registry (models/variants/__init__.py, imported with any module of models/) adds the
# variants' own: the name is a registered one, and that variant's rules on the loaded keys
# (`Variant.check_config`). A process that never imports models/ builds no drafter either.
_RULES: list[Callable[[Config], None]] = []


def add_rule(rule: Callable[[Config], None]) -> None:
    """Have `validate` (so `load_config`) run `rule(cfg)` after its own checks; a ConfigError it raises
    names the key."""
    if rule not in _RULES:
        _RULES.append(rule)


def validate(cfg: Config) -> None:
    """Checks that need no process group and no model weights (those come in `models.build.draft_spec`):
    each numeric key against the range its schema field declares, then the rules that relate keys. The
    rule that a variant's loss weights train something is the variant's (`models.variants.check_objective`,
    which `train.main` runs right after this)."""
    _check_values(cfg, Config)
    if cfg.objective.labels == "target_soft" and cfg.model.target.kind == "tiny" \
            and cfg.objective.soft_top_k > cfg.model.target.vocab_size:
        raise ConfigError(f"config key 'objective.soft_top_k': {cfg.objective.soft_top_k} exceeds the target's "
                          f"vocabulary ({cfg.model.target.vocab_size})")
    if cfg.objective.position_weights == "dpace" and cfg.objective.labels in ("target_soft", "target_full"):
        raise ConfigError("config key 'objective.position_weights': dpace needs hard labels (objective.labels=data "
                          "or target_argmax): its confidence is the drafter's probability of the one label token")
    if cfg.train.sync_every < cfg.transport.max_in_flight:
        raise ConfigError("config key 'train.sync_every': must be >= transport.max_in_flight "
                          f"({cfg.train.sync_every} < {cfg.transport.max_in_flight})")
    _check_liveness(cfg.dist)
    s = cfg.data.synthetic
    if s.max_len < s.min_len:
        raise ConfigError("config key 'data.synthetic.max_len': must be >= data.synthetic.min_len")
    if cfg.model.target.kind == "hf" and not cfg.model.target.path:
        raise ConfigError("config key 'model.target.path': required when model.target.kind=hf")
    t = cfg.model.target
    if t.num_heads % t.num_kv_heads:
        raise ConfigError("config key 'model.target.num_kv_heads': must divide model.target.num_heads")
    for rule in _RULES:  # the variant's own, which the registry adds (models/variants/__init__.py)
        rule(cfg)


def _check_liveness(d: "DistConfig") -> None:
    """The watchdog reads heartbeats every heartbeat_s: a peer is silent only after several missed beats
    (one late beat of a busy host is no death). A collective that gives up (dist.timeout_s) before the
    watchdog can name a dead peer (dead_after_s, plus two beats to see it) fails without saying who died."""
    if d.dead_after_s < 3 * d.heartbeat_s:
        raise ConfigError(f"config key 'dist.dead_after_s': must be >= 3 x dist.heartbeat_s "
                          f"({d.dead_after_s:g} < 3 x {d.heartbeat_s:g}): a peer is declared dead only after "
                          "several missed heartbeats")
    if d.timeout_s <= d.dead_after_s + 2 * d.heartbeat_s:
        raise ConfigError(f"config key 'dist.timeout_s': must exceed dist.dead_after_s + 2 x dist.heartbeat_s "
                          f"({d.timeout_s:g} <= {d.dead_after_s + 2 * d.heartbeat_s:g}): a collective must not give "
                          "up before the watchdog can name a dead peer")


def measures_tau(cfg: Config) -> bool:
    """Whether the run measures tau (rank 0, by real decoding): eval prompts asked for, a prompt set (the
    synthetic held-out one, or train.eval_bench: prepared data has no held-out split), and a target a
    single rank can hold whole (tensor_parallel 1). Rank 0 then holds the whole target (train.build, the
    memory model)."""
    return cfg.train.eval_prompts > 0 and cfg.model.target.tensor_parallel == 1 and \
        (not cfg.data.path or bool(cfg.train.eval_bench))


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
    """A config from its `to_dict` form (one written before the `variant` section too: `upgrade_dict`)."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), upgrade_dict(d)))  # type: ignore[return-value]
