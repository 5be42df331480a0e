"""Shared test helpers: an independent model of the mask semantics (docs/semantics.md#masks) evaluated densely in
numpy, the brute-force tile classification of docs/semantics.md#plans, random segment ids and mask expressions,
and the float64 dense attention reference of docs/semantics.md#attention in torch (GQA, softcap, sinks, fully masked
rows).

The mask model ``M`` builds the tessera ``Mask`` (typed API), the text expression of the same
mask (CLI language, for ``tessera.mask``) and a numpy evaluator from one description, so every
test compares the package against semantics written here from the spec, never against the
package's own ``Mask.allowed``.

Test modules import these helpers with ``from conftest import ...`` (the directory is put on
``sys.path`` below so that this works under every pytest import mode), and ``TABLES``, the
names of a FlexAttention BlockMask's eight block tables.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# The repository's bench/ directory: the mask cookbook's recipes (bench/mask_cookbook.py) and
# the names of a BlockMask's eight tables (bench/bench_common.py) are shared with the benches.
sys.path.insert(1, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "bench"))
from bench_common import TABLES  # noqa: E402,F401

# The tests plan through the process-wide plan cache: point it at a fresh directory (set before
# the first plan of the process) so that runs neither read nor fill the user's cache.
_CACHE_DIR = tempfile.mkdtemp(prefix="tessera-test-cache-")
os.environ["TESSERA_CACHE_DIR"] = _CACHE_DIR
atexit.register(shutil.rmtree, _CACHE_DIR, True)

import tessera  # noqa: E402

# -- the mask model ---------------------------------------------------------------------------


class M:
    """A mask described three ways: ``t`` (tessera typed Mask), ``text`` (expression text or
    None when the text form cannot name the data, e.g. two different id sets) and ``ev`` (numpy
    evaluator ``(B, H, Lq, Lkv) -> bool [B, H, Lq, Lkv]``)."""

    def __init__(self, t, text, ev, segs=None, dense=None, kv_segs=None, features=None):
        self.t = t
        self.text = text
        self.ev = ev
        # data for the text form: one segment-id set (q and kv), named dense arrays and named
        # band features
        self.segs = segs
        self.kv_segs = kv_segs
        self.dense_table = dict(dense or {})
        self.feature_table = dict(features or {})

    # operators mirror tessera's
    def __and__(self, o):
        return M._bin(self, o, "&", lambda a, b: a & b)

    def __or__(self, o):
        return M._bin(self, o, "|", lambda a, b: a | b)

    def __invert__(self):
        ev = self.ev
        return M(~self.t, None if self.text is None else f"!({self.text})", lambda *s: ~ev(*s),
                 self.segs, self.dense_table, self.kv_segs, self.feature_table)

    @staticmethod
    def _bin(a, b, op, f):
        t = (a.t & b.t) if op == "&" else (a.t | b.t)
        segs, kv = _merge_segs(a, b)
        text = None
        if a.text is not None and b.text is not None and segs is not _CONFLICT:
            text = f"({a.text}) {op} ({b.text})"
        dense = dict(a.dense_table)
        for k, v in b.dense_table.items():
            if k in dense and dense[k] is not v:
                text = None
            dense[k] = v
        feats = dict(a.feature_table)
        for k, v in b.feature_table.items():
            if k in feats and feats[k] is not v:
                text = None
            feats[k] = v
        ea, eb = a.ev, b.ev
        return M(t, text, lambda *s: f(ea(*s), eb(*s)), None if segs is _CONFLICT else segs, dense,
                 None if segs is _CONFLICT else kv, feats)

    def dense(self, b, h, lq, lkv):
        return np.array(np.broadcast_to(self.ev(b, h, lq, lkv), (b, h, lq, lkv)), dtype=bool)

    def parse(self):
        """The text form parsed by ``tessera.mask`` (with the same data)."""
        assert self.text is not None
        kw = {}
        if self.segs is not None:
            if self.kv_segs is None:
                kw["segments"] = self.segs
            else:
                kw["q_segments"] = self.segs
                kw["kv_segments"] = self.kv_segs
        if self.dense_table:
            kw["dense"] = self.dense_table
        if self.feature_table:
            kw["features"] = self.feature_table
        return tessera.mask(self.text, **kw)

    def __repr__(self):
        return f"M({self.t})"


_CONFLICT = object()


def _merge_segs(a, b):
    if a.segs is None:
        return b.segs, b.kv_segs
    if b.segs is None:
        return a.segs, a.kv_segs
    if a.segs is b.segs and a.kv_segs is b.kv_segs:
        return a.segs, a.kv_segs
    return _CONFLICT, None


def _grid(lq, lkv):
    return np.arange(lq)[:, None], np.arange(lkv)[None, :]


def full():
    return M(tessera.full(), "full", lambda b, h, lq, lkv: np.ones((1, 1, lq, lkv), dtype=bool))


def causal(off=0):
    def ev(b, h, lq, lkv):
        i, j = _grid(lq, lkv)
        return (i + off >= j)[None, None]

    return M(tessera.causal(off), f"causal(offset={off})" if off else "causal", ev)


def window(left, right=0):
    def ev(b, h, lq, lkv):
        i, j = _grid(lq, lkv)
        return ((i - left <= j) & (j <= i + right))[None, None]

    return M(tessera.window(left, right), f"window({left}, {right})", ev)


def chunk(c):
    def ev(b, h, lq, lkv):
        i, j = _grid(lq, lkv)
        return (i // c == j // c)[None, None]

    return M(tessera.chunk(c), f"chunk({c})", ev)


def prefix(n):
    def ev(b, h, lq, lkv):
        i, j = _grid(lq, lkv)
        return np.broadcast_to(j < n, (lq, lkv))[None, None]

    return M(tessera.prefix(n), f"prefix({n})", ev)


def document(ids, kv_ids=None):
    """Same id and both >= 0; ``ids`` ``[L]`` (every row) or ``[B, L]``."""
    ids = np.asarray(ids, dtype=np.int64)
    kv = None if kv_ids is None else np.asarray(kv_ids, dtype=np.int64)

    def ev(b, h, lq, lkv):
        sq = np.atleast_2d(ids)
        sk = np.atleast_2d(ids if kv is None else kv)
        assert sq.shape[1] == lq and sk.shape[1] == lkv
        same = sq[:, :, None] == sk[:, None, :]
        ok = (sq[:, :, None] >= 0) & (sk[:, None, :] >= 0)
        return (same & ok)[:, None]

    return M(tessera.document(ids, kv), "document", ev, segs=ids, kv_segs=kv)


_feature_names = iter(f"f{i}" for i in range(10**9))


def band(f, g, lo, hi):
    """``lo <= f[b, i] - g[b, j] <= hi`` for integer features ``[L]`` or ``[B, L]`` (exact: the
    difference is taken on Python ints, so extreme int64 values cannot wrap)."""
    f = np.asarray(f, dtype=np.int64)
    g = np.asarray(g, dtype=np.int64)
    nf, ng = next(_feature_names), next(_feature_names)

    def ev(b, h, lq, lkv):
        fq, gk = np.atleast_2d(f).astype(object), np.atleast_2d(g).astype(object)
        assert fq.shape[1] == lq and gk.shape[1] == lkv
        d = fq[:, :, None] - gk[:, None, :]
        return ((d >= lo) & (d <= hi)).astype(bool)[:, None]

    return M(tessera.band(f, g, lo, hi), f"band({nf}, {ng}, {lo}, {hi})", ev,
             features={nf: f, ng: g})


def random_feature(rng, rows, length):
    """Integer features ``[rows, length]``: positions (shifted, strided), sorted small values,
    shuffled small values, or a few int64 extremes among small values."""
    out = np.empty((rows, length), dtype=np.int64)
    for b in range(rows):
        k = int(rng.integers(0, 5))
        if k <= 1:
            out[b] = int(rng.integers(-4, 5)) + int(rng.integers(1, 4)) * np.arange(length)
        elif k == 2:
            out[b] = np.cumsum(rng.integers(0, 3, length)) + int(rng.integers(-3, 3))
        elif k == 3:
            out[b] = rng.permutation(rng.integers(-4, 8, length))
        else:
            v = rng.integers(-2, 3, length)
            pick = rng.random(length)
            v[pick < 0.2] = np.iinfo(np.int64).min
            v[pick > 0.8] = np.iinfo(np.int64).max
            out[b] = v
    return out


def random_band(rng, lq, lkv, b):
    """A band over random features (each side shared or per batch row) with random bounds."""
    f = random_feature(rng, 1 if rng.random() < 0.5 else b, lq)
    g = random_feature(rng, 1 if rng.random() < 0.5 else b, lkv)
    if f.shape[0] == 1 and rng.random() < 0.5:
        f = f[0]
    pick = [lambda: int(rng.integers(-6, 7))] * 5 + [
        lambda: int(rng.integers(-max(lq, lkv), max(lq, lkv) + 1)),
        lambda: int(np.iinfo(np.int64).min),
        lambda: int(np.iinfo(np.int64).max),
    ]
    a, c = pick[int(rng.integers(0, len(pick)))](), pick[int(rng.integers(0, len(pick)))]()
    return band(f, g, min(a, c), max(a, c))


_dense_names = iter(f"d{i}" for i in range(10**9))


def dense(arr):
    arr = np.asarray(arr, dtype=bool)
    name = next(_dense_names)

    def ev(b, h, lq, lkv):
        a = arr
        while a.ndim < 4:
            a = a[None]
        return a

    return M(tessera.dense(arr), f"dense({name})", ev, dense={name: arr})


def heads(ms):
    ms = list(ms)

    def ev(b, h, lq, lkv):
        assert h == len(ms), "heads(...) needs H == number of expressions"
        out = np.zeros((b, h, lq, lkv), dtype=bool)
        for hh, m in enumerate(ms):
            out[:, hh] = np.broadcast_to(m.ev(b, h, lq, lkv), (b, h, lq, lkv))[:, hh]
        return out

    segs, kv, dense_t, feats, text = None, None, {}, {}, True
    for m in ms:
        if m.segs is not None:
            if segs is not None and (segs is not m.segs or kv is not m.kv_segs):
                text = False
            segs, kv = m.segs, m.kv_segs
        dense_t.update(m.dense_table)
        feats.update(m.feature_table)
        if m.text is None:
            text = False
    txt = ("heads(" + ", ".join(m.text for m in ms) + ")") if text else None
    return M(tessera.heads([m.t for m in ms]), txt, ev, segs, dense_t, kv, feats)


# -- data ---------------------------------------------------------------------------------------


def packed_ids(rng, rows, length, max_doc, pad_tail=True, pad_inside=False):
    """Segment ids ``[rows, length]``: consecutive documents of random lengths (1..max_doc),
    ``-1`` padding at the tail (random amount) and optionally padding runs between documents."""
    out = np.full((rows, length), -1, dtype=np.int64)
    for b in range(rows):
        end = length - (int(rng.integers(0, max(1, length // 4))) if pad_tail else 0)
        i, d = 0, 0
        while i < end:
            n = int(min(rng.integers(1, max_doc + 1), end - i))
            if pad_inside and rng.random() < 0.25:
                i += n  # a padding run
                continue
            out[b, i : i + n] = d
            i, d = i + n, d + 1
    return out


def brute_states(allowed, tq, tk):
    """Tile states of a dense ``[..., Lq, Lkv]`` mask: 0 empty, 1 partial, 2 full (ragged edge
    tiles judged over their in-range pairs only)."""
    *lead, lq, lkv = allowed.shape
    nq, nk = -(-lq // tq), -(-lkv // tk)
    out = np.zeros(tuple(lead) + (nq, nk), dtype=np.uint8)
    for a in range(nq):
        for c in range(nk):
            t = allowed[..., a * tq : (a + 1) * tq, c * tk : (c + 1) * tk]
            anyv, allv = t.any(axis=(-1, -2)), t.all(axis=(-1, -2))
            out[..., a, c] = np.where(allv, 2, np.where(anyv, 1, 0))
    return out


def random_mask(rng, lq, lkv, b, h, depth=2):
    """A random mask expression over every leaf kind (data sized for ``b`` rows, ``h`` heads)."""
    ids = packed_ids(rng, b, max(lq, lkv), max(2, max(lq, lkv) // 3), pad_inside=True)

    def leaf():
        k = int(rng.integers(0, 9))
        if k == 8:
            return random_band(rng, lq, lkv, b)
        if k == 0:
            return causal(int(rng.integers(-lkv // 2, lkv // 2 + 1)))
        if k == 1:
            if rng.random() < 0.25:  # negative sides: a band strictly ahead of or behind i
                return window(int(rng.integers(-20, 20)), int(rng.integers(-20, 20)))
            return window(int(rng.integers(0, max(lq, lkv))), int(rng.integers(0, 20)))
        if k == 2:
            return chunk(int(rng.integers(1, max(lq, lkv) + 1)))
        if k == 3:
            return prefix(int(rng.integers(0, lkv + 1)))
        if k == 4:
            if lq == lkv:
                return document(ids[:, :lq])
            return document(ids[:, :lq], ids[:, :lkv])
        if k == 5:
            shape = [(lq, lkv), (h, lq, lkv), (b, h, lq, lkv)][int(rng.integers(0, 3))]
            return dense(rng.random(shape) < rng.uniform(0.05, 0.95))
        if k == 6:
            return full()
        return causal()

    def expr(d):
        if d == 0 or rng.random() < 0.3:
            return leaf()
        op = int(rng.integers(0, 4))
        if op == 0:
            return expr(d - 1) & expr(d - 1)
        if op == 1:
            return expr(d - 1) | expr(d - 1)
        if op == 2:
            return ~expr(d - 1)
        return heads([expr(d - 1) for _ in range(h)])

    return expr(depth)


# -- float64 attention reference ----------------------------------------------------------------


def ref_attention(q, k, v, allowed, scale=None, softcap=None, sinks=None):
    """O ``[B, Hq, Lq, Dv]`` and LSE ``[B, Hq, Lq]`` in float64 (autograd-able), docs/semantics.md#attention.

    ``allowed``: bool ``[B or 1, H or 1, Lq, Lkv]`` (numpy or torch). GQA by
    ``repeat_interleave`` of the kv heads (query head h reads kv head h // (Hq / Hkv)). Softcap
    ``c·tanh(s/c)``; sink logits join the denominator only. Rows with nothing allowed give
    O = 0 and LSE = -inf (or the sink logit), without NaN in values or gradients."""
    import torch

    q, k, v = q.double(), k.double(), v.double()
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    allowed = torch.as_tensor(np.array(allowed, dtype=bool))
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = sinks.double()[None, :, None, None].expand(s.shape[0], hq, s.shape[2], 1)
        lse = torch.logsumexp(torch.cat([s, col], -1), -1)
    else:
        lse = torch.logsumexp(s, -1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe[..., None])
    return p @ v, lse


def ref_probs(q, k, allowed, scale=None, softcap=None, sinks=None):
    """Dense float64 probabilities ``P [B, Hq, Lq, Lkv]``, the learned-sink probability
    ``[B, Hq, Lq]`` (zeros without sinks), the raw (pre-softcap) scaled logits and LSE."""
    import torch

    q, k = q.double(), k.double()
    hq, hkv = q.shape[1], k.shape[1]
    k = k.repeat_interleave(hq // hkv, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    raw = (q @ k.transpose(-1, -2)) * scale
    s = raw if softcap is None else softcap * torch.tanh(raw / softcap)
    allowed = torch.as_tensor(np.array(allowed, dtype=bool)).expand_as(s)
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        col = sinks.double()[None, :, None, None].expand(s.shape[0], hq, s.shape[2], 1)
        lse = torch.logsumexp(torch.cat([s, col], -1), -1)
    else:
        lse = torch.logsumexp(s, -1)
    lse_safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(s - lse_safe[..., None])
    if sinks is not None:
        p_sink = torch.exp(sinks.double()[None, :, None] - lse_safe)
    else:
        p_sink = torch.zeros_like(lse)
    return p, p_sink, raw.masked_fill(~allowed, float("-inf")), lse


def rel(x, ref):
    """‖x − ref‖ / ‖ref‖ in float64."""
    x, ref = x.double(), ref.double()
    n = ref.norm().item()
    if n == 0.0:
        return (x - ref).norm().item()
    return ((x - ref).norm() / n).item()


@pytest.fixture
def rng(request):
    """A numpy Generator seeded from the test's name (fresh, reproducible inputs per test)."""
    import zlib

    return np.random.default_rng(zlib.crc32(request.node.nodeid.encode()))


# -- spawned gloo ranks -------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_ranks(run, world: int, spec, prefix: str, timeout_s: float = 240.0, collect=None):
    """Runs ``run(rank, world, port, case_file, out_dir)`` in ``world`` spawned processes (a gloo
    group on loopback, bounded in time) on the cases ``spec``; returns every rank's saved results
    (``rank{r}.pt``; a rank's ``crash`` fails the test), their exit codes and, with ``collect``,
    what ``collect(out_dir)`` read before the directory goes."""
    import time

    import torch

    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        case_file = os.path.join(d, "cases.pt")
        torch.save(spec, case_file)
        port = _free_port()
        procs = [ctx.Process(target=run, args=(r, world, port, case_file, d)) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(1.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        assert not hung, f"ranks {hung} still running after {timeout_s} s"
        out = []
        for r in range(world):
            f = os.path.join(d, f"rank{r}.pt")
            assert os.path.exists(f), f"rank {r} wrote no result (exit code {procs[r].exitcode})"
            out.append(torch.load(f, weights_only=False))
        codes = [p.exitcode for p in procs]
        extra = collect(d) if collect is not None else None
    for r, res in enumerate(out):
        assert "crash" not in res, f"rank {r}:\n{res['crash']}"
    return out, codes, extra


def unregister_duration_listener(listener) -> None:
    """``jax.monitoring.unregister_event_duration_listener`` (jax >= 0.7.2), or its private
    predecessor on older JAX (the package supports JAX 0.7.1 on)."""
    import jax.monitoring as m

    fn = getattr(m, "unregister_event_duration_listener", None)
    if fn is None:
        from jax._src import monitoring as _m

        fn = _m._unregister_event_duration_listener_by_callback
    fn(listener)
