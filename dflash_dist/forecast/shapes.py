"""The shapes of the target and the drafter, as the memory model needs them: from the config (the tiny
target), the target's config.json (transformers models, MoE included), or a built-in table of public
models, so that a config can be checked on a machine without the weights."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dflash_dist.config import Config, default_target_layer_ids

# Llama-family targets whose decoder layer the capture accounting describes (dense, or with the routed
# experts of transformers' Qwen3-MoE and Mixtral blocks); others are "unsure".
KNOWN_ARCHS = ("qwen3", "qwen2", "llama", "mistral", "tiny", "qwen3_moe", "mixtral")

# Built-in shapes, to evaluate a config without the weights (sources: the models' config.json on the Hub:
# Qwen/Qwen3-8B, meta-llama/Llama-3.3-70B-Instruct, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B).
TARGET_SHAPES = {
    "qwen3-8b": dict(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128,
                     intermediate=12288, tied=False, arch="qwen3"),
    "llama-3.3-70b": dict(vocab=128256, hidden=8192, layers=80, heads=64, kv_heads=8, head_dim=128,
                          intermediate=28672, tied=False, arch="llama"),
    # Every layer sparse (decoder_sparse_step 1, no mlp_only_layers); intermediate_size is used by no layer.
    "qwen3-30b-a3b": dict(vocab=151936, hidden=2048, layers=48, heads=32, kv_heads=4, head_dim=128,
                          intermediate=6144, tied=False, arch="qwen3_moe", experts=128, experts_per_token=8,
                          moe_intermediate=768, sparse_layers=tuple(range(48))),
    "qwen3-235b-a22b": dict(vocab=151936, hidden=4096, layers=94, heads=64, kv_heads=4, head_dim=128,
                            intermediate=12288, tied=False, arch="qwen3_moe", experts=128, experts_per_token=8,
                            moe_intermediate=1536, sparse_layers=tuple(range(94))),
}
# A model directory's name is matched to a built-in shape without these release suffixes.
_RELEASE_SUFFIX = re.compile(r"-(instruct|base|chat)(-\d+)?$")


@dataclass(frozen=True)
class ModelShapes:
    """Target and drafter shapes: all the memory model needs of the models."""
    vocab: int
    hidden: int
    layers: int  # target decoder layers
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    tied: bool  # target's LM head is its embedding
    draft_layers: int
    draft_heads: int
    draft_kv_heads: int
    draft_head_dim: int
    draft_intermediate: int
    feature_layers: tuple[int, ...]  # target layer ids whose outputs the drafter reads
    block_size: int
    arch: str = "tiny"
    source: str = "config"  # where the target's shape came from
    # Mixture of experts (0 / empty: a dense target): routed experts per sparse layer, experts per token,
    # one expert's MLP width, and the layer ids whose MLP is the experts (the others: `intermediate`).
    experts: int = 0
    experts_per_token: int = 0
    moe_intermediate: int = 0
    sparse_layers: tuple[int, ...] = ()

    def _layer_params(self, sparse: bool) -> tuple[int, int]:
        """(parameters a tensor-parallel replica shards, parameters every rank holds whole) of one target
        decoder layer: projections and MLP or experts; norms (two, plus Qwen3's q/k norms) and the router."""
        H, Q, K = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        whole = 2 * H + (2 * self.head_dim if self.arch in ("qwen3", "qwen3_moe", "tiny") else 0)
        sharded = H * (Q + 2 * K) + Q * H + (Q + 2 * K if self.arch == "qwen2" else 0)  # Qwen2: q/k/v biases
        if sparse:
            return sharded + 3 * self.experts * H * self.moe_intermediate, whole + self.experts * H
        return sharded + 3 * H * self.intermediate, whole

    def target_param_split(self) -> tuple[int, int]:
        """(sharded, whole): the target's parameters a tensor-parallel replica divides among its ranks
        (projections, experts, embedding and LM head, each split by transformers' TP plan) and those every
        rank holds whole (norms, routers)."""
        sparse = len(self.sparse_layers)
        per = [self._layer_params(True)] * sparse + [self._layer_params(False)] * (self.layers - sparse)
        embed = self.vocab * self.hidden * (1 if self.tied else 2)
        return embed + sum(a for a, _ in per), self.hidden + sum(b for _, b in per)

    @property
    def target_params(self) -> int:
        return sum(self.target_param_split())

    @property
    def draft_params(self) -> int:
        H, Q, K = self.hidden, self.draft_heads * self.draft_head_dim, self.draft_kv_heads * self.draft_head_dim
        layer = H * (Q + 2 * K) + Q * H + 3 * H * self.draft_intermediate + 2 * H + 2 * self.draft_head_dim
        return len(self.feature_layers) * H * H + H + self.draft_layers * layer + H


def builtin_shape_name(path: str) -> str | None:
    """The built-in shape a model directory is named like (case aside, and without a release suffix:
    /models/Llama-3.3-70B-Instruct -> llama-3.3-70b), else None."""
    name = _RELEASE_SUFFIX.sub("", Path(path).name.lower())
    return name if name in TARGET_SHAPES else None


def model_shapes(cfg: Config, target_shape: str | None = None) -> ModelShapes:
    """Shapes from the config: the tiny target's fields, or for kind=hf the target's config.json. Without
    one (a machine without the weights), the built-in `target_shape`, or the table entry named like the
    target's directory (`builtin_shape_name`: /models/Qwen3-8B -> qwen3-8b); `source` says which."""
    tc = cfg.model.target
    if tc.kind == "tiny":
        t = dict(vocab=tc.vocab_size, hidden=tc.hidden_size, layers=tc.num_layers, heads=tc.num_heads,
                 kv_heads=tc.num_kv_heads, head_dim=tc.head_dim, intermediate=tc.intermediate_size, tied=False,
                 arch="tiny", source="config (tiny target)")
    else:
        from dflash_dist.models.head import read_config, shape_facts
        conf = Path(tc.path) / "config.json"
        named = builtin_shape_name(tc.path)
        if conf.is_file():
            raw = read_config(tc.path)
            f = shape_facts(raw, str(conf))
            t = dict(vocab=f["vocab_size"], hidden=f["hidden_size"], layers=f["num_layers"], heads=f["num_heads"],
                     kv_heads=f["num_kv_heads"], head_dim=f["head_dim"], intermediate=f["intermediate_size"],
                     tied=f["tied"], arch=str(raw.get("model_type", "?")), source=str(conf))
            if "num_experts" in f:
                t |= dict(experts=f["num_experts"], experts_per_token=f["experts_per_token"],
                          moe_intermediate=f["moe_intermediate_size"], sparse_layers=f["sparse_layers"])
        elif target_shape or named:
            key = target_shape or named
            if key not in TARGET_SHAPES:
                raise ValueError(f"--target-shape {key!r}: one of {sorted(TARGET_SHAPES)}")
            how = "given" if target_shape else "named like model.target.path, which has no config.json"
            t = dict(TARGET_SHAPES[key], source=f"built-in shape {key} ({how})")
        else:
            raise FileNotFoundError(f"model.target.path={tc.path}: no config.json; give a built-in shape "
                                    f"(--target-shape {'|'.join(TARGET_SHAPES)})")
    d = cfg.model.draft
    ids = tuple(d.target_layer_ids) or tuple(default_target_layer_ids(t["layers"], d.num_feature_layers))
    return ModelShapes(**t, draft_layers=d.num_layers, draft_heads=d.num_heads or t["heads"],
                       draft_kv_heads=d.num_kv_heads or t["kv_heads"], draft_head_dim=d.head_dim or t["head_dim"],
                       draft_intermediate=d.intermediate_size or t["intermediate"], feature_layers=ids,
                       block_size=cfg.objective.block_size)


def layout_problem(gpus_per_node: int, drafters_per_node: int, tensor_parallel: int, nodes: int = 1,
                   colocated: bool = False) -> str | None:
    """Why train would refuse this node layout, or None: parallel.topology.Layout's own check, as train
    builds it (so a forecast never prices a layout the run refuses)."""
    from dflash_dist.parallel.topology import Layout, TopologyError
    try:
        Layout(gpus_per_node * nodes, gpus_per_node, drafters_per_node, colocated=colocated,
               tensor_parallel=tensor_parallel)
    except TopologyError as exc:
        return str(exc)
    return None


def layout_error(cfg: Config, gpus_per_node: int, nodes: int = 1) -> str | None:
    """`layout_problem` of the config's own roles (roles.drafters_per_node, roles.mode, tensor_parallel)."""
    return layout_problem(gpus_per_node, cfg.roles.drafters_per_node, cfg.model.target.tensor_parallel, nodes,
                          cfg.roles.mode == "colocated")


def check_target_split(cfg: Config, shapes: ModelShapes) -> None:
    """ValueError naming model.target.tensor_parallel when train would refuse to split this target over
    its replica's ranks: a transformers target must not have a head cut (the check loading applies), and
    colocated ranks each hold a whole target. The tiny target is replicated whole, so any split loads."""
    tp = cfg.model.target.tensor_parallel
    if cfg.roles.mode == "colocated":
        problem = layout_error(cfg, 1)
        if problem:
            raise ValueError(problem)
    if cfg.model.target.kind == "hf" and tp > 1:
        from dflash_dist.models.hf_target import check_head_split
        check_head_split(shapes.heads, shapes.kv_heads, tp)
