"""Every attention path equals the reference, and the reference equals a dense float64 oracle; the
warm-up decides paths and falls back before training starts.

Float32, tight tolerance, packed layouts with length-1 sequences, sequences that cross flex's 128-token
tiles, GQA and MHA. flex runs uncompiled here (same mask function and block mask; the compiled kernel
also skips tiles, which test_block_mask_tiles_are_exact checks); the test marked slow runs the compiled
kernel on CPU (about 20 s of compiling). flash-attn needs CUDA and is checked by bench/gpu_check.py.
Each test gets a fresh `attn.backend`, so no choice or failure leaks between tests.
"""
import logging
import warnings

import pytest
import torch

from dflash_dist.models import attention as attn

TOL = dict(atol=2e-6, rtol=1e-5)
LAYOUTS = {
    "one_seq": [200],
    "with_len1": [1, 129, 1, 269, 300, 1],
    "many_short": [3, 1, 7, 2, 5, 1, 9, 4] * 3,
    "tile_edges": [128, 128, 127, 129, 256],
}
HEADS = {"gqa": (4, 2), "mqa": (4, 1), "mha": (2, 2)}


@pytest.fixture(autouse=True)
def fresh_backend(monkeypatch, request):
    monkeypatch.delenv("DFLASH_ATTN", raising=False)
    compiled = request.node.get_closest_marker("slow") is not None  # the compiler only where marked slow
    monkeypatch.setattr(attn, "backend", attn.AttentionBackend(compile_flex=compiled))
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")


def cu_of(lengths):
    return torch.tensor([0] + lengths).cumsum(0)


def qkv(n, h, h_kv, d=8, seed=0, lead=()):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*lead, n, h, d, generator=g), torch.randn(*lead, n, h_kv, d, generator=g),
            torch.randn(*lead, n, h_kv, d, generator=g))


def dense_oracle(q, k, v, allowed):
    """allowed: (Q, K) bool. Plain softmax attention in float64."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1).double(), v.repeat_interleave(rep, 1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * q.shape[-1] ** -0.5
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", p, v).float()


def causal_allowed(cu):
    n = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    i = torch.arange(n)
    return (seq[:, None] == seq[None, :]) & (i[None, :] <= i[:, None])


def drafter_case(lengths, h, h_kv, B=4, d=8, seed=1):
    """Blocks over every sequence; anchors include position 0 (empty context) and the last legal one."""
    cu = cu_of(lengths)
    g = torch.Generator().manual_seed(seed)
    starts, ends = [], []
    for s, L in zip(cu[:-1].tolist(), lengths):
        pos = sorted({0, L - 1} | set(torch.randint(0, L, (3,), generator=g).tolist()))
        starts += [s] * len(pos)
        ends += [s + p for p in pos]
    A = len(starts)
    q, kb, vb = qkv(A * B, h, h_kv, d, seed, ())
    k, v = qkv(int(cu[-1]), h_kv, h_kv, d, seed + 1)[1:]
    return (q.view(A, B, h, d), k, v, kb.view(A, B, h_kv, d), vb.view(A, B, h_kv, d),
            torch.tensor(starts), torch.tensor(ends))


def block_allowed(n, starts, ends, B):
    A = len(starts)
    kv = torch.arange(n + A * B)
    blk = torch.arange(A * B) // B
    ctx = (kv[None, :] >= starts[blk][:, None]) & (kv[None, :] < ends[blk][:, None])
    own = (kv[None, :] >= n + blk[:, None] * B) & (kv[None, :] < n + blk[:, None] * B + B)
    return ctx | own


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", HEADS)
def test_packed_causal_paths_equal_reference(layout, heads):
    cu = cu_of(LAYOUTS[layout])
    q, k, v = qkv(int(cu[-1]), *HEADS[heads])
    ref = attn.packed_causal_attention(q, k, v, cu, impl="ref")
    torch.testing.assert_close(ref, dense_oracle(q, k, v, causal_allowed(cu)), **TOL)
    torch.testing.assert_close(attn.packed_causal_attention(q, k, v, cu, impl="flex"), ref, **TOL)


def per_sequence_reference(q, k, v, kb, vb, starts, ends):
    """The reference core one sequence at a time (what every packed path is compared with)."""
    out = torch.empty_like(q)
    for s in starts.unique().tolist():
        j = starts == s
        L = int(ends[j].max()) - s + 1
        out[j] = attn._ref_block(q[j], k[s:s + L], v[s:s + L], kb[j], vb[j], ends[j] - s)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("heads", ["gqa", "mha"])
def test_block_paths_equal_reference(layout, heads):
    lengths = LAYOUTS[layout]
    q, k, v, kb, vb, starts, ends = drafter_case(lengths, *HEADS[heads])
    A, B, n = q.shape[0], q.shape[1], k.shape[0]
    oracle = dense_oracle(q.flatten(0, 1), torch.cat([k, kb.flatten(0, 1)]), torch.cat([v, vb.flatten(0, 1)]),
                          block_allowed(n, starts, ends, B)).view(q.shape)
    per_seq = per_sequence_reference(q, k, v, kb, vb, starts, ends)
    torch.testing.assert_close(per_seq, oracle, **TOL)
    for impl in ("ref", "sdpa", "flex"):
        got = attn.packed_block_attention(q, k, v, kb, vb, starts, ends, impl=impl)
        torch.testing.assert_close(got, per_seq, **TOL)
        # Prepared once (as the drafter does per chunk) and reused: the same answer, and the same path.
        prep = attn.prepare_block_attention(starts, ends, n, A, B, like=q, impl=impl)
        assert prep.path == impl
        for _ in range(2):
            got = attn.packed_block_attention(q, k, v, kb, vb, starts, ends, prepared=prep)
            torch.testing.assert_close(got, per_seq, **TOL)
    # Runs cut into SDPA calls of a few blocks each, and GQA folded into the batch dimension (the CUDA
    # layout), give the same answer.
    for group in (2, attn.SDPA_GROUP):
        for fold in (False, True):
            got = attn._sdpa_block(q, k, v, kb, vb, ends, attn._block_runs(starts, ends, group), fold_gqa=fold)
            torch.testing.assert_close(got, per_seq, **TOL)
    # One sequence alone, its context starting at row 0.
    s0 = int(starts[0])
    one = starts == s0
    L = int(ends[one].max()) - s0
    for impl in ("ref", "sdpa", "flex"):
        got = attn.packed_block_attention(q[one], k[s0:s0 + L], v[s0:s0 + L], kb[one], vb[one],
                                          torch.zeros_like(starts[one]), ends[one] - s0, impl=impl)
        torch.testing.assert_close(got, per_seq[one], **TOL)


def test_prepared_for_other_shapes_is_refused():
    q, k, v, kb, vb, starts, ends = drafter_case(LAYOUTS["with_len1"], 4, 2)
    prep = attn.prepare_block_attention(starts, ends, k.shape[0] + 1, q.shape[0], q.shape[1], like=q, impl="sdpa")
    with pytest.raises(ValueError, match="prepared block attention is for N="):
        attn.packed_block_attention(q, k, v, kb, vb, starts, ends, prepared=prep)


def block_grads(case, impl, dev):
    leaves = [t.to(dev).requires_grad_() for t in case[:5]]
    out = attn.packed_block_attention(*leaves, *(t.to(dev) for t in case[5:]), impl=impl)
    (out * torch.linspace(-1, 1, out.numel(), device=dev).view(out.shape)).sum().backward()
    return [t.grad for t in leaves]


# flex_attention has no backward on CPU, and the dispatcher never picks it there for training; its
# gradients are checked where CUDA exists (here, and in bench/gpu_check.py on a GPU machine).
@pytest.mark.parametrize("impl", ["sdpa"] + (["flex"] if torch.cuda.is_available() else []))
def test_block_gradients_equal_reference(impl):
    """The drafter trains through this op: gradients must match too."""
    dev = "cuda" if impl == "flex" else "cpu"
    case = drafter_case(LAYOUTS["with_len1"], 4, 2)
    for g, g_ref in zip(block_grads(case, impl, dev), block_grads(case, "ref", dev)):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


def test_folded_gqa_gradients_equal_reference():
    """The CUDA layout of the SDPA fallback (query heads folded into the batch, k/v expanded without a
    copy) trains the same: its gradients reach k/v through the expansion."""
    case = drafter_case(LAYOUTS["with_len1"], 4, 2)
    runs = attn._block_runs(case[5], case[6], 3)
    leaves = [t.clone().requires_grad_() for t in case[:5]]
    out = attn._sdpa_block(*leaves, case[6], runs, fold_gqa=True)
    (out * torch.linspace(-1, 1, out.numel()).view(out.shape)).sum().backward()
    for g, g_ref in zip([t.grad for t in leaves], block_grads(case, "ref", "cpu")):
        torch.testing.assert_close(g, g_ref, atol=1e-5, rtol=1e-5)


def tiles(allowed, tile):
    """Dense truth per tile: any allowed pair, and all pairs allowed (full-size tiles only)."""
    Q, K = allowed.shape
    qt, kt = -(-Q // tile), -(-K // tile)
    pad = torch.zeros(qt * tile, kt * tile, dtype=torch.bool)
    pad[:Q, :K] = allowed
    t = pad.view(qt, tile, kt, tile)
    valid = torch.zeros_like(pad)
    valid[:Q, :K] = True
    whole = valid.view(qt, tile, kt, tile).all(3).all(1)
    return t.any(3).any(1), t.all(3).all(1) & whole


@pytest.mark.parametrize("layout", LAYOUTS)
def test_block_mask_tiles_are_exact(layout):
    """Skipped tiles hold no allowed pair; full tiles (mask function skipped) hold only allowed pairs;
    and no tile that could be full is left partial. Small tiles make every layout cross many of them."""
    tile = 16
    cu = cu_of(LAYOUTS[layout])
    n = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), cu.diff())
    m = attn.interval_block_mask(cu[seq], torch.arange(1, n + 1), None, None, kv_len=n, tile=tile)
    _, _, starts, ends = drafter_case(LAYOUTS[layout], 2, 2, B=5)[3:]
    A = len(starts)
    blk = torch.arange(A * 5) // 5
    m2 = attn.interval_block_mask(starts[blk], ends[blk], n + blk * 5, n + blk * 5 + 5, kv_len=n + A * 5, tile=tile)
    for mask, allowed in ((m, causal_allowed(cu)), (m2, block_allowed(n, starts, ends, 5))):
        any_t, full_t = tiles(allowed, tile)
        full = attn.BlockMask.to_dense(mask.__class__.from_kv_blocks(mask.full_kv_num_blocks, mask.full_kv_indices,
                                                                     BLOCK_SIZE=tile))[0, 0].bool()
        assert torch.equal(mask.to_dense()[0, 0].bool(), any_t)
        assert torch.equal(full, full_t)


def test_auto_choice_on_cpu_and_bad_requests(monkeypatch):
    q = torch.zeros(4, 2, 8)
    assert attn.resolve("auto", "causal", q) == "ref"
    assert attn.resolve("auto", "block", q) == "sdpa"
    assert attn.resolve("sdpa", "causal", q) == "ref"  # the causal reference is the SDPA loop
    assert attn.resolve("flex", "causal", q) == "flex"
    with pytest.raises(ValueError, match="flash"):
        attn.resolve("flash", "causal", q)
    with pytest.raises(ValueError, match="expected one of"):
        attn.resolve("fast", "causal", q)
    with pytest.raises(ValueError, match="expected one of"):
        attn.backend.use("fast")
    # DFLASH_ATTN is read when the op runs, not when the module is imported; backend.use overrides it.
    monkeypatch.setenv("DFLASH_ATTN", "ref")
    assert attn.resolve(None, "block", q) == "ref"
    attn.backend.use("flex")
    assert attn.resolve(None, "block", q) == "flex"
    attn.backend.use(None)
    monkeypatch.setenv("DFLASH_ATTN", "fastest")
    with pytest.raises(ValueError, match="DFLASH_ATTN"):
        attn.resolve(None, "block", q)


WARM = dict(heads=4, kv_heads=2, head_dim=8, block_size=4)


def test_warm_up_on_cpu_reports_the_reference_paths():
    rep = attn.warm_up(torch.device("cpu"), torch.float32, **WARM)
    assert {op: r["path"] for op, r in rep.items()} == {"causal": "ref", "block": "sdpa"}
    assert all(r["graphs"] == [0] and "flex_error" not in r for r in rep.values())
    assert attn.backend.warmed and attn.backend.compile_stats()["late_graphs"] == 0


def test_warm_up_falls_back_when_flex_backward_fails(monkeypatch, caplog):
    """flex_attention has no backward on CPU: let "auto" pick flex here anyway, and the warm-up must find
    the failure (in the drafter op's backward pass), give the op its fallback and exercise that, while the
    causal op (forward only) keeps flex."""
    monkeypatch.setattr(attn.AttentionBackend, "flex_eligible", lambda self, op, x: op not in self.failed)
    with caplog.at_level(logging.WARNING, logger=attn.__name__):
        rep = attn.warm_up(torch.device("cpu"), torch.float32, **WARM)
    assert rep["causal"]["path"] == "flex" and len(rep["causal"]["graphs"]) == 3
    assert rep["block"]["path"] == "sdpa" and "backward" in rep["block"]["flex_error"]
    assert "block" in attn.backend.failed and "causal" not in attn.backend.failed
    assert sum("using sdpa for it from now on" in r.getMessage() for r in caplog.records) == 1
    # From now on the block op resolves to its fallback, prepared or not.
    q, k, v, kb, vb, starts, ends = drafter_case(LAYOUTS["with_len1"], 4, 2)
    assert attn.prepare_block_attention(starts, ends, k.shape[0], *q.shape[:2], like=q).path == "sdpa"
    got = attn.packed_block_attention(*(t.requires_grad_() for t in (q, k, v, kb, vb)), starts, ends)
    got.sum().backward()
    torch.testing.assert_close(got, per_sequence_reference(q, k, v, kb, vb, starts, ends), **TOL)


def test_flex_failure_mid_run_falls_back_once_for_a_shared_prepared_mask(monkeypatch, caplog):
    """Without a warm-up, the first layer that fails gives the op its fallback; the chunk's later layers
    reuse the same prepared flex mask and go straight to the fallback, with no second warning."""
    monkeypatch.setattr(attn.AttentionBackend, "flex_eligible", lambda self, op, x: op not in self.failed)
    q, k, v, kb, vb, starts, ends = drafter_case(LAYOUTS["with_len1"], 4, 2)
    prep = attn.prepare_block_attention(starts, ends, k.shape[0], *q.shape[:2], like=q)
    assert prep.path == "flex"
    want = per_sequence_reference(q, k, v, kb, vb, starts, ends)
    with caplog.at_level(logging.WARNING, logger=attn.__name__):
        for _ in range(3):  # three "layers"; on CPU flex refuses inputs that need a gradient
            leaves = [t.clone().requires_grad_() for t in (q, k, v, kb, vb)]
            got = attn.packed_block_attention(*leaves, starts, ends, prepared=prep)
            torch.testing.assert_close(got, want, **TOL)
    assert sum("flex attention failed" in r.getMessage() for r in caplog.records) == 1


def test_warm_up_raises_for_an_explicit_path_that_fails():
    with pytest.raises(RuntimeError, match="the block op's 'flex' path failed on cpu"):
        attn.warm_up(torch.device("cpu"), torch.float32, ops=("block",), impl="flex", **WARM)
    assert not attn.backend.failed  # an explicit request is never silently replaced


def test_compiles_after_the_warm_up_are_counted_late(monkeypatch, caplog):
    """Counting only (no compiler here): a kernel that reports one new graph per new query length."""
    seen, compiled = set(), [0]

    def kernel(q, k, v, mask, gqa):
        if q.shape[2] not in seen:
            seen.add(q.shape[2])
            compiled[0] += 1
        return attn.flex_attention(q, k, v, block_mask=mask, enable_gqa=gqa)

    monkeypatch.setattr(attn, "_graphs_compiled", lambda: compiled[0])
    attn.backend.compile_flex = True
    attn.backend._kernels["causal"] = kernel
    monkeypatch.setattr(attn.AttentionBackend, "flex_eligible", lambda self, op, x: True)
    rep = attn.warm_up(torch.device("cpu"), torch.float32, ops=("causal",), **WARM)
    assert rep["causal"]["graphs"] == [1, 1, 1]
    assert attn.backend.compile_stats() == {"graphs": {"causal": 3}, "late_graphs": 0, "failed": {}}
    cu = cu_of([300, 211])  # a length the warm-up never saw
    q, k, v = qkv(511, 4, 2)
    with caplog.at_level(logging.WARNING, logger=attn.__name__):
        attn.packed_causal_attention(q, k, v, cu)
        attn.packed_causal_attention(q, k, v, cu)
    assert attn.backend.compile_stats()["late_graphs"] == 1
    assert sum("after the warm-up" in r.getMessage() for r in caplog.records) == 1


def test_short_calls_are_padded_to_two_tiles():
    """A 40-token batch runs flex on (at least) 2 x 2 tiles: no size-1 specialisation in a compiled graph."""
    cu = cu_of([25, 15])
    seq = torch.repeat_interleave(torch.arange(2), cu.diff())
    m = attn.interval_block_mask(cu[seq], torch.arange(1, 41), None, None, kv_len=40, min_len=2 * attn.TILE)
    assert m.seq_lengths == (256, 256) and m.kv_num_blocks.shape[-1] == 2
    q, k, v = qkv(40, 4, 2)
    torch.testing.assert_close(attn.packed_causal_attention(q, k, v, cu, impl="flex"),
                               attn.packed_causal_attention(q, k, v, cu, impl="ref"), **TOL)


