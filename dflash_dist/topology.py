"""Roles and routes: pure arithmetic over (world size, ranks per node, drafters per node).

Layout: on every node the first `drafters_per_node` local ranks are drafters, the rest targets, so
features (large) never leave a node and only drafter gradients (small) cross nodes. Global rank 0 is
drafter 0.

Routes: the global drafter of batch b is j = b mod D (D = all drafters), so a global step is one batch
per drafter. Within j's node, batches arrive in increasing b; the m-th of them (m counted per node)
goes to the node's target m mod T. On one node this is exactly "target b mod T, drafter b mod D".
Every rank walks the plan in increasing b, so each (target, drafter) pair exchanges its packets in
increasing b: the single order NCCL needs to match sends with recvs.
"""
from __future__ import annotations

from dataclasses import dataclass


class TopologyError(ValueError):
    pass


@dataclass(frozen=True)
class Layout:
    world_size: int
    local_world_size: int
    drafters_per_node: int
    # Colocated: every rank runs the target and the drafter in turn (DDP over all ranks; N=1 works).
    # Expressed as "every rank is a drafter that is its own target", so routes and steps stay the same.
    colocated: bool = False

    def __post_init__(self) -> None:
        if self.world_size % self.local_world_size:
            raise TopologyError(
                f"world size {self.world_size} is not a multiple of ranks per node {self.local_world_size}")
        if self.colocated:
            object.__setattr__(self, "drafters_per_node", self.local_world_size)
        elif not 1 <= self.drafters_per_node < self.local_world_size:
            raise TopologyError(
                f"config key 'roles.drafters_per_node': {self.drafters_per_node} leaves no target among "
                f"{self.local_world_size} ranks per node (need 1 <= drafters_per_node < ranks per node)")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def targets_per_node(self) -> int:
        return self.local_world_size if self.colocated else self.local_world_size - self.drafters_per_node

    @property
    def num_drafters(self) -> int:
        return self.num_nodes * self.drafters_per_node

    @property
    def num_targets(self) -> int:
        return self.num_nodes * self.targets_per_node

    def drafter_ranks(self) -> list[int]:
        """Global ranks of drafters, ordered by drafter index j."""
        L, d = self.local_world_size, self.drafters_per_node
        return [n * L + i for n in range(self.num_nodes) for i in range(d)]

    def target_ranks(self) -> list[int]:
        if self.colocated:
            return list(range(self.world_size))
        L, d = self.local_world_size, self.drafters_per_node
        return [n * L + i for n in range(self.num_nodes) for i in range(d, L)]

    def role(self, rank: int) -> str:
        if self.colocated:
            return "colocated"
        return "drafter" if rank % self.local_world_size < self.drafters_per_node else "target"

    def drafter_index(self, rank: int) -> int:
        """j such that drafter_ranks()[j] == rank."""
        if self.role(rank) == "target":
            raise TopologyError(f"rank {rank} is a target, not a drafter")
        return (rank // self.local_world_size) * self.drafters_per_node + rank % self.local_world_size

    def route(self, b: int) -> tuple[int, int]:
        """(target rank, drafter rank) of global batch b."""
        D, d, T, L = self.num_drafters, self.drafters_per_node, self.targets_per_node, self.local_world_size
        j = b % D
        if self.colocated:
            return j, j
        node, local_j = divmod(j, d)
        m = (b // D) * d + local_j  # index of b among the batches routed to `node`
        target = node * L + d + m % T
        drafter = node * L + local_j
        return target, drafter

    def num_steps(self, num_batches: int) -> int:
        """Global optimizer steps of an epoch: one batch per drafter per step; the last may be partial."""
        return -(-num_batches // self.num_drafters)

    def batches_of(self, rank: int, num_batches: int) -> list[int]:
        """The batches this rank touches (as target or drafter), in the increasing order it handles them."""
        if self.role(rank) != "target":
            return list(range(self.drafter_index(rank), num_batches, self.num_drafters))
        return [b for b in range(num_batches) if self.route(b)[0] == rank]

    def tail(self, num_batches: int) -> int:
        """Drafters idle in the last step of an epoch (0 when num_batches is a multiple of D)."""
        return (-num_batches) % self.num_drafters
