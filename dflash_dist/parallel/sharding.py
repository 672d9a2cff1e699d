"""How drafters share their work (`roles.drafter_sharding`): replicas on torch's DistributedDataParallel
(ddp), or PyTorch FSDP2 shards of parameters, gradients and optimizer state (fsdp).

Both give the training step (training/step.py) the same few things:
  model / module                   the bare drafter (states, evaluation) / what a step calls for an anchor
                                   chunk's forward (DDP's wrapper; the FSDP2 module itself)
  begin_step / before_last_chunk   around the anchor chunks of one step: gradients accumulate locally
                                   (DDP: require_backward_grad_sync off; FSDP: unsharded and unreduced)
                                   until the last chunk, whose backward reduces them over the drafters
  size                             the drafters; both reductions AVERAGE over them (the step scales each
                                   batch's loss by it, so that the reduced gradient is the sum)
  keep_grads                       zero the gradients in place after a step instead of freeing them (DDP:
                                   they are views of its buckets, gradient_as_bucket_view)
  full_model_state / full_optim_state / load_full   whole (unsharded) states keyed by the bare drafter's
                                   parameter names, the one checkpoint format: either mode resumes either
Every drafter takes part in every step's reduction, a tail step's idle drafter through a zero-weight step.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class DrafterSharding:
    """The interface the training step calls (module docstring), and what both modes share: whole
    (unsharded) states keyed by parameter name."""
    kind = ""
    keep_grads = False
    model: nn.Module
    module: nn.Module
    params: list[nn.Parameter]
    size: int

    def begin_step(self) -> None:
        """Before a step's first anchor chunk."""
        raise NotImplementedError

    def before_last_chunk(self) -> None:
        """Before the step's last anchor chunk (whose backward may reduce the gradients)."""
        raise NotImplementedError

    # Whole states keyed by parameter name (torch.distributed.checkpoint's "full state dict"), in both
    # modes alike. Under FSDP every drafter gets the whole weights (the replica check, the export and
    # evaluation use them) but only rank 0 the whole optimizer state, gathered to its CPU (the other
    # ranks get {}): AdamW's two moments are twice the weights, and only rank 0 writes the checkpoint.
    offload = False

    def _options(self, offload: bool = False):
        from torch.distributed.checkpoint.state_dict import StateDictOptions
        return StateDictOptions(full_state_dict=True, cpu_offload=offload)

    def full_model_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        return get_model_state_dict(self.model, options=self._options())

    def full_optim_state(self, opt: torch.optim.Optimizer) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
        return get_optimizer_state_dict(self.model, opt, options=self._options(self.offload))

    def load_full(self, opt: torch.optim.Optimizer, model_state: dict, optim_state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
        options = self._options()
        set_model_state_dict(self.model, model_state, options=options)
        set_optimizer_state_dict(self.model, opt, optim_state, options=options)


class Replicas(DrafterSharding):
    """ddp: every drafter holds the whole drafter, wrapped in torch's DistributedDataParallel over the
    drafter group. Its gradients are views of DDP's buckets (no second copy); they accumulate locally
    over a step's anchor chunks (require_backward_grad_sync off) and the last chunk's backward all-reduces
    each bucket as soon as its gradients are ready, overlapping the rest of that backward. DDP averages:
    the step scales each batch's loss by `size` (exact for 1 and 2 drafters: a power of two)."""
    kind = "ddp"
    keep_grads = True

    def __init__(self, model: nn.Module, group, device: torch.device):
        from torch.nn.parallel import DistributedDataParallel
        self.model, self.group = model, group
        self.size = dist.get_world_size(group)
        # init_sync: drafter 0's weights (group rank 0: the drafter ranks are in order) to every replica,
        # before the optimizer sees the parameters. Every parameter gets a gradient in every step (the
        # variants' heads included), so DDP need not search the graph for unused ones.
        self.module = DistributedDataParallel(
            model, device_ids=[device.index] if device.index is not None else None, process_group=group,
            broadcast_buffers=False, gradient_as_bucket_view=True, find_unused_parameters=False)
        self.params = [p for p in model.parameters() if p.requires_grad]

    def begin_step(self) -> None:
        self.module.require_backward_grad_sync = False

    def before_last_chunk(self) -> None:
        self.module.require_backward_grad_sync = True


class Shards(DrafterSharding):
    """fsdp: each decoder layer and the rest of the drafter are FSDP2 units over the drafter group.

    Parameters stay gathered for the whole step (reshard_after_forward=False and no reshard after the
    non-final chunks' backward), so the number of collectives does not depend on how many anchor chunks a
    drafter's batch has; the gradients are reduce-scattered once, by the last chunk's backward."""
    kind = "fsdp"
    offload = True

    def __init__(self, model: nn.Module, group, device: torch.device):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
        self.model = self.module = model  # fully_shard changes the module in place
        self.group, self.size = group, dist.get_world_size(group)
        mesh = DeviceMesh.from_group(group, device.type)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        # The step calls `context` once per batch besides forward: FSDP must gather around it too.
        register_fsdp_forward_method(model, "context")
        self.params = [p for p in model.parameters() if p.requires_grad]

    def begin_step(self) -> None:
        self.model.set_requires_gradient_sync(False)
        self.model.set_reshard_after_backward(False)

    def before_last_chunk(self) -> None:
        self.model.set_requires_gradient_sync(True)
        self.model.set_reshard_after_backward(True)


def make_sharding(kind: str, model: nn.Module, group, device: torch.device) -> DrafterSharding:
    return Shards(model, group, device) if kind == "fsdp" else Replicas(model, group, device)


def total_norm(norm) -> float:
    """clip_grad_norm_'s result as a float (a DTensor under FSDP)."""
    from torch.distributed.tensor import DTensor
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
