"""Per-call time (microseconds, median of 200 after 20 warm-up calls) of tessera.torch.attention,
a jitted tessera.jax.attention and a plan-cache hit (small shapes: the Python layer's share is
largest), for whichever tessera package is on sys.path: run it alternately
under two packages (PYTHONPATH=...) to compare their Python layers. Prints one JSON line."""
import json
import statistics
import time

import numpy as np, torch, tessera, tessera.torch as tt
import jax, jax.numpy as jnp, tessera.jax as tj
torch.set_num_threads(1)
ids = np.repeat(np.arange(4), 128)
plan = tessera.plan(tessera.causal() & tessera.document(ids), q_len=512, heads=4, block=128)
q, k, v = (torch.randn(1, 4, 512, 64) for _ in range(3))
def t_torch():
    tt.attention(q, k, v, plan)
qj, kj, vj = (jnp.asarray(x.numpy()) for x in (q, k, v))
f = jax.jit(lambda q, k, v, p: tj.attention(q, k, v, p))
f(qj, kj, vj, plan).block_until_ready()
def t_jax():
    f(qj, kj, vj, plan).block_until_ready()
def t_plan():
    tessera.plan(tessera.causal() & tessera.document(ids), q_len=512, heads=4, block=128)
out = {}
for name, fn in (("torch_fwd", t_torch), ("jax_fwd", t_jax), ("plan_cached", t_plan)):
    for _ in range(20): fn()
    ts = []
    for _ in range(200):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    out[name] = statistics.median(ts) * 1e6
print(json.dumps(out))
