"""`tessera.torch.PlanPrefetcher` on CPU: over a `DataLoader` with two worker
processes, the prefetched plans and their BlockMasks (built from the compact arrays) equal direct
planning, in order; five prefetched plans of equal shapes run one compiled step (one graph);
errors name their argument."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

import tessera  # noqa: E402
import tessera.torch as tt  # noqa: E402
from conftest import TABLES, causal, document, packed_ids, ref_attention, rel  # noqa: E402
from tessera.core.flex_mask import causal_documents  # noqa: E402

L = 256


# Workers are spawned, not forked: the suite's process has JAX's threads running by then, and a
# fork of a multithreaded process can deadlock.
SPAWN = "spawn"


class Docs(torch.utils.data.Dataset):
    """Packed segment ids ``[L]`` per item (documents, padding at the tail)."""

    def __init__(self, n, seed):
        self.ids = packed_ids(np.random.default_rng(seed), n, L, 70)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return torch.from_numpy(self.ids[i])


def make_plan(batch):
    return tessera.plan(tessera.causal() & tessera.document(batch.numpy()), q_len=L, heads=2, block=64)


def test_prefetched_plans_and_block_masks_equal_direct_planning():
    loader = torch.utils.data.DataLoader(Docs(12, 1), batch_size=2, num_workers=2, multiprocessing_context=SPAWN)
    got = list(tt.PlanPrefetcher(loader, make_plan, device="cpu", depth=3, block_masks=True))
    assert len(got) == 6
    for (batch, plan), want in zip(got, loader):
        assert torch.equal(batch, want)  # in order
        ids = want.numpy()
        direct = tessera.plan((causal() & document(ids)).t, q_len=L, heads=2, block=64, cache=False)
        assert np.array_equal(plan.states(), direct.states())
        bm = plan._flex["bm"]["cpu"]  # built by the prefetcher from the compact arrays
        ref = direct.to_flex_block_mask(mask_mod="bits")
        for t in TABLES:
            assert torch.equal(getattr(bm, t), getattr(ref, t)), t
        want_mask = torch.from_numpy((causal() & document(ids)).dense(2, 2, L, L))
        assert torch.equal(flex.create_mask(bm.mask_mod, 2, 2, L, L, device="cpu"), want_mask.expand(2, 2, L, L))
        # read ahead for engine selection: the same verdict as direct planning's
        assert isinstance(plan._flex["docs"], str) and plan._flex["docs"] == causal_documents(direct)[1]
    # on CPU without block_masks the plans alone
    (_, p0), = list(tt.PlanPrefetcher([next(iter(loader))], make_plan))
    assert "bm" not in p0._flex or not p0._flex["bm"]


def test_five_prefetched_plans_run_one_compiled_step():
    from torch._dynamo.utils import counters

    def step(q, k, v, plan):
        return tt.attention(q, k, v, plan, engine="flex")

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)
    loader = torch.utils.data.DataLoader(Docs(10, 2), batch_size=2, num_workers=2, multiprocessing_context=SPAWN)
    g = torch.Generator().manual_seed(0)
    n = 0
    for batch, plan in tt.PlanPrefetcher(loader, make_plan, device="cpu", block_masks=True):
        q = torch.randn(2, 2, L, 16, generator=g)
        k, v = torch.randn(2, 2, L, 16, generator=g), torch.randn(2, 2, L, 16, generator=g)
        with torch.no_grad():
            o = compiled(q, k, v, plan)
        ro, _ = ref_attention(q, k, v, (causal() & document(batch.numpy())).dense(2, 1, L, L))
        assert rel(o, ro) <= 1e-5
        n += 1
    assert n == 5
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_prefetcher_errors():
    with pytest.raises(TypeError, match="make_plan"):
        tt.PlanPrefetcher([1], "plan")
    with pytest.raises(ValueError, match="depth"):
        tt.PlanPrefetcher([1], make_plan, depth=0)
    with pytest.raises(ValueError, match="mask_mod"):
        tt.PlanPrefetcher([1], make_plan, mask_mod="fast")
    with pytest.raises(TypeError, match=r"make_plan\(batch\)"):
        list(tt.PlanPrefetcher([1, 2], lambda b: b))

    def boom(b):
        raise KeyError("no plan for this batch")

    with pytest.raises(KeyError, match="no plan"):
        list(tt.PlanPrefetcher([1], boom))
