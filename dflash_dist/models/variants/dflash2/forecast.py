"""DFlash 2's forecast terms: its two grouped convolutions per draft layer and its candidate selector
(`modules.py`), the selector's loss and walk (`loss.py`), as the memory and cost models count them
(`models/variants/forecast.py` says what each of the five questions asks)."""
from __future__ import annotations

from dflash_dist.models.variants.forecast import ChunkBytes, Term, VariantForecast


class DFlash2Forecast(VariantForecast):
    """What DFlash 2's convolutions and selector add beyond the DFlash drafter."""

    def params(self, s, cfg):
        """Per layer two convolutions, each a base kernel (2, taps, H) and a projection H -> 2 x taps x H /
        group (models/variants/dflash2/modules.py); the selector's two codebooks (V x R each) and its hidden
        projection (R x H)."""
        d = cfg.variant  # the variant's typed options (config.py's `variant` section)
        H, taps = s.hidden, d.conv_kernel_size
        conv = 2 * taps * H + H * 2 * taps * (H // d.conv_group_size)
        return s.draft_layers * 2 * conv + 2 * s.vocab * d.selector_rank + d.selector_rank * H

    def layer_row_bytes(self, s, p, cfg):
        """The two convolutions. Per side (before and after each sublayer) the products keep the float32
        coefficients (taps x H: the float32 base kernel promotes them) and the shifted taps (taps - 1 rows,
        float32); per convolution the projection keeps the normed input the sublayer's projections kept
        before (they now keep the convolved rows), and side 1 keeps the sublayer's output."""
        H, taps, c = s.hidden, cfg.variant.conv_kernel_size, p.drafter_compute
        side = 4 * taps * H + 4 * (taps - 1) * H
        return 2 * (2 * side + 2 * c * H)

    def chunk_bytes(self, s, p, cfg, rows, block_rows, anchors):
        """The selector (its loss: models/variants/dflash2/loss.py): its loss keeps, per labelled row (every
        drafted slot, an upper bound), the K successor-codebook rows (float32), the predecessor's row times
        the hidden projection, the projection, the candidate ids and scores; the walk (no gradient, after
        the loss chunks are freed) keeps every drafted row's projection and served candidates (ids, logits,
        scores) and gathers one position's successor rows (K x R per block) at a time
        (`CandidateSelector.greedy_path`, modules.py); the larger transient is the loss's backward, the
        gradient of its K successor rows per labelled row."""
        d = cfg.variant  # the variant's typed options (config.py's `variant` section)
        K, Rk = d.selector_top_k, d.selector_rank
        drafted = labelled = block_rows - anchors
        blocks = drafted // max(1, s.block_size - 1)
        walk = drafted * (4 * Rk + 16 * K) + blocks * 4 * K * Rk
        saved = labelled * (4 * K * Rk + 2 * 4 * Rk + 2 * 8 * K + 4 * K)
        return ChunkBytes(saved=saved, after=max(walk, labelled * 4 * K * Rk))

    def cost_terms(self, s, cfg, c, block_rows, rows, anchors):
        """The two convolutions' projections per layer (trained: 3 x forward), the top-K read off the
        loss's logits (a topk over each labelled row's V logits, `c` bytes each: no second pass of the
        head), the input gradient of the K candidates' logits (their forward values come with the top-K),
        the hidden projection (loss: forward and backward; walk: forward) and the codebook scores of the
        loss (K x R) and of the walk (K x R: the chosen predecessor's row only)."""
        d = cfg.variant  # the variant's typed options (config.py's `variant` section)
        H, V, K, Rk, L = s.hidden, s.vocab, d.selector_top_k, d.selector_rank, s.draft_layers
        R, drafted = block_rows, block_rows - anchors  # block slots 1..B-1
        proj = 2 * 2 * H * 2 * d.conv_kernel_size * (H // d.conv_group_size)  # two convolutions, forward
        return {"dflash2_conv": Term("matmul", 3 * R * L * proj),
                "selector_top_k": Term("memory", rows * V * c),
                "selector_scores": Term("matmul", 2 * H * K * rows + 2 * Rk * H * (3 * rows + drafted)
                                        + 2 * K * Rk * (3 * rows + drafted)),
                "dflash2_conv_elementwise": Term("memory", 3 * R * L * 2 * 2 * d.conv_kernel_size * H * 12)}
