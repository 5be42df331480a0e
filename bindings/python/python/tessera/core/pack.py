"""Document packing from Python (docs/semantics.md#packing)."""

from __future__ import annotations

from typing import Any, Dict, Sequence

import numpy as np

from .. import _tessera
from .args import _int_arg


def pack(
    docs: Sequence[Any], seq_len: int, strategy: str = "best-fit", bos: int = 256
) -> Dict[str, Any]:
    """Packs tokenized documents into rows of ``seq_len`` (docs/semantics.md#packing): every document starts with
    ``bos``; longer documents are split. Returns ``tokens``, ``segment_ids`` (-1 = padding) and
    ``positions`` (int32 ``[rows, seq_len]``) and ``stats``; the result is verified."""
    seq_len = _int_arg("pack", "seq_len", seq_len, 2, 2**31)
    bos = _int_arg("pack", "bos", bos, 0, 2**31)
    if not isinstance(strategy, str):
        raise TypeError(f"pack: strategy must be a str, got {type(strategy).__name__}")
    lists = []
    for i, d in enumerate(docs):
        if hasattr(d, "detach") and hasattr(d, "cpu"):
            d = d.detach().cpu().numpy()
        a = np.asarray(d)
        if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
            raise TypeError(f"docs[{i}]: expected a 1-d sequence of integer token ids")
        lists.append(a.astype(np.int64).tolist())
    for i, d in enumerate(lists):
        if any(t < 0 or t > 2**31 - 1 for t in d):
            raise ValueError(f"docs[{i}]: token ids must be in 0..2**31-1")
    return _tessera.pack(lists, seq_len, strategy, bos)
