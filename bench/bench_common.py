"""Helpers the bench scripts share (importable from `bench/` when a script runs as
`python bench/NAME.py`): the CPU model for the records, seeded packed-document ids, the names
of a FlexAttention BlockMask's eight block tables (compared between engines) and median timing."""

import platform
import statistics
import time

import numpy as np

TABLES = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


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


def median_time(fn, reps, min_seconds=0.0):
    """``(median seconds of the calls of fn, fn's last result)``: ``reps`` calls, and more until
    they took ``min_seconds`` in all (a shared guest slows down for tens of milliseconds at a
    time: a few quick calls can all land in one such spell, a long one spans several)."""
    ts, out = [], None
    while len(ts) < reps or sum(ts) < min_seconds:
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), out
