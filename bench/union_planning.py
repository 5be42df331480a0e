#!/usr/bin/env python3
"""Planning a union of many leaves: k `document` leaves over 4,126 tokens,
either scattered (40 random tokens each: every leaf reaches most tiles) or narrow (one run of 64
tokens each: a leaf reaches a tile or two per row), planned with `cache=False`; medians of 3.
Also the scattered union as every head of `heads([...] * 8)` (one shared head plan).

Usage: .venv/bin/python bench/union_planning.py
"""
import time, numpy as np, tessera, statistics as st
L=4126
rng=np.random.default_rng(0)
def med(f, n=3):
    ts=[]
    for _ in range(n):
        t=time.perf_counter(); r=f(); ts.append(time.perf_counter()-t)
    return st.median(ts)*1e3, r
for k in (10, 100, 400):
    leaves=[]
    for i in range(k):
        ids=np.full(L,-1,np.int64); sel=rng.choice(L, 40, replace=False); ids[sel]=0
        leaves.append(tessera.document(ids))
    m=leaves[0]
    for x in leaves[1:]: m = m | x
    # contiguous-run leaves: document-like blocks of 64 tokens at random places (small reach)
    runs=[]
    for i in range(k):
        ids=np.full(L,-1,np.int64); s=int(rng.integers(0,L-64)); ids[s:s+64]=i; runs.append(tessera.document(ids))
    mr=runs[0]
    for x in runs[1:]: mr = mr | x
    t1,p=med(lambda: tessera.plan(m, q_len=L, cache=False))
    t2,p8=med(lambda: tessera.plan(tessera.heads([m]*8), q_len=L, heads=8, cache=False))
    t3,pr=med(lambda: tessera.plan(mr, q_len=L, cache=False))
    print(f"k={k:4d} scattered {t1:7.1f} ms  heads8 {t2:7.1f} ms  runs {t3:7.1f} ms  tiles={p.stats['tiles']} partial={p.stats['partial_tiles']}/{pr.stats['partial_tiles']}")
