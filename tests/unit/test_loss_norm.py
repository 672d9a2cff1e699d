"""objective.loss_norm=batch against step: the mean of D batch means is another gradient than that of one
batch made of all their samples (tests/integration/test_loss_norm_ranks.py holds D drafters to the latter)."""
import helpers
from drafter_batches import make_batch, make_model, reference_grads


def test_the_mean_of_batch_means_is_another_gradient():
    """loss_norm=batch on the same unequal batches: tests/integration/test_loss_norm_ranks.py would see the difference."""
    model = make_model()
    for i in range(2):
        data, feats, anchors, acu = make_batch(i)
        helpers.train_step(model, data, feats, None, anchors, acu, gamma=3.0, scale=0.5)  # mean of 2 batch means
    want = reference_grads(2)
    rel = max(float((p.grad - want[k]).norm() / want[k].norm()) for k, p in model.named_parameters())
    assert rel > 0.05, rel
