"""The analytic ``mask_mod`` of a plan's FlexAttention ``BlockMask``, generated from its mask tree
(imports torch; used by :mod:`.flex_tables`).

FlexAttention evaluates ``mask_mod`` on every element of every partial block; comparisons of
``q_idx``/``kv_idx`` cost far less there than gathers from a bit table. Each leaf becomes:

- ``causal(N)``: ``q + N >= kv``; ``window(L, R)``: ``q - L <= kv <= q + R``; ``chunk(C)``:
  ``q // C == kv // C``; ``prefix(N)``: ``kv < N`` (parameters clamped to the lengths, so no
  int32 overflow; leaves true or false everywhere fold to constants);
- ``document``: q-indexed bounds ``start[b, q] <= kv < end[b, q]`` when, in every kv row, each
  document id is one contiguous run (the q side may be anything: a q token's bounds are the run of
  its id among the keys, empty for padding or ids absent from the keys); otherwise the id
  comparison ``id_q[b, q] >= 0 and id_q[b, q] == id_kv[b, kv]``;
- ``band(f, g, lo, hi)``: ``lo <= f[b, q] - g[b, kv] <= hi`` in int64 (features within ±2^62,
  so the difference cannot wrap; beyond that, no analytic form);
- ``& | ~`` the boolean ops, ``heads(...)`` a select on ``h``; per-row data indexes ``b`` (row 0
  when one row serves every batch row).

``dense`` and ``blocks`` leaves have no analytic form: :func:`program` returns the reason, and the
caller keeps the bit-table ``mask_mod``. Per-token arrays are captured tensors whose shapes
depend only on the plan's shapes (``[rows, L]``), so a new batch's documents reuse the compiled
kernel.
"""

from __future__ import annotations

from typing import Any, List, Tuple, Union

import numpy as np

_BAND_LIMIT = 1 << 62

Node = Tuple[Any, ...]


class _Builder:
    """Turns a ``Mask._tree()`` into a program over buffers (numpy, int32 or int64)."""

    def __init__(self, lq: int, lkv: int) -> None:
        self.lq, self.lkv = lq, lkv
        self.bufs: List[np.ndarray] = []

    def buf(self, a: np.ndarray) -> int:
        self.bufs.append(np.ascontiguousarray(a))
        return len(self.bufs) - 1

    def node(self, t: Node) -> Union[Node, str]:
        kind = t[0]
        lq, lkv = self.lq, self.lkv
        c = lq + lkv + 2  # any offset beyond ±c acts as ±c
        if kind == "full":
            return ("const", True)
        if kind == "causal":
            off = max(-c, min(c, t[1]))
            if off >= lkv:
                return ("const", True)
            return ("const", False) if off <= -lq else ("causal", off)
        if kind == "window":
            return ("window", max(-c, min(c, t[1])), max(-c, min(c, t[2])))
        if kind == "chunk":
            return ("const", True) if t[1] >= max(lq, lkv) else ("chunk", int(t[1]))
        if kind == "prefix":
            if t[1] >= lkv:
                return ("const", True)
            return ("const", False) if t[1] == 0 else ("prefix", int(t[1]))
        if kind == "document":
            return self.document(*t[1:])
        if kind == "band":
            f, g, lo, hi, (least, greatest) = t[1:]
            if greatest >= _BAND_LIMIT or least <= -_BAND_LIMIT:
                return "a band feature beyond ±2^62 (its difference could wrap in int64)"
            return ("band", self.buf(f), self.buf(g), f.shape[0], g.shape[0], int(lo), int(hi))
        if kind in ("dense", "blocks"):
            return f"a {kind} leaf (no analytic form: the plan's bit table)"
        if kind == "not":
            k = self.node(t[1])
            return k if isinstance(k, str) else _not(k)
        kids = []
        for child in t[1]:
            k = self.node(child)
            if isinstance(k, str):
                return k
            kids.append(k)
        if kind == "heads":
            return kids[0] if len(kids) == 1 else ("heads", tuple(kids))
        return _fold(kind, kids)

    def document(self, qi: np.ndarray, ki: np.ndarray, bounds: Any) -> Node:
        """q-indexed bounds (computed natively with the tree) when each id is one run of keys in
        every row, else the id comparison."""
        if bounds is None:  # an id in two runs: compare ids
            return ("docid", self.buf(qi), self.buf(ki), qi.shape[0], ki.shape[0])
        starts, ends = bounds
        return ("docb", self.buf(starts), self.buf(ends), starts.shape[0])


def _not(k: Node) -> Node:
    if k[0] == "const":
        return ("const", not k[1])
    return k[1] if k[0] == "not" else ("not", k)


def _fold(kind: str, kids: List[Node]) -> Node:
    """``and`` / ``or`` with constants folded."""
    absorb = kind == "or"  # true absorbs an or, false an and
    rest = []
    for k in kids:
        if k[0] == "const":
            if k[1] == absorb:
                return ("const", absorb)
            continue
        rest.append(k)
    if not rest:
        return ("const", not absorb)
    return rest[0] if len(rest) == 1 else (kind, tuple(rest))


def program(mask: Any, lq: int, lkv: int) -> Tuple[Union[Node, str], List[np.ndarray]]:
    """``(program, buffers)`` for ``mask`` (a ``tessera.Mask``) over ``Lq x Lkv``, or
    ``(reason, [])`` when some leaf has no analytic form."""
    b = _Builder(lq, lkv)
    p = b.node(mask._tree())
    return (p, []) if isinstance(p, str) else (p, b.bufs)


def _row(rows: int, b: Any) -> Any:
    return b if rows > 1 else 0


def _ev(n: Node, bufs: List[Any], b: Any, h: Any, q: Any, kv: Any) -> Any:
    """``prog`` node ``n`` at ``(b, h, q, kv)``. Module-level (as is everything the ``mask_mod``
    closure reaches but its data), so that torch.compile guards the code, not the objects: plans
    of the same shapes reuse the compiled kernel."""
    import torch

    k = n[0]
    if k == "const":
        return q.new_ones((), dtype=torch.bool) if n[1] else q.new_zeros((), dtype=torch.bool)
    if k == "causal":
        return q + n[1] >= kv
    if k == "window":
        return (q - n[1] <= kv) & (kv <= q + n[2])
    if k == "chunk":
        return q // n[1] == kv // n[1]
    if k == "prefix":
        return kv < n[1]
    if k == "docb":
        r = _row(n[3], b)
        return (bufs[n[1]][r, q] <= kv) & (kv < bufs[n[2]][r, q])
    if k == "docid":
        a = bufs[n[1]][_row(n[3], b), q]
        return (a >= 0) & (a == bufs[n[2]][_row(n[4], b), kv])
    if k == "band":
        d = bufs[n[1]][_row(n[3], b), q] - bufs[n[2]][_row(n[4], b), kv]
        return (d >= n[5]) & (d <= n[6])
    if k == "not":
        return ~_ev(n[1], bufs, b, h, q, kv)
    if k == "heads":
        out = _ev(n[1][-1], bufs, b, h, q, kv)
        for i in range(len(n[1]) - 2, -1, -1):
            out = torch.where(h == i, _ev(n[1][i], bufs, b, h, q, kv), out)
        return out
    out = _ev(n[1][0], bufs, b, h, q, kv)
    for m in n[1][1:]:
        x = _ev(m, bufs, b, h, q, kv)
        out = (out & x) if k == "and" else (out | x)
    return out


def make_mask_mod(prog: Node, bufs: List[Any]):
    """The ``mask_mod(b, h, q_idx, kv_idx)`` of ``prog`` over ``bufs`` (tensors on the device)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return _ev(prog, bufs, b, h, q_idx, kv_idx)

    return mask_mod


def causal_documents(plan: Any) -> Tuple[Any, str]:
    """``(ids [rows, L], "")`` when the plan's mask is exactly ``causal & document`` over shared,
    contiguous, unpadded documents (each id one run; what ``varlen_attn`` runs without a mask),
    else ``(None, reason)``. Kept on the plan: the verdict (a string, ``""`` when accepted) as
    ``plan._flex["docs"]``, what a compiled step's engine selection reads; the ids apart."""
    if "docs" not in plan._flex:
        ids, why = _causal_documents(plan)
        plan._flex["doc_ids"] = ids
        plan._flex["docs"] = why
    return plan._flex["doc_ids"], plan._flex["docs"]


def _cu_key(device: Any, batch: int) -> str:
    from .probes import _key

    return f"{_key(device)}|{batch}"


def kept_cu_seqlens(plan: Any, batch: int, device: Any) -> bool:
    """Whether :func:`cu_seqlens` for ``batch`` rows on ``device`` is kept on the plan."""
    return _cu_key(device, batch) in plan._flex.get("cu", {})


def cu_seqlens(plan: Any, batch: int, device: Any) -> Tuple[Any, int]:
    """``(cu_seqlens int32 [docs + 1] on device, longest document)`` of the plan's documents over
    ``batch`` rows packed (``None`` when :func:`causal_documents` refuses the plan). Built once per
    (plan, batch, device), pinned and copied without waiting on a GPU, and kept on the plan
    (tensor and length apart, so a compiled step reads only the tensor)."""
    import torch

    key = _cu_key(device, batch)
    kept = plan._flex.setdefault("cu", {})
    if key not in kept:
        ids, _ = causal_documents(plan)
        if ids is None:
            return None, 0
        L = ids.shape[1]
        starts, longest = [], 0
        for b in range(batch):
            row = ids[b if ids.shape[0] > 1 else 0]
            first = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
            longest = max(longest, int(np.diff(np.r_[first, L]).max()))
            starts.append(first + b * L)
        cu = torch.from_numpy(np.r_[np.concatenate(starts), batch * L].astype(np.int32))
        dev = torch.device(device)
        if dev.type == "cuda":
            cu = cu.pin_memory()
        kept[key] = cu.to(dev, non_blocking=True)
        plan._flex.setdefault("cu_longest", {})[key] = longest
    return kept[key], plan._flex["cu_longest"][key]


def _causal_documents(plan: Any) -> Tuple[Any, str]:
    m = plan._p.mask if plan._p is not None else None
    if m is None:
        return None, "the plan has no mask expression"
    t = m._tree()
    kids = t[1] if t[0] == "and" else ()
    if sorted(k[0] for k in kids) != ["causal", "document"] or any(k[0] == "causal" and k[1] != 0 for k in kids):
        return None, "the mask is not exactly causal & document"
    _, qi, ki, _ = next(k for k in kids if k[0] == "document")
    if qi.shape != ki.shape or not np.array_equal(qi, ki):
        return None, "query and key documents differ (cross attention)"
    if (qi < 0).any():
        return None, "padding tokens (negative ids) are not a document"
    for row in qi:
        first = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        if np.unique(row[first]).size != first.size:
            return None, "a document id appears in two runs (not contiguous)"
    return qi, ""
