"""Masks, plans, the plan cache and packing from Python (numpy only)."""

import threading

import numpy as np
import pytest

import tessera
from _reference import dense_mask


def rng(seed):
    return np.random.default_rng(seed)


def packed_ids(r, rows, length, max_doc, pad=True):
    out = np.full((rows, length), -1, dtype=np.int64)
    for b in range(rows):
        end = length - (int(r.integers(0, length // 4)) if pad else 0)
        i, d = 0, 0
        while i < end:
            n = int(min(r.integers(1, max_doc + 1), end - i))
            out[b, i : i + n] = d
            i, d = i + n, d + 1
    return out


# -- masks -------------------------------------------------------------------------------------


def test_typed_and_text_masks_have_the_same_canonical_form():
    ids = np.repeat(np.arange(3), 5)
    pairs = [
        (tessera.causal() & tessera.document(ids), tessera.mask("causal & document", segments=ids)),
        (tessera.window(4, 2) | tessera.prefix(3), tessera.mask("window(4, 2) | prefix(3)")),
        (~tessera.chunk(8) & tessera.causal(2), tessera.mask("!chunk(8) & causal(offset=2)")),
        (tessera.heads([tessera.causal(), tessera.full()]), tessera.mask("heads(causal, full)")),
        (tessera.window(4096), tessera.mask("window(4K)")),
    ]
    for typed, text in pairs:
        assert str(typed) == str(text)
        assert typed == text and hash(typed) == hash(text)
    assert str(tessera.causal()) != str(tessera.causal(1))
    # Data is part of the mask: other ids, another mask.
    assert tessera.document(ids) != tessera.document(ids[::-1].copy())


def test_mask_semantics_match_spec():
    r = rng(1)
    ids = np.array([0, 0, 1, 1, 1, -1, 2, 2])
    dense = r.random((8, 8)) < 0.5
    m = (
        (tessera.causal() & tessera.document(ids))
        | (tessera.window(1, 1) & ~tessera.chunk(3))
        | (tessera.prefix(2) & tessera.dense(dense))
    )
    got = dense_mask(m, 1, 1, 8, 8)[0, 0]
    i, j = np.arange(8)[:, None], np.arange(8)[None, :]
    want = (
        ((i >= j) & (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0))
        | ((i - 1 <= j) & (j <= i + 1) & ~(i // 3 == j // 3))
        | ((j < 2) & dense)
    )
    assert (got == want).all()


def test_mask_inputs_accept_lists_torch_and_2d_ids():
    torch = pytest.importorskip("torch")
    a = tessera.document([0, 0, 1])
    b = tessera.document(torch.tensor([0, 0, 1]))
    c = tessera.document(np.array([[0, 0, 1]], dtype=np.int32))
    assert str(a) == str(b)
    assert c.allowed(0, 1) and not c.allowed(0, 2)


@pytest.mark.parametrize(
    "call, exc, name",
    [
        (lambda: tessera.window(-1), ValueError, "window"),
        (lambda: tessera.chunk(0), ValueError, "chunk"),
        (lambda: tessera.document(np.array([0.5, 1.0])), TypeError, "ids"),
        (lambda: tessera.document(np.zeros((2, 2, 2), dtype=int)), ValueError, "ids"),
        (lambda: tessera.dense(np.array([[0.2]])), TypeError, "dense"),
        (lambda: tessera.heads([]), ValueError, "heads"),
        (lambda: tessera.heads([tessera.causal(), 3]), TypeError, "heads"),
        (lambda: tessera.mask("causal &"), ValueError, "column"),
        (lambda: tessera.mask("causl"), ValueError, "column"),
        (lambda: tessera.mask("document"), ValueError, "document"),
        (lambda: tessera.mask("dense(m)"), ValueError, "dense(m)"),
        (lambda: tessera.mask(5), TypeError, "expr"),
        (lambda: tessera.mask("(" * 1000 + "causal" + ")" * 1000), ValueError, "levels of nesting"),
        (lambda: tessera.mask("causal", q_segments=[0]), ValueError, "segments"),
    ],
)
def test_bad_masks_raise_naming_the_argument(call, exc, name):
    with pytest.raises(exc, match=None) as e:
        call()
    assert name in str(e.value)


def test_text_mask_with_cross_segments_and_dense_table():
    q = np.array([0, 0, 1, 1])
    kv = np.array([0, 1, 1, 1, 1, -1])
    m = tessera.mask("document & !dense(x)", q_segments=q, kv_segments=kv, dense={"x": np.eye(4, 6, dtype=bool)})
    got = dense_mask(m, 1, 1, 4, 6)[0, 0]
    want = (q[:, None] == kv[None, :]) & (kv[None, :] >= 0) & ~np.eye(4, 6, dtype=bool)
    assert (got == want).all()


# -- plans -------------------------------------------------------------------------------------


def brute_states(allowed, tq, tk):
    """Tile states of a dense [G, Lq, Lkv] mask: 0 empty, 1 partial, 2 full (in-range pairs)."""
    g, lq, lkv = allowed.shape
    nq, nk = -(-lq // tq), -(-lkv // tk)
    out = np.zeros((g, nq, nk), dtype=np.uint8)
    for a in range(nq):
        for c in range(nk):
            t = allowed[:, a * tq : (a + 1) * tq, c * tk : (c + 1) * tk]
            anyv, allv = t.any(axis=(1, 2)), t.all(axis=(1, 2))
            out[:, a, c] = np.where(allv, 2, np.where(anyv, 1, 0))
    return out


def random_masks(r, lq, lkv, b):
    ids = packed_ids(r, b, max(lq, lkv), 9)
    return [
        tessera.causal(),
        tessera.causal(int(r.integers(-5, 6))),
        tessera.window(int(r.integers(0, 9)), int(r.integers(0, 4))),
        tessera.chunk(int(r.integers(1, 12))) & tessera.causal(),
        tessera.causal() | tessera.prefix(int(r.integers(0, 10))),
        ~tessera.window(3) & tessera.full(),
        tessera.document(ids[:, :lq], ids[:, :lkv]) & tessera.causal(),
        tessera.dense(r.random((lq, lkv)) < 0.3) | tessera.window(2),
        tessera.heads([tessera.causal(), tessera.window(4), ~tessera.causal()]),
    ]


@pytest.mark.parametrize("seed", range(6))
def test_plan_states_equal_brute_force(seed):
    r = rng(100 + seed)
    lq, lkv = int(r.integers(1, 70)), int(r.integers(1, 70))
    b = int(r.integers(1, 3))
    tq, tk = [16, 32, 64][r.integers(0, 3)], [16, 32, 64][r.integers(0, 3)]
    for m in random_masks(r, lq, lkv, b):
        heads = 3
        p = tessera.plan(m, q_len=lq, kv_len=lkv, heads=heads, batch=b, block=(tq, tk), cache=False)
        gb, gh = p.groups
        dense = dense_mask(m, b, heads, lq, lkv)[:gb, :gh].reshape(gb * gh, lq, lkv)
        want = brute_states(dense, tq, tk).reshape(gb, gh, -(-lq // tq), -(-lkv // tk))
        st = p.states()
        assert st.dtype == np.uint8 and st.shape == want.shape
        assert (st == want).all(), str(m)
        s = p.stats
        assert s["empty_tiles"] + s["partial_tiles"] + s["full_tiles"] == s["tiles"] == st.size
        assert s["allowed_pairs"] == int(dense_mask(m, b, heads, lq, lkv).sum())
        assert s["full_tiles"] == int((st == 2).sum()) and s["partial_tiles"] == int((st == 1).sum())


def test_plan_defaults_repr_cache_and_png(tmp_path):
    ids = packed_ids(rng(3), 2, 300, 120)
    m = tessera.causal() & tessera.document(ids)
    p = tessera.plan(m, q_len=300, block=64)
    assert p.shape == (2, 1, 300, 300) and p.block == (64, 64) and p.groups == (2, 1)
    text = repr(p)
    assert text.startswith("tessera.Plan(") and "░░" in text and "partial" in text
    before = tessera.cache_stats()
    again = tessera.plan(m, q_len=300, block=64)
    after = tessera.cache_stats()
    assert again.source == "memory" and again.contract == p.contract
    assert after["memory_hits"] == before["memory_hits"] + 1
    assert tessera.plan(m, q_len=300, block=64, cache=False).source == "built"
    png = tmp_path / "plan.png"
    p.save_png(str(png), batch=1)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="batch"):
        p.save_png(str(png), batch=2)
    assert p.flops(64) == 4 * 64 * p.stats["allowed_pairs"]


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(q_len=0), "q_len"),
        (dict(q_len=64, block=24), "block"),
        (dict(q_len=64, block=(16, 16, 16)), "block"),
        (dict(q_len=64, heads=0), "heads"),
    ],
)
def test_bad_plans_raise(kwargs, name):
    with pytest.raises(ValueError) as e:
        tessera.plan(tessera.causal(), **kwargs)
    assert name in str(e.value)


def test_plan_rejects_data_of_the_wrong_length():
    with pytest.raises(ValueError, match="segment"):
        tessera.plan(tessera.document(np.zeros(10, dtype=int)), q_len=12)
    with pytest.raises(TypeError):
        tessera.plan("causal", q_len=8)


def test_two_threads_planning_at_once_agree():
    ids = packed_ids(rng(5), 1, 4096, 700)
    m = tessera.causal() & tessera.document(ids)
    out = [None, None]

    def work(i):
        out[i] = tessera.plan(m, q_len=4096, block=64, cache=False).states()

    ts = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert (out[0] == out[1]).all()


# -- packing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", ["best-fit", "greedy"])
def test_pack_invariants(strategy):
    r = rng(7)
    docs = [r.integers(0, 255, int(n)).tolist() for n in r.integers(0, 90, 40)]
    out = tessera.pack(docs, 64, strategy=strategy, bos=256)
    tok, seg, pos = out["tokens"], out["segment_ids"], out["positions"]
    assert tok.shape == seg.shape == pos.shape and tok.shape[1] == 64 and tok.dtype == np.int32
    nonempty = [d for d in docs if d]
    pieces = []
    for row in range(tok.shape[0]):
        s = seg[row]
        valid = s >= 0
        assert (tok[row][~valid] == 0).all() and (pos[row][~valid] == 0).all()
        for d in np.unique(s[valid]):
            idx = np.nonzero(s == d)[0]
            assert (np.diff(idx) == 1).all()  # contiguous
            assert tok[row, idx[0]] == 256 and (pos[row, idx] == np.arange(len(idx))).all()
            pieces.append(tok[row, idx[1:]].tolist())
    # Every document's tokens are there, split into row-sized pieces in order.
    assert sum(len(p) for p in pieces) == sum(len(d) for d in nonempty)
    assert out["stats"]["documents"] == len(nonempty)
    assert sorted(sum(nonempty, [])) == sorted(sum(pieces, []))


def test_pack_feeds_document_masks_and_rejects_bad_input():
    out = tessera.pack([[1, 2, 3], [4, 5]], 8)
    m = tessera.causal() & tessera.document(out["segment_ids"])
    p = tessera.plan(m, q_len=8, block=16)
    assert p.stats["allowed_pairs"] == 4 * 5 // 2 + 3 * 4 // 2
    with pytest.raises(ValueError, match="seq_len"):
        tessera.pack([[1]], 1)
    with pytest.raises(ValueError, match="docs\\[1\\]"):
        tessera.pack([[1], [-3]], 8)
    with pytest.raises(TypeError, match="docs\\[0\\]"):
        tessera.pack([[0.5]], 8)
    with pytest.raises(ValueError, match="strategy"):
        tessera.pack([[1]], 8, strategy="random")
