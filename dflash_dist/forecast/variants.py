"""What each drafter variant adds to the forecasts: one object per `model.draft.variant`.

The memory model (`forecast.memory`) and the cost model (`forecast.cost`) count the DFlash drafter's
tensors and work; a variant's own modules (its heads, convolutions, loss) add parameters, saved bytes and
work that only it has. Each variant here answers the same five questions, so the two models ask them
without knowing which variant runs. A built-in variant's object is one more class here (and one more
entry in `FORECASTS`, which names every built-in of `models.variants.VARIANTS`); a variant registered
from outside the package declares its own as `Variant.forecast` (`forecast_of` asks it first):

  params           parameters beyond the DFlash drafter's (exact: tested against the built module)
  layer_row_bytes  bytes each draft layer saves per block row beyond a DFlash layer's
  chunk_bytes      bytes one anchor chunk keeps for backward beyond the plain head's, and the transients
                   that replace the plain loss chunk (its row chunk) or come after it (a walk)
  cost_terms       work beyond the DFlash drafter's, as named `Term`s
  distill_passes   how many full-vocabulary distillation passes a batch makes under objective.labels=target_full
"""
from __future__ import annotations

from dataclasses import dataclass

from dflash_dist.config import Config, ConfigError
from dflash_dist.forecast.job import Precision
from dflash_dist.forecast.shapes import ModelShapes
from dflash_dist.forecast.work import Term
from dflash_dist.models.variants import options_of, variant_of


@dataclass(frozen=True)
class ChunkBytes:
    """One anchor chunk's bytes beyond the plain DFlash head's."""
    saved: int = 0  # kept for backward until the chunk's backward (the loss's input gradients, a walk's rows)
    loss: int = 0  # one row chunk of the variant's loss, in place of the plain head's (0: the plain head's)
    after: int = 0  # a transient after the loss's row chunks are freed (DFlash 2's greedy walk)


class DFlashForecast:
    """The plain DFlash drafter: the models count it all."""
    name = "dflash"

    def params(self, s: ModelShapes, cfg: Config) -> int:
        return 0

    def layer_row_bytes(self, s: ModelShapes, p: Precision, cfg: Config) -> int:
        return 0

    def chunk_bytes(self, s: ModelShapes, p: Precision, cfg: Config, rows: int, block_rows: int,
                    anchors: int) -> ChunkBytes:
        """`rows`: the loss's row chunk (objective.loss_rows, at most the chunk's); `block_rows`: the
        chunk's anchors x block_size; `anchors`: the chunk's anchors."""
        return ChunkBytes()

    def cost_terms(self, s: ModelShapes, cfg: Config, c: int, block_rows: int, rows: float,
                   anchors: int) -> dict[str, Term]:
        """`c`: bytes of the compute dtype; `rows`: block rows with a label (expected)."""
        return {}

    def distill_passes(self, cfg: Config) -> float:
        return 1.0


class DFlash2Forecast(DFlashForecast):
    name = "dflash2"

    def params(self, s, cfg):
        """Per layer two convolutions, each a base kernel (2, taps, H) and a projection H -> 2 x taps x H /
        group (models/variants/dflash2/modules.py); the selector's two codebooks (V x R each) and its hidden projection (R x H)."""
        d = options_of(cfg)
        H, taps = s.hidden, d.conv_kernel_size
        conv = 2 * taps * H + H * 2 * taps * (H // d.conv_group_size)
        return s.draft_layers * 2 * conv + 2 * s.vocab * d.selector_rank + d.selector_rank * H

    def layer_row_bytes(self, s, p, cfg):
        """The two convolutions. Per side (before and after each sublayer) the products keep the float32
        coefficients (taps x H: the float32 base kernel promotes them) and the shifted taps (taps - 1 rows,
        float32); per convolution the projection keeps the normed input the sublayer's projections kept
        before (they now keep the convolved rows), and side 1 keeps the sublayer's output."""
        H, taps, c = s.hidden, options_of(cfg).conv_kernel_size, p.drafter_compute
        side = 4 * taps * H + 4 * (taps - 1) * H
        return 2 * (2 * side + 2 * c * H)

    def chunk_bytes(self, s, p, cfg, rows, block_rows, anchors):
        """The selector (training/selector.py): its loss keeps, per labelled row (every drafted slot, an
        upper bound), the K successor-codebook rows (float32), the predecessor's row times the hidden
        projection, the projection, the candidate ids and scores; the walk (no gradient, after the loss
        chunks are freed) keeps every drafted row's projection and served candidates (ids, logits,
        scores) and gathers one position's successor rows (K x R per block) at a time (`greedy_path`);
        the larger transient is the loss's backward, the gradient of its K successor rows per labelled row."""
        d = options_of(cfg)
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
        d = options_of(cfg)
        H, V, K, Rk, L = s.hidden, s.vocab, d.selector_top_k, d.selector_rank, s.draft_layers
        R, drafted = block_rows, block_rows - anchors  # block slots 1..B-1
        proj = 2 * 2 * H * 2 * d.conv_kernel_size * (H // d.conv_group_size)  # two convolutions, forward
        return {"dflash2_conv": Term("matmul", 3 * R * L * proj),
                "selector_top_k": Term("memory", rows * V * c),
                "selector_scores": Term("matmul", 2 * H * K * rows + 2 * Rk * H * (3 * rows + drafted)
                                        + 2 * K * Rk * (3 * rows + drafted)),
                "dflash2_conv_elementwise": Term("memory", 3 * R * L * 2 * 2 * d.conv_kernel_size * H * 12)}


class DSparkForecast(DFlashForecast):
    name = "dspark"

    def params(self, s, cfg):
        """The Markov head's W1 and W2 (V x r each: 77.8M at Qwen3-8B's V 151,936 and r 256;
        models/variants/dspark/heads.py) and the confidence head's projection of [h; W1[prev]] (H + r, or H)
        and its bias."""
        d = options_of(cfg)
        r = d.markov_rank
        conf = (s.hidden + (r if d.confidence_head_with_markov else 0) + 1) if d.enable_confidence_head else 0
        return 2 * s.vocab * r + conf

    def chunk_bytes(self, s, p, cfg, rows, block_rows, anchors):
        """DSpark drafts every slot (anchor as first) and its loss replaces the plain head's
        (models/variants/dspark/loss.py): it keeps the input gradients it computes in the forward, per
        labelled row (every row, an upper bound) one of h (H, the compute dtype) and of W1[prev] (r,
        float32), and W2's (V x r, float32); each row chunk holds two float32 (rows, V) buffers (the
        slot's softmax and the target's) beside the matmul's output."""
        c, V, r = p.drafter_compute, s.vocab, options_of(cfg).markov_rank
        return ChunkBytes(saved=block_rows * (c * s.hidden + 4 * r) + 4 * V * r,
                          loss=rows * V * (8 + (c if c != 4 else 0)))

    def cost_terms(self, s, cfg, c, block_rows, rows, anchors):
        """Beyond the LM head's forward and input gradient: the teacher's distribution, the frozen head over
        the target's final hidden state (forward only); the Markov bias W2 . W1[prev] (forward, and the
        gradients into W1[prev] and W2); the target's softmax and the L1 term's sign pass, a second float32
        (rows, V) buffer."""
        H, V, r = s.hidden, s.vocab, options_of(cfg).markov_rank
        return {"dspark_teacher_head": Term("matmul", 2 * rows * H * V),
                "dspark_markov": Term("matmul", 3 * 2 * rows * r * V),
                "dspark_teacher_softmax": Term("memory", rows * V * (c + 3 * 4))}


class DominoForecast(DFlashForecast):
    name = "domino"

    def params(self, s, cfg):
        """The bias-free GRU's W_ih (3G x H) and W_hh (3G x G), the delta's W1 (E x (H + G)) and W2 (V x E:
        38.9M at Qwen3-8B's V 151,936 and E 256; models/variants/domino/head.py)."""
        d = options_of(cfg)
        G, E, H = d.gru_hidden_dim, d.emb_dim, s.hidden
        return 3 * G * (H + G) + E * (H + G) + s.vocab * E

    def chunk_bytes(self, s, p, cfg, rows, block_rows, anchors):
        """Every row counted as labelled, as DSpark's: the GRU's autograd keeps per row and slot about ten
        G-wide float32 tensors (the gates' inputs and outputs, the state); the delta keeps [h; s] (H + G),
        W1's output and SiLU's (2E), float32; the loss keeps the input gradients it computes in the forward
        (models/variants/domino/loss.py) of h (H, the compute dtype) and of the delta features (E, float32)
        and W2's (V x E, float32); each row chunk holds two float32 (rows, V) buffers (the base logits'
        softmax and the final's) beside the head matmul's output, four under target_full (p_t and a
        scratch too: domino_loss._distill_chunk)."""
        d = options_of(cfg)
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
        d = options_of(cfg)
        H, V, G, E, R = s.hidden, s.vocab, d.gru_hidden_dim, d.emb_dim, block_rows
        return {"domino_gru": Term("matmul", 3 * 2 * R * 3 * G * (H + G)),
                "domino_delta": Term("matmul", 3 * 2 * rows * E * (H + G + V)),
                "domino_gru_elementwise": Term("memory", 3 * R * 3 * G * 4 * 4),
                "domino_final_softmax": Term("memory", rows * V * (4 + 3 * 4))}

    def distill_passes(self, cfg):
        """Domino distils both its logits while lambda is strictly between 0 and 1 (the first
        objective.domino_lambda_fraction of the run), then its final logits alone: 1 + f passes a batch
        on average."""
        return 1.0 + options_of(cfg).lambda_fraction


FORECASTS: dict[str, DFlashForecast] = {f.name: f for f in (DFlashForecast(), DFlash2Forecast(), DSparkForecast(),
                                                            DominoForecast())}


def forecast_of(cfg: Config) -> DFlashForecast:
    """The variant's forecast terms: its own (`Variant.forecast`, a variant registered from outside the
    package), else this module's object of its name."""
    name = cfg.model.draft.variant
    own = variant_of(name).forecast  # an unknown name: the registry's ConfigError naming the key
    if own is not None:
        return own
    try:
        return FORECASTS[name]
    except KeyError:
        raise ConfigError(f"config key 'model.draft.variant': {name!r} has no forecast terms "
                          f"(forecast/variants.py knows {', '.join(FORECASTS)}; a variant registered from "
                          "outside declares its own as Variant.forecast)") from None


def draft_param_count(s: ModelShapes, cfg: Config) -> int:
    """The drafter's parameters: the DFlash drafter's and its variant's own."""
    return s.draft_params + forecast_of(cfg).params(s, cfg)
