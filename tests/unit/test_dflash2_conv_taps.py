"""Issue 36, case 16: DFlash 2's convolution taps against the block size. config.validate refuses
variant.conv_kernel_size > objective.block_size + 1 naming both keys (a ConfigError: exit 2), and
every kernel size it accepts runs through the convolution (the bound found by trying them)."""
from __future__ import annotations

import pytest
import torch

from dflash_dist.config import ConfigError, load_config
from dflash_dist.models.dflash2 import grouped_conv


def conv(block: int, taps: int) -> torch.Tensor:
    H, gs = 8, 4
    x = torch.randn(3, block, H)
    return grouped_conv(x, torch.randn(3, block, taps, H // gs), torch.randn(taps, H), gs)


def config(block: int, taps: int, variant: str = "dflash2"):
    return load_config(overrides=[f"model.draft.variant={variant}", f"objective.block_size={block}",
                                  f"variant.conv_kernel_size={taps}"])


@pytest.mark.parametrize("block", [2, 4, 16])
def test_every_accepted_kernel_size_runs_and_the_first_refused_names_both_keys(block):
    for taps in range(1, block + 2):
        config(block, taps)
        assert conv(block, taps).shape == (3, block, 8)
    with pytest.raises(RuntimeError):
        conv(block, block + 2)  # what a run met in its first step before the check
    with pytest.raises(ConfigError, match=r"variant\.conv_kernel_size.*objective\.block_size"):
        config(block, block + 2)


def test_the_plain_dflash_drafter_has_no_convolution_and_refuses_its_key():
    with pytest.raises(ConfigError, match=r"'variant\.conv_kernel_size': not an option of model\.draft\.variant=dflash"):
        config(4, 18, variant="dflash")
