"""Helpers the bench scripts share (importable from `bench/` when a script runs as
`python bench/NAME.py`): the CPU model for the records, and seeded packed-document ids."""

import platform

import numpy as np


def cpu_model():
    """The CPU's model name (recorded with every figure)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def doc_ids(n, mean=2048, seed=7):
    """Segment ids of one row of ``n`` tokens: documents of ``mean/2 .. 3·mean/2`` tokens,
    seeded."""
    rng = np.random.default_rng(seed)
    ids, doc = [], 0
    while len(ids) < n:
        k = int(min(rng.integers(mean // 2, 3 * mean // 2 + 1), n - len(ids)))
        ids += [doc] * k
        doc += 1
    return np.asarray(ids, dtype=np.int64)
