"""Compiled flex attention on CPU (torch.compile, which compiles in worker processes): it settles after
two layouts."""
import pytest
import torch

from dflash_dist.models import attention as attn


@pytest.mark.slow  # compiles flex on CPU (~20 s)
def test_compiled_flex_settles_after_two_layouts():
    """The real compiler: the causal op compiles at the first two warm-up layouts and never again."""
    attn.backend.flex_eligible = lambda op, x: True
    rep = attn.warm_up(torch.device("cpu"), torch.float32, ops=("causal",), **WARM)
    assert rep["causal"]["path"] == "flex" and rep["causal"]["graphs"] == [1, 1, 0]


WARM = dict(heads=4, kv_heads=2, head_dim=8, block_size=4)
