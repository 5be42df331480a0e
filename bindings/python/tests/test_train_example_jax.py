"""examples/train_gpt_jax.py on a tiny configuration (about half a minute on 2 cores): the model
learns through tessera.jax.attention, training matches the dense JAX reference step for step, the
jitted train step compiles once for every batch's plan, and telemetry records come out."""

import dataclasses
import importlib.util
import json
import sys
from pathlib import Path

import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("torch")  # the example reuses train_gpt.py's data pipeline (torch tensors)

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_gpt_jax.py"

# the schema of `tessera telemetry plot` (docs/semantics.md#telemetry), as the torch example writes it
FIELDS = ("step", "layer", "sink_mass", "sink_rate", "learned_sink_mass", "max_logit", "entropy",
          "out_abs_max", "out_rms", "out_outliers")


@pytest.fixture(scope="module")
def tgj():
    spec = importlib.util.spec_from_file_location("train_gpt_jax", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt_jax"] = mod
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny(tgj, tmp_path_factory):
    # bytes tokenizer (no `tokenizers` needed); 10 warm-up steps keep this tiny model out of the
    # loss spikes that make lockstep runs sensitive to the last float bit
    cfg = tgj.default_config(
        tokenizer="bytes", max_docs=40, seq_len=128, batch_size=4, layers=2, d_model=64, heads=4,
        kv_heads=2, softcap=20.0, sinks=True, steps=30, lr=3e-3, warmup=10, telemetry_every=5,
        eval_every=10, progress=False, out_dir=str(tmp_path_factory.mktemp("jax_run")),
    )
    return cfg, tgj.load_data(cfg)


@pytest.fixture(scope="module")
def run(tgj, tiny):
    """One 30-step training run through tessera (telemetry every 5 steps), shared by the tests."""
    cfg, data = tiny
    return tgj.train(cfg, data, save=True, log=lambda *_: None)


def test_loss_decreases(tiny, run):
    cfg, _ = tiny
    assert len(run.losses) == cfg.steps
    first, last = sum(run.losses[:3]) / 3, sum(run.losses[-3:]) / 3
    assert last < first - 1.0, run.losses
    (s0, v0), (s1, v1) = run.val[0], run.val[-1]
    assert (s0, s1) == (0, cfg.steps)
    assert v1 < v0 - 1.0, run.val


def test_step_compiles_once_across_plans(tiny, run):
    cfg, _ = tiny
    # every step built (or fetched) its batch's plan and passed it into the jitted step; batches
    # with different segment ids (different plans) went through the one trace and compilation
    assert run.distinct_batches == cfg.steps
    assert run.distinct_masks >= 2
    assert (run.step_traces, run.step_compiles) == (1, 1)
    assert (run.eval_traces, run.eval_compiles) == (1, 1)


def test_tessera_matches_dense_reference(tgj, tiny):
    cfg, data = tiny
    # softcap and sinks on: the dense side is the jnp reference (scores, softcap, boolean
    # [B, 1, L, L] mask, the sink as one extra softmax column). This tiny model's logits stay
    # below 1, where a softcap of 20 is the identity to 1e-4; at 2 it bends them (dropping it
    # from one side moves the loss by ~4e-4 and the parameters by ~5e-4 within 20 steps).
    cfg = dataclasses.replace(cfg, softcap=2.0)
    assert cfg.sinks
    # Most packed rows of this corpus hold one piece of one document; the 5 batches (of 71)
    # whose rows cross a document boundary are the ones where `document` matters (there,
    # causal-only attention moves the loss by ~0.5): train on those, 4 epochs of them.
    mixed = [b for b in data.train if ((b.segments != b.segments[:, :1]) & (b.segments >= 0)).any()]
    assert len(mixed) >= 4
    rep = tgj.compare(cfg, 20, dataclasses.replace(data, train=mixed), log=lambda *_: None)
    assert len(rep["tessera"]) == len(rep["dense"]) == 20
    assert rep["max_abs_diff"] <= 1e-4, rep
    assert rep["max_param_diff"] <= 1e-4, rep
    assert rep["compiles"] == {"tessera": 1, "dense": 1}


def test_telemetry_records(tiny, run):
    cfg, _ = tiny
    path = Path(cfg.out_dir) / "telemetry.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    logged = list(range(0, cfg.steps, cfg.telemetry_every))
    assert run.telemetry_records == len(records) == len(logged) * cfg.layers
    assert sorted((r["step"], r["layer"]) for r in records) == [(s, l) for s in logged for l in range(cfg.layers)]
    for r in records:
        for f in FIELDS:
            assert f in r, (f, r)
        for f in ("sink_mass", "learned_sink_mass", "max_logit", "entropy", "out_rms"):
            assert len(r[f]) == cfg.heads, (f, r)
        assert all(0.0 <= x <= 1.0 for x in r["sink_mass"] + r["learned_sink_mass"]), r
        assert all(x > 0 for x in r["entropy"]), r
