"""DSpark's forecast terms: its Markov and confidence heads (`heads.py`) and its loss, which replaces the
plain head's (`loss.py`), as the memory and cost models count them (`models/variants/forecast.py` says
what each of the five questions asks)."""
from __future__ import annotations

from dflash_dist.models.variants.forecast import ChunkBytes, Term, VariantForecast


class DSparkForecast(VariantForecast):
    """What DSpark's heads and loss add beyond the DFlash drafter."""

    def params(self, s, cfg):
        """The Markov head's W1 and W2 (V x r each: 77.8M at Qwen3-8B's V 151,936 and r 256;
        models/variants/dspark/heads.py) and the confidence head's projection of [h; W1[prev]] (H + r, or H)
        and its bias."""
        d = cfg.variant  # the variant's typed options (config.py's `variant` section)
        r = d.markov_rank
        conf = (s.hidden + (r if d.confidence_head_with_markov else 0) + 1) if d.enable_confidence_head else 0
        return 2 * s.vocab * r + conf

    def chunk_bytes(self, s, p, cfg, rows, block_rows, anchors):
        """DSpark drafts every slot (anchor as first) and its loss replaces the plain head's
        (models/variants/dspark/loss.py): it keeps the input gradients it computes in the forward, per
        labelled row (every row, an upper bound) one of h (H, the compute dtype) and of W1[prev] (r,
        float32), and W2's (V x r, float32); each row chunk holds two float32 (rows, V) buffers (the
        slot's softmax and the target's) beside the matmul's output."""
        c, V, r = p.drafter_compute, s.vocab, cfg.variant.markov_rank
        return ChunkBytes(saved=block_rows * (c * s.hidden + 4 * r) + 4 * V * r,
                          loss=rows * V * (8 + (c if c != 4 else 0)))

    def cost_terms(self, s, cfg, c, block_rows, rows, anchors):
        """Beyond the LM head's forward and input gradient: the teacher's distribution, the frozen head over
        the target's final hidden state (forward only); the Markov bias W2 . W1[prev] (forward, and the
        gradients into W1[prev] and W2); the target's softmax and the L1 term's sign pass, a second float32
        (rows, V) buffer."""
        H, V, r = s.hidden, s.vocab, cfg.variant.markov_rank
        return {"dspark_teacher_head": Term("matmul", 2 * rows * H * V),
                "dspark_markov": Term("matmul", 3 * 2 * rows * r * V),
                "dspark_teacher_softmax": Term("memory", rows * V * (c + 3 * 4))}
