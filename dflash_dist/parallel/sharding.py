"""How drafters share their work (`roles.drafter_sharding`): replicas with averaged gradients (ddp), or
PyTorch FSDP2 shards of parameters, gradients and optimizer state (fsdp).

Both give the training loop the same few calls:
  begin_step / before_last_chunk   around the anchor chunks of one step (FSDP: gradients accumulate
                                   unsharded and unreduced until the last chunk's backward reduce-scatters)
  loss_scale / finish_grads(div)   the step's gradient = the sum over its batches / div (the step's real
                                   batches for objective.loss_norm=batch, 1 for step: then scale_grads
                                   divides by the step's all-reduced weight sum)
  idle_computes                    whether a drafter without a batch in a tail step must still run a
                                   (zero-weight) forward/backward: FSDP's gathers and reduce-scatters
                                   are collectives, a replica's single all-reduce is not tied to compute
  full_model_state / full_optim_state / load_full   whole (unsharded) states, the one checkpoint
                                   format: a checkpoint of either mode resumes in either mode
With FSDP every call that gathers is a collective over the drafters: every drafter makes it.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dflash_dist.parallel.dist import all_reduce_grads, broadcast_params


class DrafterSharding:
    """The interface the training loop calls (module docstring), and what both modes share:
    `scale_grads` and whole (unsharded) states keyed by parameter name."""
    kind = ""
    idle_computes = False
    model: nn.Module
    params: list[nn.Parameter]

    def begin_step(self) -> None:
        """Before a step's first anchor chunk."""
        raise NotImplementedError

    def before_last_chunk(self) -> None:
        """Before the step's last anchor chunk (whose backward may reduce the gradients)."""
        raise NotImplementedError

    def loss_scale(self, div: int) -> float:
        """The factor on each batch's loss that makes the reduced gradient the sum over batches / div."""
        raise NotImplementedError

    def finish_grads(self, div: int) -> None:
        """After the step's last backward: the gradients reduced over the drafters, / div."""
        raise NotImplementedError

    def scale_grads(self, factor: float) -> None:
        """Every gradient (a local shard under FSDP) times `factor`: the same on every drafter."""
        for p in self.params:
            if p.grad is not None:
                p.grad.mul_(factor)

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
    """ddp: every drafter holds the whole drafter; one flat all-reduce of the gradients per step."""
    kind = "ddp"
    idle_computes = False

    def __init__(self, model: nn.Module, group, src: int):
        self.model, self.group = model, group
        self.params = [p for p in model.parameters() if p.requires_grad]
        broadcast_params(model, group, src)

    def begin_step(self) -> None:
        pass

    def before_last_chunk(self) -> None:
        pass

    def finish_grads(self, div: int) -> None:
        all_reduce_grads(self.params, self.group, divisor=div)

    def loss_scale(self, div: int) -> float:
        return 1.0


class Shards(DrafterSharding):
    """fsdp: each decoder layer and the rest of the drafter are FSDP2 units over the drafter group.

    Parameters stay gathered for the whole step (reshard_after_forward=False and no reshard after the
    non-final chunks' backward), so the number of collectives does not depend on how many anchor chunks a
    drafter's batch has; the gradients are reduce-scattered once, by the last chunk's backward."""
    kind = "fsdp"
    idle_computes = True
    offload = True

    def __init__(self, model: nn.Module, group, device: torch.device):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
        self.model, self.group = model, group
        self.size = dist.get_world_size(group)
        mesh = DeviceMesh.from_group(group, device.type)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        # The step calls these methods, not forward(): FSDP must gather around them too.
        register_fsdp_forward_method(model, "context")
        register_fsdp_forward_method(model, "draft_hidden")
        self.params = [p for p in model.parameters() if p.requires_grad]

    def begin_step(self) -> None:
        self.model.set_requires_gradient_sync(False)
        self.model.set_reshard_after_backward(False)

    def before_last_chunk(self) -> None:
        self.model.set_requires_gradient_sync(True)
        self.model.set_reshard_after_backward(True)

    def loss_scale(self, div: int) -> float:
        """FSDP averages over all drafters: scaled by size / div, the reduced gradient is the sum / div."""
        return self.size / div

    def finish_grads(self, div: int) -> None:
        pass  # reduce-scattered (and averaged) by the last chunk's backward


def make_sharding(kind: str, model: nn.Module, group, device: torch.device, src: int) -> DrafterSharding:
    return Shards(model, group, device) if kind == "fsdp" else Replicas(model, group, src)


def total_norm(norm) -> float:
    """clip_grad_norm_'s result as a float (a DTensor under FSDP)."""
    from torch.distributed.tensor import DTensor
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
