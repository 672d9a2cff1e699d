"""objective.loss_norm=step: the gradient of D drafters' step is that of one batch made of all their samples.

Real processes (gloo), each drafter running the functions of one optimizer step that the drafter role
calls (training/step.py): `step_gradients` (its batch, or an idle tail drafter's zero-weight step),
`reduce_stats`, `normalise`. The reference is one process's plain step on the merged batch (its own weight
sum). DDP and FSDP2, with an idle tail drafter and with anchor chunks."""

import pytest
from drafter_batches import (
    assert_drafters_give,
    drafter_worker,
    reference_grads,
)


@pytest.mark.slow  # several processes
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
@pytest.mark.parametrize("world, num_batches, chunk", [(2, 2, 0), (3, 2, 2), (3, 3, 1)])
def test_a_step_of_several_drafters_is_one_batch_of_all_their_samples(tmp_path, kind, world, num_batches, chunk):
    assert_drafters_give(drafter_worker, reference_grads(num_batches), tmp_path, world, (kind, num_batches, chunk, {}))
