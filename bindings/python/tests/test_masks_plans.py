"""Masks and plans from Python (numpy only): the typed and text mask forms, mask semantics against
an independent numpy model of docs/semantics.md#masks, bad inputs, plan tile states against a brute-force
classification (docs/semantics.md#plans), plan statistics, the text picture, the plan cache (memory hits in
process, disk hits and rejected entries across processes) and planning from several threads."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import tessera
from conftest import (
    brute_states,
    causal,
    chunk,
    dense,
    document,
    full,
    heads,
    packed_ids,
    prefix,
    random_mask,
    window,
)

# -- mask forms ---------------------------------------------------------------------------------


def test_typed_and_text_masks_print_the_same_canonical_form():
    ids = np.repeat(np.arange(3), 5)
    d = np.eye(15, dtype=bool)
    pairs = [
        (tessera.full(), "full"),
        (tessera.causal(), "causal"),
        (tessera.causal(), "causal(offset=0)"),
        (tessera.causal(2), "causal(offset=2)"),
        (tessera.causal(-7), "causal(offset=-7)"),
        (tessera.window(4), "window(4)"),
        (tessera.window(4), "window(4, 0)"),
        (tessera.window(4, 2), "window(4,2)"),
        (tessera.window(4096), "window(4K)"),
        (tessera.window(2 * 1024 * 1024, 1024), "window(2M, 1K)"),
        (tessera.chunk(8), "chunk(8)"),
        (tessera.prefix(3), "prefix(3)"),
        (tessera.causal() & tessera.document(ids), "causal & document"),
        (tessera.document(ids) & tessera.causal(), "  causal&document  "),
        (tessera.window(4, 2) | tessera.prefix(3), "window(4, 2) | prefix(3)"),
        (~tessera.chunk(8) & tessera.causal(2), "!chunk(8) & causal(offset=2)"),
        (~(tessera.causal() | tessera.prefix(5)), "!(causal | prefix(5))"),
        (tessera.heads([tessera.causal(), tessera.full()]), "heads(causal, full)"),
        (tessera.heads([tessera.causal() & tessera.window(3), ~tessera.full()]),
         "heads((causal & window(3)), !full)"),
        (tessera.dense(d) & tessera.causal(), "dense(m) & causal"),
        ((tessera.causal() | tessera.prefix(2)) & tessera.window(5), "(causal | prefix(2)) & window(5)"),
    ]
    for typed, text in pairs:
        parsed = tessera.mask(text, segments=ids, dense={"m": d})
        assert typed.canonical() == parsed.canonical(), text
        assert typed == parsed and hash(typed) == hash(parsed), text
        assert repr(typed) == f"tessera.Mask('{typed}')"
        # the text form parses back to the same mask, given the data it names
        assert tessera.mask(str(typed), **typed.data()) == typed, str(typed)


def test_canonical_form_distinguishes_masks_and_data():
    ids = np.repeat(np.arange(3), 5)
    distinct = [
        tessera.causal(),
        tessera.causal(1),
        tessera.window(3),
        tessera.window(3, 1),
        tessera.chunk(3),
        tessera.prefix(3),
        tessera.full(),
        ~tessera.causal(),
        tessera.document(ids),
        tessera.document(ids[::-1].copy()),
        tessera.document(ids, ids[:7].copy()),
        tessera.dense(np.eye(4, dtype=bool)),
        tessera.dense(~np.eye(4, dtype=bool)),
        tessera.heads([tessera.causal(), tessera.full()]),
        tessera.heads([tessera.full(), tessera.causal()]),
    ]
    texts = [m.canonical() for m in distinct]
    assert len(set(texts)) == len(texts), texts
    # masks are hashable values: usable as dict keys, equal by canonical form
    table = {m: i for i, m in enumerate(distinct)}
    assert table[tessera.causal(1)] == 1 and table[tessera.document(ids.copy())] == 8
    assert tessera.causal() != "causal(offset=0)"
    # & and | are commutative in the canonical form
    a, b = tessera.window(5, 1), tessera.prefix(9)
    assert a & b == b & a and a | b == b | a


def test_random_expressions_typed_and_text_agree(rng):
    checked = 0
    for _ in range(40):
        lq = int(rng.integers(1, 40))
        m = random_mask(rng, lq, lq, 2, 3, depth=3)
        if m.text is None:
            continue
        assert m.parse().canonical() == m.t.canonical(), m.text
        checked += 1
    assert checked >= 15


# -- mask semantics -----------------------------------------------------------------------------


def test_leaf_semantics_match_spec_pair_by_pair():
    lq, lkv = 13, 17
    i, j = np.arange(lq)[:, None], np.arange(lkv)[None, :]
    ids_q = np.array([0, 0, 0, 1, 1, -1, 2, 2, 2, 2, 0, 0, -3])  # id 0 also reappears later
    ids_k = np.array([0, 0, 1, 1, 1, 1, -1, 2, 2, 0, 0, 5, 5, 5, -1, -1, 2])
    dm = np.random.default_rng(5).random((lq, lkv)) < 0.5
    cases = [
        (tessera.full(), np.ones((lq, lkv), bool)),
        (tessera.causal(), i >= j),
        (tessera.causal(3), i + 3 >= j),
        (tessera.causal(-4), i - 4 >= j),
        (tessera.window(2), (i - 2 <= j) & (j <= i)),
        (tessera.window(1, 3), (i - 1 <= j) & (j <= i + 3)),
        (tessera.window(0, 0), i == j),
        (tessera.chunk(4), i // 4 == j // 4),
        (tessera.prefix(5), np.broadcast_to(j < 5, (lq, lkv))),
        (tessera.prefix(0), np.zeros((lq, lkv), bool)),
        (tessera.document(ids_q, ids_k),
         (ids_q[:, None] == ids_k[None, :]) & (ids_q[:, None] >= 0) & (ids_k[None, :] >= 0)),
        (tessera.dense(dm), dm),
        (~tessera.causal(), ~(i >= j)),
        (tessera.chunk(5) & tessera.causal(), (i // 5 == j // 5) & (i >= j)),
        (tessera.causal() | tessera.prefix(4), (i >= j) | (j < 4)),
    ]
    for m, want in cases:
        got = np.array([[m.allowed(a, c) for c in range(lkv)] for a in range(lq)])
        assert (got == want).all(), str(m)


def test_padding_ids_never_match_even_themselves():
    ids = np.array([-1, -1, 0, 0, -2, -2, 1])
    m = tessera.document(ids)
    for a in range(7):
        for c in range(7):
            assert m.allowed(a, c) == bool(ids[a] == ids[c] and ids[a] >= 0)


def test_batch_rows_and_heads_select_their_own_masks():
    ids = np.array([[0, 0, 1, 1], [0, 1, 1, -1]])
    d = np.random.default_rng(1).random((2, 3, 4, 4)) < 0.5
    m = tessera.document(ids) & tessera.heads([tessera.full(), tessera.causal(), tessera.window(1)])
    md = tessera.dense(d)
    for b in range(2):
        for h in range(3):
            for a in range(4):
                for c in range(4):
                    head = [True, a >= c, a - 1 <= c <= a][h]
                    doc = ids[b, a] == ids[b, c] and ids[b, a] >= 0
                    assert m.allowed(a, c, b, h) == (doc and head)
                    assert md.allowed(a, c, b, h) == d[b, h, a, c]


def test_random_expressions_match_the_numpy_model(rng):
    for _ in range(25):
        lq, lkv = int(rng.integers(1, 24)), int(rng.integers(1, 24))
        b, h = int(rng.integers(1, 3)), int(rng.integers(1, 4))
        m = random_mask(rng, lq, lkv, b, h, depth=3)
        want = m.dense(b, h, lq, lkv)
        for bi in range(b):
            for hi in range(h):
                got = np.array([[m.t.allowed(a, c, bi, hi) for c in range(lkv)] for a in range(lq)])
                assert (got == want[bi, hi]).all(), str(m.t)


def test_mask_data_accepts_lists_numpy_torch_and_2d_ids():
    torch = pytest.importorskip("torch")
    ref = tessera.document(np.array([0, 0, 1, -1]))
    for ids in ([0, 0, 1, -1], (0, 0, 1, -1), np.array([0, 0, 1, -1], dtype=np.int32),
                np.array([0, 0, 1, -1], dtype=np.int16), torch.tensor([0, 0, 1, -1]),
                torch.tensor([0, 0, 1, -1], dtype=torch.int32)):
        assert tessera.document(ids) == ref
    assert tessera.dense(np.eye(3, dtype=np.uint8)) == tessera.dense(np.eye(3, dtype=bool))
    assert tessera.dense(torch.eye(3, dtype=torch.bool)) == tessera.dense(np.eye(3, dtype=bool))
    assert tessera.dense([[1, 0], [0, 1]]) == tessera.dense(np.eye(2, dtype=bool))
    two = tessera.document(np.array([[0, 0, 1], [0, 1, 1]]))
    assert two.allowed(1, 0, 0) and not two.allowed(1, 0, 1)
    # the arrays are copied: changing them later does not change the mask
    a = np.array([0, 0, 1, 1])
    m = tessera.document(a)
    a[:] = 7
    assert not m.allowed(0, 2)


# -- bad masks -----------------------------------------------------------------------------------

def _case(name, call, exc, needle, xfail=None):
    marks = [pytest.mark.xfail(strict=True, reason=xfail)] if xfail else []
    return pytest.param(call, exc, needle, id=name, marks=marks)


BAD_MASKS = [
    ("chunk_zero", lambda: tessera.chunk(0), ValueError, "chunk"),
    ("ids_float", lambda: tessera.document(np.array([0.5, 1.0])), TypeError, "ids"),
    ("ids_float_list", lambda: tessera.document([0.0, 1.0]), TypeError, "ids"),
    ("ids_bool", lambda: tessera.document(np.array([True, False])), TypeError, "ids"),
    ("ids_str", lambda: tessera.document(["a", "b"]), TypeError, "ids"),
    ("ids_3d", lambda: tessera.document(np.zeros((2, 2, 2), dtype=int)), ValueError, "ids"),
    ("ids_empty", lambda: tessera.document(np.zeros(0, dtype=int)), ValueError, "ids"),
    ("kv_ids_float", lambda: tessera.document([0, 1], [0.5]), TypeError, "kv_ids"),
    ("dense_float", lambda: tessera.dense(np.array([[0.2]])), TypeError, "dense"),
    ("dense_int_2", lambda: tessera.dense(np.array([[0, 2]])), ValueError, "dense"),
    ("dense_1d", lambda: tessera.dense(np.ones(3, bool)), ValueError, "dense"),
    ("dense_5d", lambda: tessera.dense(np.ones((1, 1, 1, 2, 2), bool)), ValueError, "dense"),
    ("dense_empty", lambda: tessera.dense(np.zeros((0, 3), bool)), ValueError, "dense"),
    ("heads_empty", lambda: tessera.heads([]), ValueError, "heads"),
    ("heads_not_mask", lambda: tessera.heads([tessera.causal(), 3]), TypeError, "heads"),
    ("and_int", lambda: tessera.causal() & 3, TypeError, ""),
    ("parse_trailing_op", lambda: tessera.mask("causal &"), ValueError, "column 9"),
    ("parse_unknown_leaf", lambda: tessera.mask("causl"), ValueError, "column 1"),
    ("parse_unclosed", lambda: tessera.mask("window(3"), ValueError, "expected ')'"),
    ("parse_empty", lambda: tessera.mask(""), ValueError, "column"),
    ("parse_chunk_zero", lambda: tessera.mask("chunk(0)"), ValueError, "chunk"),
    ("parse_double_op", lambda: tessera.mask("full & & causal"), ValueError, "column 8"),
    ("parse_fraction", lambda: tessera.mask("causal(offset=1.5)"), ValueError, "column"),
    ("parse_heads_empty", lambda: tessera.mask("heads()"), ValueError, "column"),
    ("parse_no_segments", lambda: tessera.mask("document"), ValueError, "document"),
    ("parse_unknown_dense", lambda: tessera.mask("dense(m)"), ValueError, "dense(m)"),
    ("parse_not_str", lambda: tessera.mask(5), TypeError, "expr"),
    ("parse_deep_nesting", lambda: tessera.mask("(" * 1000 + "causal" + ")" * 1000), ValueError, "nesting"),
    ("parse_half_cross", lambda: tessera.mask("document", q_segments=[0]), ValueError, "segments"),
    ("parse_both_segs", lambda: tessera.mask("document", segments=[0], q_segments=[0], kv_segments=[0]),
     ValueError, "segments"),
    ("parse_float_segments", lambda: tessera.mask("document", segments=[0.5]), TypeError, "segments"),
    ("parse_dense_not_dict", lambda: tessera.mask("dense(m)", dense=[1]), TypeError, "dense"),
    ("parse_dense_float", lambda: tessera.mask("dense(m)", dense={"m": np.array([[0.5]])}), TypeError,
     "dense['m']"),
    # scalar arguments are exact integers in range, named when wrong
    ("chunk_negative", lambda: tessera.chunk(-2), ValueError, "chunk"),
    ("prefix_negative", lambda: tessera.prefix(-1), ValueError, "prefix"),
    ("causal_huge", lambda: tessera.causal(2**70), ValueError, "causal"),
    ("window_huge", lambda: tessera.window(0, 2**70), ValueError, "window"),
    ("window_fraction", lambda: tessera.window(2.5), TypeError, "window"),
    ("chunk_float", lambda: tessera.chunk(4.0), TypeError, "chunk"),
    ("causal_str", lambda: tessera.causal("3"), TypeError, "causal"),
    ("prefix_bool", lambda: tessera.prefix(True), TypeError, "prefix"),
]


@pytest.mark.parametrize("call, exc, name", [_case(*c) for c in BAD_MASKS])
def test_bad_masks_raise_naming_the_argument(call, exc, name):
    with pytest.raises(exc) as e:
        call()
    assert name in str(e.value), str(e.value)


def test_text_and_typed_forms_accept_and_reject_the_same_arguments():
    def outcome(f):
        try:
            return "ok", str(f())
        except ValueError:
            return "error", None

    cases = [
        (lambda: tessera.window(-1), "window(-1)"),
        (lambda: tessera.window(3, -1), "window(3, -1)"),
        (lambda: tessera.window(-2, 5), "window(-2, 5)"),
        (lambda: tessera.causal(-9), "causal(offset=-9)"),
        (lambda: tessera.chunk(0), "chunk(0)"),
        (lambda: tessera.prefix(0), "prefix(0)"),
        (lambda: tessera.window(0), "window(0)"),
    ]
    for typed, text in cases:
        assert outcome(typed) == outcome(lambda: tessera.mask(text)), text


def test_negative_window_sides_follow_the_formula():
    lq, lkv = 20, 26
    i, j = np.arange(lq)[:, None], np.arange(lkv)[None, :]
    for left, right in ((-2, 5), (3, -1), (-4, -2), (0, -1)):
        m = tessera.window(left, right)
        got = np.array([[m.allowed(a, c) for c in range(lkv)] for a in range(lq)])
        assert (got == ((i - left <= j) & (j <= i + right))).all(), (left, right)


def test_parse_errors_name_the_column_and_what_was_expected():
    with pytest.raises(ValueError) as e:
        tessera.mask("causal & windw(3)")
    msg = str(e.value)
    assert "column 10" in msg and "expected" in msg and "windw" in msg


# -- plans: tile states against brute force -----------------------------------------------------


def _check_plan_against_dense(p, want_dense, tq, tk):
    """``want_dense`` bool [B, H, Lq, Lkv] of the full problem."""
    b, h, lq, lkv = want_dense.shape
    assert p.shape == (b, h, lq, lkv)
    gb, gh = p.groups
    assert gb in (1, b) and gh in (1, h)
    # a group dimension of 1 means the mask does not vary along it
    if gb == 1:
        assert (want_dense == want_dense[:1]).all()
    if gh == 1:
        assert (want_dense == want_dense[:, :1]).all()
    grp = want_dense[:gb, :gh]
    want = brute_states(grp, tq, tk)
    st = p.states()
    assert st.dtype == np.uint8 and st.shape == want.shape == (gb, gh, -(-lq // tq), -(-lkv // tk))
    assert (st == want).all()
    s = p.stats
    assert s["tiles"] == st.size
    assert s["empty_tiles"] == int((st == 0).sum())
    assert s["partial_tiles"] == int((st == 1).sum())
    assert s["full_tiles"] == int((st == 2).sum())
    assert s["empty_tiles"] + s["partial_tiles"] + s["full_tiles"] == s["tiles"]
    assert s["allowed_pairs"] == int(want_dense.sum())
    assert s["density"] == pytest.approx(want_dense.mean(), rel=1e-12, abs=1e-15)
    assert s["tile_density"] == pytest.approx((st > 0).mean(), rel=1e-12)
    assert s["grid_width"] == int((st > 0).sum(-1).max())
    # partial bitmasks are deduplicated: count distinct contents (ragged tails padded with False)
    nq, nk = st.shape[2:]
    pad = np.zeros((gb, gh, nq * tq, nk * tk), dtype=bool)
    pad[:, :, :lq, :lkv] = grp
    contents = set()
    for bi, hi, a, c in zip(*np.nonzero(st == 1)):
        contents.add(pad[bi, hi, a * tq : (a + 1) * tq, c * tk : (c + 1) * tk].tobytes())
    assert s["unique_partial_masks"] == len(contents)
    distinct_groups = {grp[bi, hi].tobytes() for bi in range(gb) for hi in range(gh)}
    assert len(distinct_groups) <= s["head_plans"] <= gb * gh
    assert p.flops(64) == 4 * 64 * s["allowed_pairs"]
    assert p.flops(32, 16) == 2 * 48 * s["allowed_pairs"]
    assert p.flops(32, 16, backward=True) == (6 * 32 + 4 * 16) * s["allowed_pairs"]


@pytest.mark.parametrize("seed", range(12))
def test_plan_states_equal_brute_force_on_random_masks(seed):
    r = np.random.default_rng(1000 + seed)
    for _ in range(6):
        lq = int(r.integers(1, 150))
        lkv = lq if r.random() < 0.4 else int(r.integers(1, 150))
        b, h = int(r.integers(1, 3)), int(r.integers(1, 4))
        tq, tk = (int(x) for x in r.choice([16, 32, 64], 2))
        m = random_mask(r, lq, lkv, b, h, depth=3)
        p = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=h, batch=b, block=(tq, tk), cache=False)
        _check_plan_against_dense(p, m.dense(b, h, lq, lkv), tq, tk)


def _structured_cases():
    g = np.random.default_rng(77)
    ids = packed_ids(g, 3, 333, 90, pad_inside=True)
    ids_kv = packed_ids(g, 3, 270, 70)
    return [
        ("causal_ragged", causal(), 1, 1, 333, 333, (64, 64)),
        ("causal_rect_tile", causal(), 1, 1, 200, 200, (32, 64)),
        ("causal_offset_cross", causal(40), 1, 1, 130, 260, (32, 32)),
        ("causal_negative_offset", causal(-50), 1, 1, 190, 190, (64, 32)),
        ("window", window(37, 5), 1, 1, 300, 300, (32, 32)),
        ("window_future_only", window(-3, 40), 1, 1, 200, 230, (32, 16)),
        ("window_past_only", window(50, -10), 1, 1, 200, 200, (16, 32)),
        ("window_empty", window(-5, -6), 1, 1, 100, 100, (32, 32)),
        ("window_wide_cross", window(100, 100), 1, 1, 77, 333, (16, 64)),
        ("chunk_and_causal", chunk(48) & causal(), 1, 1, 250, 250, (32, 32)),
        ("chunk_unaligned", chunk(50), 1, 1, 300, 300, (64, 16)),
        ("prefix_or_causal", prefix(70) | causal(), 1, 1, 260, 260, (64, 64)),
        ("not_window", ~window(20), 1, 1, 180, 180, (32, 32)),
        ("doc_padding_batch", causal() & document(ids), 3, 2, 333, 333, (32, 64)),
        ("doc_cross", document(ids[:, :270], ids_kv), 3, 1, 270, 270, (64, 32)),
        ("doc_cross_lengths", document(ids[:, :200], ids_kv), 3, 1, 200, 270, (32, 32)),
        ("doc_cross_one_q_row", document(ids[0, :150], ids_kv) & causal(30), 3, 1, 150, 270, (32, 64)),
        ("heads", heads([causal(), window(16), ~causal() | prefix(3), full()]), 1, 4, 150, 150, (16, 32)),
        ("heads_and_doc", heads([causal(), window(40)]) & document(ids[:2, :300]), 2, 2, 300, 300, (64, 64)),
        ("dense_per_head", dense(g.random((3, 120, 90)) < 0.2) | window(4), 1, 3, 120, 90, (32, 16)),
        ("dense_batch_heads", dense(g.random((2, 2, 64, 64)) < 0.5), 2, 2, 64, 64, (16, 16)),
        ("full_tiny", full(), 1, 1, 1, 1, (16, 16)),
        ("causal_single_query", causal(), 1, 1, 1, 500, (16, 128)),
        ("full_rect_big_tile", full() & ~prefix(1), 1, 1, 40, 700, (128, 256)),
        ("long_window_causal_offset", window(700, 3) & causal(-5), 1, 1, 4099, 4099, (64, 128)),
        ("long_chunk_or_prefix", chunk(300) | prefix(129), 1, 1, 3000, 3100, (128, 64)),
        ("long_documents", causal() & document(packed_ids(g, 1, 4000, 900, pad_inside=True)), 1, 1, 4000, 4000,
         (256, 128)),
    ]


@pytest.mark.parametrize("case", _structured_cases(), ids=lambda c: c[0])
def test_plan_states_equal_brute_force_on_structured_masks(case):
    name, m, b, h, lq, lkv, block = case
    p = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block)
    _check_plan_against_dense(p, m.dense(b, h, lq, lkv), *block)
    assert p.block == block and p.mask == m.t
    assert p.stats["build_ms"] >= 0 and p.stats["plan_bytes"] > 0


def test_structured_masks_do_not_vary_along_batch_or_heads():
    p = tessera.plan(tessera.causal() | tessera.window(3), q_len=100, heads=8, batch=4, block=32)
    assert p.groups == (1, 1) and p.shape == (4, 8, 100, 100)
    assert p.states().shape == (1, 1, 4, 4)
    ids = packed_ids(np.random.default_rng(2), 3, 100, 30)
    p = tessera.plan(tessera.document(ids), q_len=100, heads=8, block=32)
    assert p.groups == (3, 1) and p.shape == (3, 8, 100, 100)
    # one row of ids serves any batch size
    p = tessera.plan(tessera.document(ids[0]), q_len=100, batch=5, block=32)
    assert p.groups == (1, 1) and p.shape == (5, 1, 100, 100)


def test_plan_defaults_come_from_the_mask_data():
    ids = np.zeros((3, 50), dtype=np.int64)
    assert tessera.plan(tessera.document(ids), q_len=50).shape == (3, 1, 50, 50)
    assert tessera.plan(tessera.causal(), q_len=50).block == (128, 128)
    assert tessera.plan(tessera.dense(np.ones((2, 4, 10, 12), bool)), q_len=10, kv_len=12).shape == (2, 4, 10, 12)
    assert tessera.plan(tessera.dense(np.ones((4, 10, 10), bool)), q_len=10).shape == (1, 4, 10, 10)
    hm = tessera.heads([tessera.causal()] * 5)
    assert tessera.plan(hm, q_len=20, block=16).shape == (1, 5, 20, 20)
    assert tessera.plan(hm & tessera.document(ids), q_len=50, block=16).shape == (3, 5, 50, 50)
    assert tessera.plan(tessera.causal(), q_len=20, block=(16, 64)).block == (16, 64)
    assert tessera.plan(tessera.causal(), q_len=20, block=np.int64(32)).block == (32, 32)
    assert tessera.plan(tessera.causal(), q_len=np.int32(20)).shape == (1, 1, 20, 20)


BAD_PLANS = [
    ("q_len_zero", dict(q_len=0), ValueError, "q_len"),
    ("q_len_negative", dict(q_len=-5), ValueError, "q_len"),
    ("q_len_float", dict(q_len=64.0), TypeError, "q_len"),
    ("q_len_bool", dict(q_len=True), TypeError, "q_len"),
    ("kv_len_zero", dict(q_len=64, kv_len=0), ValueError, "kv_len"),
    ("heads_zero", dict(q_len=64, heads=0), ValueError, "heads"),
    ("batch_zero", dict(q_len=64, batch=0), ValueError, "batch"),
    ("heads_str", dict(q_len=64, heads="2"), TypeError, "heads"),
    ("block_24", dict(q_len=64, block=24), ValueError, "block"),
    ("block_8", dict(q_len=64, block=8), ValueError, "block"),
    ("block_0", dict(q_len=64, block=0), ValueError, "block"),
    ("block_negative", dict(q_len=64, block=-16), ValueError, "block"),
    ("block_too_big", dict(q_len=64, block=8192), ValueError, "block"),
    ("block_triple", dict(q_len=64, block=(16, 16, 16)), ValueError, "block"),
    ("block_single", dict(q_len=64, block=(16,)), ValueError, "block"),
    ("block_kv_48", dict(q_len=64, block=(16, 48)), ValueError, "block"),
    ("block_str", dict(q_len=64, block="16"), ValueError, "block"),
]


@pytest.mark.parametrize("case", BAD_PLANS, ids=lambda c: c[0])
def test_bad_plans_raise_naming_the_argument(case):
    _, kwargs, exc, name = case
    with pytest.raises(exc) as e:
        tessera.plan(tessera.causal(), **kwargs)
    assert name in str(e.value)


def test_plans_reject_data_that_does_not_fit_the_shape():
    two = np.array([[0, 0, 1], [0, 1, 1]])
    with pytest.raises(ValueError, match="segment"):
        tessera.plan(tessera.document(np.zeros(10, dtype=int)), q_len=12)
    with pytest.raises(ValueError, match="segment"):
        tessera.plan(tessera.document(two), q_len=3, batch=3)
    with pytest.raises(ValueError, match="segment"):
        tessera.plan(tessera.document([0, 0, 1], [0, 1]), q_len=3)  # kv ids of length 2, kv_len 3
    with pytest.raises(ValueError, match="dense"):
        tessera.plan(tessera.dense(np.ones((2, 3, 4), bool)), q_len=3, kv_len=4, heads=3)
    with pytest.raises(ValueError, match="dense"):
        tessera.plan(tessera.dense(np.ones((3, 4), bool)), q_len=4, kv_len=3)
    with pytest.raises(ValueError, match="heads"):
        tessera.plan(tessera.heads([tessera.causal()] * 3), q_len=4, heads=2)
    with pytest.raises(TypeError, match="mask"):
        tessera.plan("causal", q_len=8)
    # cross-attention ids plan fine with their own lengths
    p = tessera.plan(tessera.document([0, 0, 1], [0, 1]), q_len=3, kv_len=2, block=16)
    assert p.shape == (1, 1, 3, 2) and p.stats["allowed_pairs"] == 3


# -- picture -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mask, lq, lkv, block",
    [
        (tessera.causal(), 300, 300, 64),
        (tessera.window(50) | tessera.prefix(20), 257, 513, (32, 64)),
        (tessera.full(), 40, 40, 16),
        (~tessera.full(), 40, 40, 16),
        (tessera.chunk(64) & tessera.causal(), 256, 256, 32),
    ],
)
def test_repr_draws_one_cell_per_tile_for_small_grids(mask, lq, lkv, block):
    p = tessera.plan(mask, q_len=lq, kv_len=lkv, block=block)
    st = p.states()[0, 0]
    text = repr(p)
    assert str(p) == text
    head, *lines = text.rstrip("\n").split("\n")
    s = p.stats
    assert head.startswith("tessera.Plan(") and mask.canonical() in head
    assert f"Lq={lq}" in head and f"Lkv={lkv}" in head
    assert f"{s['full_tiles']} full, {s['partial_tiles']} partial, {s['empty_tiles']} empty" in head
    want = ["  " + "".join({0: "  ", 1: "░░", 2: "██"}[int(x)] for x in row) for row in st]
    assert lines == want


def test_repr_of_a_large_grid_is_bounded():
    p = tessera.plan(tessera.causal(), q_len=16 * 200, block=16)
    lines = repr(p).rstrip("\n").split("\n")
    # 32 picture rows, then the line that says the picture is shrunk and how
    assert len(lines) == 1 + 32 + 1 and all(len(x) == 2 + 64 for x in lines[1:-1])
    assert "█" in lines[-2] and lines[1].strip() != ""
    assert lines[-1].startswith("  (shrunk: 32 of 200 tile rows, 32 of 200 tile columns; each cell covers 6-7 x 6-7")


def test_save_png(tmp_path):
    ids = packed_ids(np.random.default_rng(3), 2, 300, 120)
    p = tessera.plan(tessera.causal() & tessera.document(ids), q_len=300, block=64)
    png = tmp_path / "plan.png"
    p.save_png(str(png), batch=1, title="rows")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="batch"):
        p.save_png(str(tmp_path / "x.png"), batch=2)
    with pytest.raises(ValueError, match="head"):
        p.save_png(str(tmp_path / "x.png"), head=1)


# -- plan cache ----------------------------------------------------------------------------------


def test_replanning_the_same_contract_is_a_memory_hit(rng):
    ids = packed_ids(rng, 2, 300, 120)
    m = tessera.causal() & tessera.document(ids)
    p = tessera.plan(m, q_len=300, block=64)
    before = tessera.cache_stats()
    again = tessera.plan(m, q_len=300, block=64)
    after = tessera.cache_stats()
    assert again.source == "memory" and again.contract == p.contract
    assert after["memory_hits"] == before["memory_hits"] + 1
    assert after["plans_built"] == before["plans_built"]
    assert (again.states() == p.states()).all()
    # the text form of the same mask is the same contract
    text = tessera.plan(tessera.mask("document & causal", segments=ids.copy()), q_len=300, block=64)
    assert text.contract == p.contract and text.source == "memory"
    # anything in the contract changes the key
    others = [
        tessera.plan(m, q_len=300, block=32),
        tessera.plan(m, q_len=300, heads=2, block=64),
        tessera.plan(tessera.causal() & tessera.document(ids[::-1].copy()), q_len=300, block=64),
        tessera.plan(tessera.causal(1) & tessera.document(ids), q_len=300, block=64),
    ]
    assert len({p.contract} | {o.contract for o in others}) == 5
    # cache=False always builds and does not touch the counters of hits
    mid = tessera.cache_stats()
    fresh = tessera.plan(m, q_len=300, block=64, cache=False)
    assert fresh.source == "built" and fresh.contract == p.contract
    assert tessera.cache_stats()["memory_hits"] == mid["memory_hits"]
    stats = tessera.cache_stats()
    for key in ("memory_hits", "disk_hits", "misses", "rejects", "plans_built", "bytes_read", "bytes_written"):
        assert isinstance(stats[key], int) and stats[key] >= 0
    assert isinstance(stats["warnings"], list)


_CACHE_SCRIPT = r"""
import json, sys, numpy as np, tessera
ids = np.repeat(np.arange(6), 100)
p = tessera.plan(tessera.causal() & tessera.document(ids), q_len=600, heads=2, block=64)
s = tessera.cache_stats()
print(json.dumps({"source": p.source, "contract": p.contract, "states": p.states().tolist(),
                  "built": s["plans_built"], "disk_hits": s["disk_hits"], "rejects": s["rejects"],
                  "warnings": s["warnings"], "dir": s["dir"]}))
"""


def _run_cache_process(cache_dir):
    env = dict(os.environ, TESSERA_CACHE_DIR=str(cache_dir))
    out = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_reads_the_plan_from_disk_and_bad_entries_are_rejected(tmp_path):
    first = _run_cache_process(tmp_path)
    assert first["source"] == "built" and first["built"] == 1 and first["dir"] == str(tmp_path)
    files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert files, "no cache entry written"
    second = _run_cache_process(tmp_path)
    assert second["source"] == "disk" and second["built"] == 0 and second["disk_hits"] == 1
    assert second["contract"] == first["contract"] and second["states"] == first["states"]
    # corrupt every entry: the next process rejects it (counted, warned), rebuilds and rewrites
    for f in files:
        data = bytearray(open(f, "rb").read())
        data[-1] ^= 0xFF
        open(f, "wb").write(bytes(data))
    third = _run_cache_process(tmp_path)
    assert third["source"] == "built" and third["built"] == 1
    assert third["rejects"] >= 1 and third["warnings"]
    assert third["states"] == first["states"]
    fourth = _run_cache_process(tmp_path)
    assert fourth["source"] == "disk" and fourth["built"] == 0 and fourth["rejects"] == 0


# -- threads -------------------------------------------------------------------------------------


def test_two_threads_planning_at_once_give_equal_plans():
    ids = packed_ids(np.random.default_rng(5), 1, 8192, 900, pad_inside=True)
    m = tessera.causal() & tessera.document(ids)
    out = [None] * 4
    barrier = threading.Barrier(4)

    def work(i):
        barrier.wait()
        # two threads bypass the cache, two race on the same new cache entry
        p = tessera.plan(m, q_len=8192, heads=2, block=64, cache=i >= 2)
        out[i] = (p.contract, p.states(), p.stats["allowed_pairs"])

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert all(o is not None for o in out)
    for o in out[1:]:
        assert o[0] == out[0][0] and (o[1] == out[0][1]).all() and o[2] == out[0][2]
    ref = tessera.plan(m, q_len=8192, heads=2, block=64, cache=False)
    assert (ref.states() == out[0][1]).all()


def test_masks_deeper_than_the_limit_are_refused_not_crashing():
    # 5001 nested `~` through the typed API (the text parser stops at 256 levels): printing
    # (double negations cancel in the canonical form), comparing and dropping work; planning
    # refuses with an error naming the depth limit.
    m = tessera.causal()
    for _ in range(5001):
        m = ~m
    assert m.canonical() == "!" + tessera.causal().canonical()
    assert m == m and hash(m) == hash(m)
    with pytest.raises(ValueError, match="deep|depth|nest"):
        tessera.plan(m, q_len=64)
    # within the limit, a deep mask over document data plans with the data's batch size
    d = tessera.document(np.zeros((3, 64), dtype=np.int64))
    for _ in range(500):
        d = ~~d
    p = tessera.plan(d & tessera.causal(), q_len=64, block=16)
    assert p.shape == (3, 1, 64, 64)
    assert p.stats["allowed_pairs"] == 3 * 64 * 65 // 2


def test_deep_masks_need_no_deep_native_stack():
    # The same calls on a thread with a 256 KiB stack, in a child process (a native stack
    # overflow would kill it): nothing the package does recurses over the mask tree.
    code = (
        "import threading, numpy as np, tessera\n"
        "m = tessera.causal() & tessera.document(np.zeros((2, 64), dtype=np.int64))\n"
        "for _ in range(4001):\n"
        "    m = ~m\n"
        "out = []\n"
        "def run():\n"
        "    try:\n"
        "        tessera.plan(m, q_len=64)\n"
        "    except ValueError as e:\n"
        "        out.append(str(e))\n"
        "    out.append(str(m)[:1] + str(m == m) + str(hash(m) == hash(m)))\n"
        "threading.stack_size(256 * 1024)\n"
        "t = threading.Thread(target=run); t.start(); t.join()\n"
        "print(out)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "levels deep" in r.stdout and "!TrueTrue" in r.stdout, r.stdout
