"""Roles and routes: pure arithmetic over (world size, ranks per node, drafters per node, ranks per replica).

Layout: on every node the first `drafters_per_node` local ranks are drafters, the rest targets, so
features (large) never leave a node and only drafter gradients (small) cross nodes. Global rank 0 is
drafter 0. The target ranks of a node form target replicas of `tensor_parallel` consecutive ranks (one
copy of the target, sharded over its ranks); a replica never spans nodes. With tensor_parallel = 1 a
replica is one rank, and everything below reduces to "target rank" exactly as before replicas existed.

Routes: the global drafter of batch b is j = (b - origin) mod D (D = all drafters), so a global step is
one batch per drafter. Within j's node, batches arrive in increasing b; the m-th of them (m counted per
node) goes to the node's replica m mod R (R = replicas per node). On one node with one rank per replica
this is exactly "target b mod T, drafter b mod D". Every rank of a replica runs every batch of the
replica (the sharded forward is collective); only its first rank, the leader, sends the features.
Every rank walks the plan in increasing b, so each (leader, drafter) pair exchanges its packets in
increasing b: the single order NCCL needs to match sends with recvs.

`origin` (default 0) is the first batch of the epoch still to do, for a mid-epoch resume under another
layout: batches before it are done, and the round robin starts afresh there, so route(origin + k, origin)
== route(k) and a resumed epoch is routed like a fresh epoch of the remaining batches.
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
    tensor_parallel: int = 1  # ranks per target replica (config key model.target.tensor_parallel)

    def __post_init__(self) -> None:
        if self.world_size % self.local_world_size:
            raise TopologyError(
                f"world size {self.world_size} is not a multiple of ranks per node {self.local_world_size}")
        tp = self.tensor_parallel
        if tp < 1:
            raise TopologyError(f"config key 'model.target.tensor_parallel': must be >= 1, got {tp}")
        if self.colocated:
            if tp > 1:
                raise TopologyError(
                    f"config keys 'roles.mode' and 'model.target.tensor_parallel': colocated ranks each hold a "
                    f"whole target, so tensor_parallel must be 1 (got {tp}); use roles.mode=disaggregated")
            object.__setattr__(self, "drafters_per_node", self.local_world_size)
            return
        L, d = self.local_world_size, self.drafters_per_node
        if not 1 <= d < L:
            raise TopologyError(
                f"config key 'roles.drafters_per_node': {d} leaves no target among "
                f"{L} ranks per node (need 1 <= drafters_per_node < ranks per node)")
        if (L - d) % tp:
            raise TopologyError(
                f"config keys 'model.target.tensor_parallel' and 'roles.drafters_per_node': the {L - d} target "
                f"ranks per node ({L} ranks per node - {d} drafters) do not split into replicas of {tp} ranks "
                f"(a replica must sit on one node): choose drafters_per_node so that {tp} divides the rest")

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def targets_per_node(self) -> int:
        """Target RANKS per node."""
        return self.local_world_size if self.colocated else self.local_world_size - self.drafters_per_node

    @property
    def replicas_per_node(self) -> int:
        return self.targets_per_node // self.tensor_parallel

    @property
    def num_drafters(self) -> int:
        return self.num_nodes * self.drafters_per_node

    @property
    def num_targets(self) -> int:
        """Target RANKS (num_replicas * tensor_parallel)."""
        return self.num_nodes * self.targets_per_node

    @property
    def num_replicas(self) -> int:
        return self.num_nodes * self.replicas_per_node

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

    def replica_ranks(self, r: int) -> list[int]:
        """The global ranks of replica r (ordered by node, then by local rank), leader first."""
        if not 0 <= r < self.num_replicas:
            raise TopologyError(f"replica {r} outside [0, {self.num_replicas})")
        if self.colocated:
            return [r]
        node, i = divmod(r, self.replicas_per_node)
        first = node * self.local_world_size + self.drafters_per_node + i * self.tensor_parallel
        return list(range(first, first + self.tensor_parallel))

    def replica_leader(self, r: int) -> int:
        return self.replica_ranks(r)[0]

    def replica_of(self, rank: int) -> int:
        """The replica a target (or colocated) rank belongs to."""
        if self.role(rank) == "drafter":
            raise TopologyError(f"rank {rank} is a drafter, not in a target replica")
        if self.colocated:
            return rank
        node, local = divmod(rank, self.local_world_size)
        return node * self.replicas_per_node + (local - self.drafters_per_node) // self.tensor_parallel

    def is_replica_leader(self, rank: int) -> bool:
        """True for the one rank of each replica that sends the replica's features; False for drafters."""
        return self.role(rank) != "drafter" and self.replica_leader(self.replica_of(rank)) == rank

    def replica_groups(self) -> list[list[int]]:
        """Every replica's ranks, in replica order: the process groups to create (every rank creating
        all of them in this order)."""
        return [self.replica_ranks(r) for r in range(self.num_replicas)]

    def route(self, b: int, origin: int = 0) -> tuple[int, int]:
        """(leader rank of the target replica, drafter rank) of global batch b >= origin."""
        if b < origin:
            raise TopologyError(f"batch {b} precedes the origin {origin}: it is already done")
        D, d, R, L = self.num_drafters, self.drafters_per_node, self.replicas_per_node, self.local_world_size
        k = b - origin
        j = k % D
        if self.colocated:
            return j, j
        node, local_j = divmod(j, d)
        m = (k // D) * d + local_j  # index of b among the batches routed to `node`
        leader = node * L + d + (m % R) * self.tensor_parallel
        drafter = node * L + local_j
        return leader, drafter

    def num_steps(self, num_batches: int, origin: int = 0) -> int:
        """Global optimizer steps for batches [origin, num_batches): one batch per drafter per step; the
        last may be partial."""
        return -(-(num_batches - origin) // self.num_drafters)

    def batches_of(self, rank: int, num_batches: int, origin: int = 0) -> list[int]:
        """The batches in [origin, num_batches) this rank handles (as drafter, or as a rank of the target
        replica that runs them), in increasing order."""
        if self.role(rank) != "target":
            return list(range(origin + self.drafter_index(rank), num_batches, self.num_drafters))
        leader = self.replica_leader(self.replica_of(rank))
        return [b for b in range(origin, num_batches) if self.route(b, origin)[0] == leader]

    def tail(self, num_batches: int, origin: int = 0) -> int:
        """Drafters idle in the last step of an epoch (0 when the batches left are a multiple of D)."""
        return (origin - num_batches) % self.num_drafters


def candidate_splits(ranks_per_node: int, tensor_parallel: int = 1) -> list[int]:
    """The one split search: the drafters_per_node values Layout accepts on nodes of `ranks_per_node` ranks
    (at least one drafter and one whole target replica, the target ranks a multiple of tensor_parallel).
    Layout's own check decides, so neither the forecast (forecast.cost) nor the end-of-run advice
    (observe.balance, handed these by its caller: it sits below this layer) offers a split train refuses."""
    return [d for d in range(1, ranks_per_node) if _accepted(ranks_per_node, d, tensor_parallel)]


def _accepted(ranks_per_node: int, drafters_per_node: int, tensor_parallel: int) -> bool:
    try:  # one node is enough: every node has the same layout
        Layout(ranks_per_node, ranks_per_node, drafters_per_node, tensor_parallel=tensor_parallel)
    except TopologyError:
        return False
    return True
