"""`tessera.band(q_feature, kv_feature, lo, hi)` (docs/semantics.md#masks): ``lo <= f[i] - g[j] <= hi`` over
per-token integer features. The API and its errors, the text form with ``features=``, plan states
equal to brute force (alone and with every other leaf), causal / window / document as special
cases, the FlexAttention BlockMask equal to ``create_block_mask``'s with the band's mask_mod,
``tessera.torch.attention`` against the float64 reference, and the plan cache keyed on the
features' content."""

import re

import numpy as np
import pytest

import tessera
from conftest import (
    band,
    brute_states,
    causal,
    chunk,
    dense,
    document,
    full,
    heads,
    packed_ids,
    prefix,
    random_band,
    random_feature,
    window,
)

I64 = np.iinfo(np.int64)


def _check_states(m, b, h, lq, lkv, block):
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, heads=h, batch=b, block=block, cache=False)
    gb, gh = plan.groups
    want = brute_states(m.dense(b, h, lq, lkv)[:gb, :gh], *block)
    assert np.array_equal(plan.states(), want), str(m.t)
    return plan


# -- the API -------------------------------------------------------------------------------------


def test_signature_inputs_and_the_text_form():
    t = np.array([0, 0, 1, 3, 3, 4, 7, 8])
    a = tessera.band(t, t, -1, 2)
    assert a == tessera.band(q_feature=t, kv_feature=t, lo=-1, hi=2)
    assert a == tessera.band(t.tolist(), t.astype(np.int32), np.int64(-1), 2)
    torch = pytest.importorskip("torch")
    assert a == tessera.band(torch.from_numpy(t), torch.tensor(t.tolist(), dtype=torch.int16), -1, 2)
    # text form: names resolved through features=..., canonical form by digest
    assert tessera.mask("band(t, t, -1, 2)", features={"t": t}) == a
    assert tessera.mask("band(t, u, lo=-1, hi=2)", features={"t": t, "u": t.copy()}) == a
    s = a.canonical()
    assert s.startswith("band#") and s.endswith("(-1,2)")
    assert tessera.band(t, t, -1, 3).canonical() != s
    assert tessera.band(t, t[::-1].copy(), -1, 2).canonical() != s
    # str() is the text form, its data named by content: it parses back with m.data()
    assert re.fullmatch(r"band\((f_[0-9a-f]{16}), \1, -1, 2\)", str(a)), str(a)
    assert tessera.mask(str(a), **a.data()) == a
    # per-pair semantics from the definition
    for i in range(8):
        for j in range(8):
            assert a.allowed(i, j) == (-1 <= t[i] - t[j] <= 2)
    # [B, L] features select per batch row; the plan's batch default follows them
    f = np.stack([t, t + 5])
    m = tessera.band(f, t, 0, 0)
    assert m.allowed(2, 2, b=0) and not m.allowed(2, 2, b=1)
    assert m.allowed(3, 7, b=1) and not m.allowed(3, 7, b=0)
    assert tessera.plan(m, q_len=8).shape[0] == 2


def test_extreme_values_are_exact():
    f = np.array([I64.max, I64.min, 0])
    g = np.array([I64.min, I64.max, 0])
    m = tessera.band(f, g, 0, int(I64.max))
    assert not m.allowed(0, 0)  # 2**64 - 1 is above the bound, no wrap-around
    assert m.allowed(0, 2) and not m.allowed(1, 1)
    m = band(f, g, int(I64.min), int(I64.max))
    _check_states(m, 1, 1, 3, 3, (16, 16))
    big = np.array([2**64 - 1], dtype=np.uint64)
    with pytest.raises(ValueError, match="q_feature"):
        tessera.band(big, np.zeros(1, dtype=np.int64), 0, 1)


@pytest.mark.parametrize(
    "call, exc, name",
    [
        (lambda t: tessera.band(t.astype(np.float32), t, 0, 1), TypeError, "q_feature"),
        (lambda t: tessera.band(t, t > 2, 0, 1), TypeError, "kv_feature"),
        (lambda t: tessera.band(t, [0.5] * 8, 0, 1), TypeError, "kv_feature"),
        (lambda t: tessera.band(t, t, 3, 2), ValueError, "lo"),
        (lambda t: tessera.band(t, t, 1.0, 2), TypeError, "lo"),
        (lambda t: tessera.band(t, t, 0, "2"), TypeError, "hi"),
        (lambda t: tessera.band(t, t, 0, 2**63), ValueError, "hi"),
        (lambda t: tessera.band(t.reshape(1, 2, 4), t, 0, 1), ValueError, "q_feature"),
        (lambda t: tessera.band(t, t[:0], 0, 1), ValueError, "kv_feature"),
        (lambda t: tessera.mask("band(t, t, 3, 2)", features={"t": t}), ValueError, "LO <= HI"),
        (lambda t: tessera.mask("band(t, u, 0, 2)", features={"t": t}), ValueError, "band feature u"),
        (lambda t: tessera.mask("band(t, t, 0, 2)", features={"t": t * 0.5}), TypeError, "features['t']"),
        (lambda t: tessera.mask("band(t, t, 0, 2)", features=[t]), TypeError, "features"),
        (lambda t: tessera.mask("band(t, t, 0, 2)"), ValueError, "band feature t"),
    ],
)
def test_bad_arguments_raise_naming_the_argument(call, exc, name):
    t = np.arange(8)
    with pytest.raises(exc, match=name.replace("[", r"\[").replace("(", r"\(")):
        call(t)


def test_wrong_lengths_and_rows_surface_at_plan_time_naming_the_feature():
    t = np.arange(10)
    with pytest.raises(ValueError, match="q_feature of band.*length 12"):
        tessera.plan(tessera.band(t, np.arange(12), 0, 1), q_len=12)
    with pytest.raises(ValueError, match="kv_feature of band.*length 9"):
        tessera.plan(tessera.band(t, t, 0, 1), q_len=10, kv_len=9)
    with pytest.raises(ValueError, match="kv_feature.*1 or 3 rows"):
        tessera.plan(tessera.band(t, np.zeros((2, 10), dtype=np.int64), 0, 1), q_len=10, batch=3)


# -- plans ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_bands_alone_and_with_every_other_leaf_plan_like_brute_force(seed):
    r = np.random.default_rng(3100 + seed)
    for _ in range(4):
        lq = int(r.integers(1, 180))
        lkv = lq if r.random() < 0.5 else int(r.integers(1, 180))
        b, h = int(r.integers(1, 3)), 2
        block = tuple(int(x) for x in r.choice([16, 32, 64], 2))
        ids = packed_ids(r, b, max(lq, lkv), 40, pad_inside=True)
        doc = document(ids[:, :lq]) if lq == lkv else document(ids[:, :lq], ids[:, :lkv])
        others = [
            full(), causal(int(r.integers(-20, 20))), window(int(r.integers(0, 30)), 3),
            chunk(int(r.integers(1, 50))), prefix(int(r.integers(0, lkv + 1))), doc,
            dense(r.random((lq, lkv)) < 0.4), random_band(r, lq, lkv, b),
        ]
        bd = random_band(r, lq, lkv, b)
        for o in others:
            for m in (bd, bd & o, o | bd, ~bd & o, heads([bd, o])):
                _check_states(m, b, h, lq, lkv, block)
        # the text form plans identically
        m = bd & others[int(r.integers(0, len(others)))]
        if m.text is not None:
            assert m.parse() == m.t


def test_causal_window_and_document_are_special_cases():
    big = int(I64.max)
    for lq, lkv, block in [(300, 300, (32, 32)), (257, 300, (64, 16)), (300, 190, (16, 128))]:
        pq, pk = np.arange(lq), np.arange(lkv)
        same = lambda a, b: np.array_equal(a.states(), b.states()) and a.stats == {
            **b.stats, "build_ms": a.stats["build_ms"], "plan_bytes": a.stats["plan_bytes"]}
        p = lambda m: tessera.plan(m, q_len=lq, kv_len=lkv, block=block, cache=False)
        assert same(p(tessera.band(pq, pk, 0, big)), p(tessera.causal()))
        assert same(p(tessera.band(pq, pk, -7, big)), p(tessera.causal(7)))
        for left, right in [(0, 0), (40, 7), (3, 90), (-5, 20)]:
            assert same(p(tessera.band(pq, pk, -right, left)), p(tessera.window(left, right)))
    r = np.random.default_rng(5)
    ids = np.sort(r.integers(0, 9, (2, 240)), axis=1)  # non-negative ids
    a = tessera.plan(tessera.band(ids, ids, 0, 0), q_len=240, block=32, cache=False)
    d = tessera.plan(tessera.document(ids), q_len=240, block=32, cache=False)
    assert a.groups == d.groups == (2, 1)
    assert np.array_equal(a.states(), d.states())
    assert a.stats["allowed_pairs"] == d.stats["allowed_pairs"]


def test_features_key_the_plan_cache():
    t = np.arange(200)
    first = tessera.plan(tessera.band(t, t, 0, 31), q_len=200, block=32)
    again = tessera.plan(tessera.band(t.copy(), t.copy(), 0, 31), q_len=200, block=32)
    assert again.contract == first.contract and again.source == "memory"
    u = t.copy()
    u[100] += 1
    other = tessera.plan(tessera.band(t, u, 0, 31), q_len=200, block=32)
    assert other.contract != first.contract and other.source == "built"
    assert tessera.plan(tessera.band(t, t, 0, 30), q_len=200, block=32).contract != first.contract
    # the text form with the same data is the same contract
    txt = tessera.mask("band(pos, pos, 0, 31)", features={"pos": t})
    assert tessera.plan(txt, q_len=200, block=32).contract == first.contract


# -- engines -------------------------------------------------------------------------------------


def _band_mask_mod(torch, f, g, lo, hi):
    """The band as a FlexAttention mask_mod over ``[B or 1, L]`` int64 feature tensors."""
    ft = torch.as_tensor(np.atleast_2d(f))
    gt = torch.as_tensor(np.atleast_2d(g))
    bf, bg = ft.shape[0] > 1, gt.shape[0] > 1

    def mask_mod(b, h, q, kv):
        d = ft[b if bf else 0, q] - gt[b if bg else 0, kv]
        return (d >= lo) & (d <= hi)

    return mask_mod


@pytest.mark.parametrize(
    "b, lq, lkv, block, lo, hi, per_row",
    [
        (1, 300, 300, (64, 64), 0, 40, False),
        (2, 250, 190, (32, 64), -3, 5, True),
        (2, 200, 200, (16, 32), -50, -10, True),
    ],
)
def test_flex_block_mask_equals_create_block_mask_with_the_band_mask_mod(b, lq, lkv, block, lo, hi, per_row):
    torch = pytest.importorskip("torch")
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    from test_flex import _check_tables

    r = np.random.default_rng(lq + lkv)
    f = random_feature(r, b if per_row else 1, lq)
    g = np.cumsum(r.integers(0, 3, lkv))  # sorted time stamps on the key side
    f = np.clip(f, -10**6, 10**6)  # small values: the torch mask_mod works in int64
    m = band(f, g, lo, hi) & causal(lkv)
    plan = tessera.plan(m.t, q_len=lq, kv_len=lkv, batch=b, block=block)
    mod = _band_mask_mod(torch, f, g, lo, hi)
    ref = flex.create_block_mask(lambda bb, h, q, kv: mod(bb, h, q, kv) & (q + lkv >= kv),
                                 plan.groups[0], plan.groups[1], lq, lkv, device="cpu", BLOCK_SIZE=plan.block)
    bm = plan.to_flex_block_mask()
    _check_tables(bm, ref, plan)
    allowed = torch.from_numpy(m.dense(b, 1, lq, lkv))
    assert torch.equal(flex.create_mask(bm.mask_mod, b, 1, lq, lkv, device="cpu"), allowed)
    assert plan.stats["partial_tiles"] > 0 and plan.stats["empty_tiles"] > 0


@pytest.mark.parametrize("case", ["band_doc_causal", "band_gqa_sinks", "band_bf16", "fully_masked_rows"])
def test_torch_attention_matches_float64(case):
    torch = pytest.importorskip("torch")
    from test_torch_attention import check_case

    r = np.random.default_rng(77)
    if case == "band_doc_causal":
        ids = packed_ids(r, 2, 200, 60, pad_inside=True)
        f = np.stack([np.arange(200) // 3, np.arange(200) // 2])
        m = band(f, f, 0, 12) & document(ids) & causal()
        check_case(m, 2, 4, 2, 200, 200, 32, 32, (32, 64), lse_loss=True, softcap=5.0)
    elif case == "band_gqa_sinks":
        m = random_band(r, 150, 170, 2) | band(np.arange(150), np.arange(170), -4, 4)
        check_case(m, 2, 4, 1, 150, 170, 24, 16, 64, sinks=True, lse_loss=True)
    elif case == "band_bf16":
        t = np.repeat(np.arange(40), 3)
        m = band(t, t, -2, 0) & ~chunk(17)
        check_case(m, 1, 2, 2, 120, 120, 32, 32, 32, dtype=torch.bfloat16)
    else:
        # rows 0..49 have features no key matches: O = 0, LSE = -inf, finite gradients
        f = np.concatenate([np.full(50, 10**9), np.arange(50, 130)])
        g = np.arange(130)
        m = band(f, g, 0, 6)
        plan, _, (o, lse) = check_case(m, 1, 2, 2, 130, 130, 16, 16, 32, lse_loss=True)
        assert (lse[:, :, :50] == float("-inf")).all() and (o[:, :, :50] == 0).all()
        assert plan.stats["empty_tiles"] > 0
