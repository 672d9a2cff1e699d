"""dflash_dist: train DFlash speculative-decoding drafters against a frozen target, under torchrun."""
__version__ = "0.1.0"
