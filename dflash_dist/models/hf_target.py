"""A transformers causal LM as the frozen target: the same interface as the built-in `TinyQwen3`.

`capture` runs the model's own decoder layers over a packed, padding-free batch. Position ids restart
per sequence (RoPE comes from the model's own rotary module, so scaled variants stay right), and the
attention never crosses a sequence boundary: while `capture` runs, the model's attention dispatch points
at a packed implementation that takes the batch's `cu_seqlens` through the layers' kwargs (the names of
transformers' own varlen kwargs) and runs `packed_causal_attention`, so the memory stays linear in tokens
(a dense block-diagonal mask over a 49K-token batch would not fit). Outside `capture` the model is left
exactly as loaded.

Supported: Qwen3, Llama, Mistral-style decoders (embed -> layers -> norm -> lm_head, rotary module on
the base model), dense or mixture-of-experts (Qwen3-MoE: the router is per token, so packing changes
nothing there). `load_hf_target` checks the packed path against the model's own forward on a short
input and refuses an architecture it does not reproduce.

Tensor parallelism (a target replica of several ranks, `tp_group`): the replica's ranks load the model
sharded by an existing engine, never by code of ours:
  "transformers"  transformers' own tensor-parallel loading (`DistributedConfig(tp_size=n)`: the model's
                  `base_model_tp_plan`, shard-on-read: each rank reads only its slices from the
                  safetensors). transformers builds its device mesh over the WHOLE world
                  (`initialize_distributed_mesh` asks world size == tp size), but a replica is a subgroup
                  of a world that also holds drafters and other replicas, so while `from_pretrained`
                  runs, that one function is pointed at a mesh over the replica's own group. MoE experts
                  are sharded along their intermediate size ("moe_tp_experts"), or with
                  `expert_parallel` whole experts per rank (ep_size = tp_size, "all_reduce" dispatch: the
                  replica's ranks share one batch, so no token exchange is needed).
  "torch"         for configs without a TP plan: the whole model is loaded on every rank, then
                  `torch.distributed.tensor.parallel.parallelize_module` shards each decoder layer
                  (q/k/v/gate/up column-wise, o/down row-wise); embeddings, lm_head and MoE experts
                  stay whole.
"auto" picks "transformers" when the config has a plan. Either way attention runs on the rank's own
heads (the packed path sees h / n query and h_kv / n key heads) and every layer's output is all-reduced,
so `capture` returns the full, unsharded features on every rank of the replica; the leader sends them.
Every rank of a replica must call `capture` (and the load-time self-check) with the same inputs in the
same order: the sharded forward is collective.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from dflash_dist.models.attention import packed_causal_attention
from dflash_dist.models.head import context_length, default_mask_token_id

log = logging.getLogger(__name__)

PACKED_ATTENTION = "dflash_packed"


def _packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      sliding_window=None, cu_seq_lens_q=None, max_length_q=None, **kwargs):
    """transformers attention-interface signature: query (1, h, N, d), key/value (1, h_kv, N, d);
    returns ((1, N, h, d), None)."""
    if cu_seq_lens_q is None or query.shape[0] != 1:
        raise RuntimeError("packed attention needs a batch of 1 and cu_seq_lens_q (only HFTarget.capture calls it)")
    if attention_mask is not None:
        raise RuntimeError("packed attention takes no attention mask: sequences are delimited by cu_seq_lens_q")
    d = query.shape[-1]
    if scaling is not None and abs(scaling - d ** -0.5) > 1e-6 * d ** -0.5:
        raise NotImplementedError(f"attention scaling {scaling} != head_dim**-0.5: not supported by the packed path")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("attention logit soft-capping is not supported by the packed path")
    # A window no shorter than the longest sequence masks nothing (transformers keeps kv > q - window).
    if sliding_window is not None and max_length_q is not None and max_length_q > sliding_window:
        raise NotImplementedError(f"sequence of {max_length_q} tokens exceeds the sliding window {sliding_window}")
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (N, heads, d)
    return packed_causal_attention(q, k, v, cu_seq_lens_q, max_seqlen=max_length_q).unsqueeze(0), None


def _register_packed_attention() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(PACKED_ATTENTION, _packed_attention)


def _rope_theta(cfg) -> float:
    """transformers 5 keeps rope_theta in config.rope_parameters; 4.x on the config itself."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        return float(params["rope_theta"])
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        raise ValueError(f"cannot find rope_theta in the {type(cfg).__name__} config")
    return float(theta)


def _set_shape(obj, config) -> None:
    """TinyQwen3's shape attributes (what draft_spec and the memory model read) from a transformers config."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    obj.config = cfg
    obj.vocab_size = cfg.vocab_size
    obj.hidden_size = cfg.hidden_size
    obj.num_layers = cfg.num_hidden_layers
    obj.num_heads = cfg.num_attention_heads
    obj.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    obj.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    obj.intermediate_size = cfg.intermediate_size
    obj.rope_theta = _rope_theta(cfg)
    obj.rms_eps = float(getattr(cfg, "rms_norm_eps", 1e-6))
    obj.max_position_embeddings = context_length(getattr(cfg, "max_position_embeddings", None))
    obj.num_experts = int(getattr(cfg, "num_experts", 0) or 0)  # 0: a dense model


class HFTarget(nn.Module):
    """Frozen, eval-mode wrapper with TinyQwen3's attributes and `capture` (a `Target`)."""
    kind = "hf"

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model
        base = getattr(hf_model, hf_model.base_model_prefix, None)
        missing = [n for n in ("embed_tokens", "layers", "norm", "rotary_emb") if not hasattr(base, n)]
        if base is None or missing or not hasattr(hf_model, "lm_head"):
            raise ValueError(f"{type(hf_model).__name__}: not a supported decoder-only layout "
                             f"(base model lacks {missing or 'everything'}; or no lm_head)")
        self._base_name = hf_model.base_model_prefix
        _set_shape(self, hf_model.config)
        self.tensor_parallel = 1  # ranks the weights are sharded over (set by load_hf_target)
        _register_packed_attention()
        for p in self.parameters():
            p.requires_grad_(False)
        self.eval()

    def _apply(self, fn, recurse=True):
        # Module.to(dtype) casts every float buffer, but RoPE's inverse frequencies must stay float32
        # (transformers loads them so): in bf16 the phases of late positions would drift.
        keep = {n: b for n, b in self.named_buffers() if n.endswith("inv_freq") and b.dtype == torch.float32}
        super()._apply(fn, recurse)
        for name, old in keep.items():
            owner, _, leaf = name.rpartition(".")
            mod = self.get_submodule(owner)
            mod._buffers[leaf] = old.to(device=mod._buffers[leaf].device)
        return self

    @property
    def base(self) -> nn.Module:
        return getattr(self.hf, self._base_name)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.base.embed_tokens

    @property
    def lm_head(self) -> nn.Linear:
        return self.hf.lm_head

    @contextlib.contextmanager
    def _packed(self):
        # Every attention module reads the shared config object at call time; restore it afterwards so
        # the wrapped model's own forward/generate keeps its original attention and masks.
        configs = list({id(c): c for c in (self.hf.config, self.config)}.values())  # text config may differ
        saved = [c._attn_implementation for c in configs]
        for c in configs:
            c._attn_implementation = PACKED_ATTENTION
        try:
            yield
        finally:
            for c, old in zip(configs, saved):
                c._attn_implementation = old

    @torch.no_grad()
    def capture(self, input_ids, cu_seqlens, position_ids, layer_ids, need_logits: bool = False,
                final_hidden: bool = False):
        """(features (N, len(layer_ids) * H), logits (N, V) or None; with `final_hidden`, the final normed
        hidden state (N, H) instead of the logits): layer i's output is hidden_states[i + 1] (for the very
        last layer: before the final norm, which transformers' hidden_states[-1] includes). Stops after
        the last captured layer unless logits or the final hidden state are asked for."""
        if not layer_ids:
            raise ValueError("capture needs at least one layer id")
        bad = [i for i in layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(f"layer ids {bad} outside the target's layers [0, {self.num_layers - 1}]")
        base = self.base
        cu = cu_seqlens.to(device=input_ids.device, dtype=torch.int64)
        max_len = int((cu[1:] - cu[:-1]).max())
        x = base.embed_tokens(input_ids)[None]
        pos = position_ids[None]
        rope = base.rotary_emb(x, pos)
        packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len, max_length_k=max_len)
        wanted, captured = set(layer_ids), {}
        last = self.num_layers if need_logits or final_hidden else max(layer_ids) + 1
        with self._packed():
            for i in range(last):
                out = base.layers[i](x, attention_mask=None, position_ids=pos, position_embeddings=rope, **packed)
                x = out[0] if isinstance(out, tuple) else out  # transformers 4.x layers return tuples
                if i in wanted:
                    captured[i] = x[0]
        feats = torch.cat([captured[i] for i in layer_ids], dim=-1)
        if not (need_logits or final_hidden):
            return feats, None
        return feats, self.lm_head(base.norm(x))[0] if need_logits else base.norm(x)[0]

    @torch.no_grad()
    def greedy(self, prompts: torch.Tensor, n: int) -> torch.Tensor:
        """Greedy continuation (b, n) of b prompts of equal length (b, L), with the model's KV cache.
        Equal lengths mean no padding, so no attention mask is needed."""
        from transformers import DynamicCache
        cache = DynamicCache()
        # transformers 5 renamed past_key_values to cache; take whichever this version has.
        cache_kw = "cache" if "cache" in inspect.signature(self.hf.forward).parameters else "past_key_values"
        out, ids = [], prompts
        for _ in range(n):
            logits = self.hf(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache}).logits
            ids = logits[:, -1].argmax(-1, keepdim=True)
            out.append(ids)
        return torch.cat(out, dim=1) if out else prompts.new_zeros(prompts.shape[0], 0)


def _dtype_kwarg() -> str:
    import transformers
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


@torch.no_grad()
def check_packed_capture(target: HFTarget, lengths=(7, 4)) -> None:
    """The packed path must reproduce the model's own forward, sequence by sequence, or we refuse the
    model (e.g. an architecture that scales embeddings or soft-caps logits, which `capture` skips)."""
    dev = target.embed_tokens.weight.device
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, target.vocab_size, (n,), generator=gen).to(dev) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=dev)
    pos = torch.cat([torch.arange(n, device=dev) for n in lengths])
    # Not the last layer: transformers' hidden_states[-1] is after the final norm, capture's is before.
    ids = sorted({0, target.num_layers - 2} - {-1}) or [0]
    feats, logits = target.capture(torch.cat(seqs), cu, pos, ids, need_logits=True)
    for s, seq in enumerate(seqs):
        out = target.hf(input_ids=seq[None], output_hidden_states=True)
        a, b = int(cu[s]), int(cu[s + 1])
        pairs = [("logits", logits[a:b], out.logits[0])]
        if target.num_layers > 1:
            ref = torch.cat([out.hidden_states[i + 1][0] for i in ids], dim=-1)
            pairs.append(("features", feats[a:b], ref))
        for name, got, want in pairs:
            err = float((got.float() - want.float()).norm() / want.float().norm().clamp(min=1e-12))
            if err > 2e-2:  # bf16 noise is ~1e-3; an unsupported architecture is off by O(1)
                raise ValueError(f"{type(target.hf).__name__}: packed capture does not reproduce the model's "
                                 f"{name} (relative error {err:.3g}); this architecture is not supported")


ENGINES = ("auto", "transformers", "torch")

# Column-wise (output features split: whole heads, whole MLP channels) then row-wise (input features split,
# outputs all-reduced) per decoder layer: the Megatron pairing, as in transformers' own plans.
_TORCH_TP_PLAN = {
    "self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise",
}


def check_head_split(heads: int, kv_heads: int, n: int) -> None:
    """Refuse a tensor-parallel replica of `n` ranks that would cut an attention or key/value head (the
    rule loading applies; the memory and cost forecasts apply it too, so they never price such a layout)."""
    if heads % n or kv_heads % n:
        raise ValueError(f"config key 'model.target.tensor_parallel': {n} does not divide the target's "
                         f"{heads} attention heads and {kv_heads} key/value heads")


def _check_shardable(cfg, n: int, expert_parallel: bool) -> None:
    """Refuse a split that would cut a head (or, with expert parallelism, leave ranks uneven experts)."""
    heads = cfg.num_attention_heads
    check_head_split(heads, getattr(cfg, "num_key_value_heads", None) or heads, n)
    experts = int(getattr(cfg, "num_experts", 0) or 0)
    if expert_parallel and (not experts or experts % n):
        raise ValueError(f"expert parallelism over {n} ranks needs a MoE target whose expert count divides by "
                         f"{n} (this one has {experts})")


def _replica_meshes(tp_group, device_type: str, expert_parallel: bool):
    """transformers' dense (pp, dp_replicate, fsdp, tp) and expert (pp, dp_replicate, efsdp, ep) meshes, over
    the replica's group only. Size-1 dimensions are backed by a group of this rank alone (created by it
    alone: use_local_synchronization), so no rank outside the replica takes part."""
    from torch.distributed.device_mesh import DeviceMesh
    ranks = torch.tensor(dist.get_process_group_ranks(tp_group))
    me = dist.new_group([dist.get_rank()], use_local_synchronization=True)
    dense = DeviceMesh.from_group([me, me, me, tp_group], device_type, mesh=ranks.reshape(1, 1, 1, -1),
                                  mesh_dim_names=("pp", "dp_replicate", "fsdp", "tp"))
    ep_groups, ep_shape = ([me, tp_group], (1, -1)) if expert_parallel else ([tp_group, me], (-1, 1))
    experts = DeviceMesh.from_group([me, me, *ep_groups], device_type, mesh=ranks.reshape(1, 1, *ep_shape),
                                    mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
    return dense, experts


def _transformers_tp_available() -> bool:
    """transformers >= 5 with the mesh constructor `_transformers_mesh` redirects (older: engine "torch")."""
    try:
        import transformers.distributed.mixin as mixin
    except ImportError:
        return False
    return hasattr(mixin, "initialize_distributed_mesh")


@contextlib.contextmanager
def _transformers_mesh(dense, experts, device: torch.device):
    """Points transformers' mesh construction at the replica's meshes while from_pretrained runs (see the
    module docstring: its own builds a mesh over the whole world)."""
    import transformers.distributed.mixin as mixin
    from transformers.distributed.utils import TransformersDeviceMesh
    original = mixin.initialize_distributed_mesh
    n = dense.size(3)

    def replica_mesh(distributed_config):
        if distributed_config.tp_size != n:
            raise RuntimeError(f"transformers asked for a tp mesh of {distributed_config.tp_size}, the replica has {n}")
        # The device map transformers' own returns (this rank's device: shards are read straight onto it,
        # which needs `accelerate` installed); on CPU None means the same and spares that dependency.
        return (None if device.type == "cpu" else device), TransformersDeviceMesh(dense, experts)

    mixin.initialize_distributed_mesh = replica_mesh
    try:
        yield
    finally:
        mixin.initialize_distributed_mesh = original


def _load_transformers_tp(path: Path, dtype: torch.dtype, tp_group, device: torch.device, expert_parallel: bool):
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig
    n = dist.get_world_size(tp_group)
    dense, experts = _replica_meshes(tp_group, device.type, expert_parallel)
    # Experts split whole over the replica, every rank keeping every token, the outputs all-reduced:
    # transformers >= 5.20 names that choice (ep_implementation); before (vLLM 0.32, installed beside,
    # pins < 5.20), the router-masking plan is given as an override of the model's token-dispatch one.
    named = "ep_implementation" in {f.name for f in dataclasses.fields(DistributedConfig)}
    masked = {"ep_implementation": "all_reduce"} if named else {
        "ep_plan": {"model.layers.*.mlp.gate": "ep_router", "model.layers.*.mlp.experts": "moe_tp_experts"}}
    dc = DistributedConfig(tp_size=n, ep_size=n, **masked) if expert_parallel else DistributedConfig(tp_size=n)
    with _transformers_mesh(dense, experts, device):
        return AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, distributed_config=dc,
                                                    **{_dtype_kwarg(): dtype})


def _load_torch_tp(path: Path, dtype: torch.dtype, tp_group, device_type: str):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **{_dtype_kwarg(): dtype})
    layers = getattr(hf, hf.base_model_prefix).layers
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {}
    for i, layer in enumerate(layers):
        modules = dict(layer.named_modules())
        for name, style in _TORCH_TP_PLAN.items():
            if isinstance(modules.get(name), nn.Linear):
                plan[f"{i}.{name}"] = styles[style]()
            elif name.startswith("self_attn"):
                raise NotImplementedError(f"{type(hf).__name__}: layer {i} has no nn.Linear {name}; tensor parallelism "
                                          "without a transformers TP plan needs separate q/k/v/o projections")
    mesh = DeviceMesh.from_group(tp_group, device_type, mesh_dim_names=("tp",))
    parallelize_module(layers, mesh, plan)
    return hf


def load_hf_target(path: str | Path, dtype: torch.dtype, device: torch.device, verify: bool = True,
                   tp_group=None, expert_parallel: bool = False, engine: str = "auto") -> HFTarget:
    """Loads a causal LM from a LOCAL directory (never downloads), frozen, in eval mode, on `device`.

    tp_group: the process group of this rank's target replica (None or one rank: the whole model here).
    Every rank of the group must call this together. expert_parallel: MoE experts whole, split among the
    replica's ranks, instead of each expert split. engine: see the module docstring."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError as exc:
        raise ImportError("model.target.kind=hf needs transformers: pip install 'dflash_dist[hf]'") from exc
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r}: expected one of {ENGINES}")
    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.target.path={path}: no config.json (a local model directory is required)")
    n = dist.get_world_size(tp_group) if tp_group is not None else 1
    if n == 1:
        if expert_parallel:
            raise ValueError("expert parallelism needs a target replica of several ranks "
                             "(model.target.tensor_parallel > 1)")
        hf = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **{_dtype_kwarg(): dtype})
    else:
        cfg = AutoConfig.from_pretrained(str(path), local_files_only=True)
        _check_shardable(cfg.get_text_config(), n, expert_parallel)
        if engine == "auto":
            has_plan = bool(getattr(cfg, "base_model_tp_plan", None))
            engine = "transformers" if has_plan and _transformers_tp_available() else "torch"
        if engine == "transformers" and not _transformers_tp_available():
            raise RuntimeError("this transformers cannot load a model sharded over a process group (needs "
                               "transformers >= 5 with distributed.mixin); use engine='torch'")
        if engine == "torch":
            if expert_parallel:
                raise ValueError("expert parallelism needs transformers' engine (a config with a TP plan)")
            hf = _load_torch_tp(path, dtype, tp_group, device.type)
        else:
            hf = _load_transformers_tp(path, dtype, tp_group, device, expert_parallel)
    target = HFTarget(hf).to(device=device, dtype=dtype).eval()
    target.tensor_parallel = n
    target.default_mask_token_id = default_mask_token_id(path, target.vocab_size)
    log.info("target %s from %s: %d layers, hidden %d, vocab %d%s, %s on %s%s", type(hf).__name__, path,
             target.num_layers, target.hidden_size, target.vocab_size,
             f", {target.num_experts} experts" if target.num_experts else "", dtype, device,
             f", sharded over {n} ranks ({engine}{', expert parallel' if expert_parallel else ''})" if n > 1 else "")
    if verify:
        check_packed_capture(target)
    return target
