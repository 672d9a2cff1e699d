"""Domino's forecast terms: its GRU and logit delta (`head.py`) and its loss, which replaces the plain
head's (`loss.py`), as the memory and cost models count them (`models/variants/forecast.py` says what
each of the five questions asks)."""
from __future__ import annotations

from dflash_dist.models.variants.forecast import ChunkBytes, Term, VariantForecast


class DominoForecast(VariantForecast):
    """What Domino's GRU, delta and loss add beyond the DFlash drafter."""

    def params(self, s, cfg):
        """The bias-free GRU's W_ih (3G x H) and W_hh (3G x G), the delta's W1 (E x (H + G)) and W2 (V x E:
        38.9M at Qwen3-8B's V 151,936 and E 256; models/variants/domino/head.py)."""
        d = cfg.variant  # the variant's typed options (config.py's `variant` section)
        G, E, H = d.gru_hidden_dim, d.emb_dim, s.hidden
        return 3 * G * (H + G) + E * (H + G) + s.vocab * E

    def chunk_bytes(self, s, p, cfg, rows, block_rows, anchors):
        """Every row counted as labelled, as DSpark's: the GRU's autograd keeps per row and slot about ten
        G-wide float32 tensors (the gates' inputs and outputs, the state); the delta keeps [h; s] (H + G),
        W1's output and SiLU's (2E), float32; the loss keeps the input gradients it computes in the forward
        (models/variants/domino/loss.py) of h (H, the compute dtype) and of the delta features (E, float32)
        and W2's (V x E, float32); each row chunk holds two float32 (rows, V) buffers (the base logits'
        softmax and the final's) beside the head matmul's output, four under target_full (p_t and a
        scratch too: models/variants/domino/loss.py _distill_chunk)."""
        d = cfg.variant  # the variant's typed options (config.py's `variant` section)
        c, V, G, E, H = p.drafter_compute, s.vocab, d.gru_hidden_dim, d.emb_dim, s.hidden
        saved = block_rows * (10 * 4 * G + 4 * (H + G + 2 * E) + c * H + 4 * E) + 4 * V * E
        buffers = 4 if cfg.objective.labels == "target_full" else 2
        return ChunkBytes(saved=saved, loss=rows * V * (4 * buffers + (c if c != 4 else 0)))

    def cost_terms(self, s, cfg, c, block_rows, rows, anchors):
        """Beyond the LM head's forward and input gradient (models/variants/domino/loss.py, head.py): the GRU over
        every block row (its input and recurrent products, 3G x (H + G) each row; trained: 3 x forward),
        the delta on the labelled rows (W1 over [h; s], W2 to the vocabulary: forward, input gradient and
        weight gradient each), and the second float32 (rows, V) buffer (the final logits' softmax and
        gradient beside the base's)."""
        d = cfg.variant  # the variant's typed options (config.py's `variant` section)
        H, V, G, E, R = s.hidden, s.vocab, d.gru_hidden_dim, d.emb_dim, block_rows
        return {"domino_gru": Term("matmul", 3 * 2 * R * 3 * G * (H + G)),
                "domino_delta": Term("matmul", 3 * 2 * rows * E * (H + G + V)),
                "domino_gru_elementwise": Term("memory", 3 * R * 3 * G * 4 * 4),
                "domino_final_softmax": Term("memory", rows * V * (4 + 3 * 4))}

    def distill_passes(self, cfg):
        """Domino distils both its logits while lambda is strictly between 0 and 1 (the first
        variant.lambda_fraction of the run), then its final logits alone: 1 + f passes a batch
        on average."""
        return 1.0 + cfg.variant.lambda_fraction
