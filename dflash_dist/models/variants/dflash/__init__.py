"""DFlash (z-lab): the backbone alone, served by vLLM's and SGLang's DFlash drafters. Every method is the
interface's default (`base.Variant`): the unary head's argmax drafts, the unary loss trains it."""
from __future__ import annotations

from dflash_dist.models.variants.base import Variant


class DFlash(Variant):
    name = "dflash"
