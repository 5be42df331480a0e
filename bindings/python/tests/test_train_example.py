"""examples/train_gpt.py on a tiny configuration (a few seconds): the model learns, and training
through tessera.torch.attention matches the dense PyTorch reference (and SDPA) step for step."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "train_gpt.py"


@pytest.fixture(scope="module")
def tg():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["train_gpt"] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tiny(tg, tmp_path_factory):
    # bytes tokenizer: the test needs no package beyond numpy and torch
    cfg = tg.Config(
        tokenizer="bytes", max_docs=40, seq_len=128, batch_size=4, layers=2, d_model=64, heads=4,
        kv_heads=2, softcap=20.0, sinks=True, steps=8, lr=3e-3, warmup=2, telemetry_every=0,
        eval_every=4, ckpt_every=4, progress=False, out_dir=str(tmp_path_factory.mktemp("run")),
    )
    return cfg, tg.load_data(cfg)


def quiet(*_):
    pass


def test_packed_batches_and_targets(tg, tiny):
    cfg, data = tiny
    b = data.train[0]
    assert b.tokens.shape == b.targets.shape == b.positions.shape == (cfg.batch_size, cfg.seq_len)
    seg = torch.from_numpy(b.segments)
    # a target exists only where the next token is in the same document, never on padding
    has = b.targets[:, :-1] >= 0
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] >= 0)
    assert torch.equal(has, same)
    assert bool((b.targets[:, -1] < 0).all())
    # positions restart at every document start
    starts = torch.ones_like(seg, dtype=torch.bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    assert bool((b.positions[starts & (seg >= 0)] == 0).all())


def test_loss_decreases(tg, tiny):
    cfg, data = tiny
    res = tg.train(cfg, data, save=False, log=quiet)
    (s0, v0), (s1, v1) = res.val[0], res.val[-1]
    assert (s0, s1) == (0, cfg.steps)
    assert v1 < v0 - 0.05, res.val
    assert sum(res.losses[-2:]) < sum(res.losses[:2])


def test_tessera_matches_dense_reference(tg, tiny):
    cfg, data = tiny
    rep = tg.compare(cfg, "dense", 3, data, log=quiet)
    assert len(rep["tessera"]) == len(rep["dense"]) == 3
    assert rep["max_abs_diff"] <= 1e-4, rep


def test_tessera_matches_sdpa(tg, tiny):
    cfg, data = tiny
    # SDPA has no softcap: compare without it (sinks through SDPA's extra key)
    rep = tg.compare(dataclasses.replace(cfg, softcap=0.0), "sdpa", 3, data, log=quiet)
    assert rep["max_abs_diff"] <= 1e-4, rep


def test_engines_agree_on_one_forward(tg, tiny):
    cfg, data = tiny
    b = data.val[0]
    model, _ = tg.build(cfg, data)
    with torch.no_grad():
        ref = float(model(b, tg.Engine("dense", b.segments, cfg)))
        got = float(model(b, tg.Engine("tessera", b.segments, cfg)))
    assert abs(ref - got) <= 1e-5


def test_checkpoint_resume_continues_exactly(tg, tiny, tmp_path):
    pytest.importorskip("safetensors")
    cfg, data = tiny
    cfg = dataclasses.replace(cfg, out_dir=str(tmp_path), steps=6, ckpt_every=3, eval_every=3,
                              telemetry_every=2)
    full = tg.train(cfg, data, save=True, evaluate_val=False, log=quiet)
    # an interrupted run of the same schedule (checkpoint at step 3), then resumed
    tg.train(cfg, data, save=True, evaluate_val=False, until=3, log=quiet)
    ckpt = tmp_path / "ckpt.safetensors"
    assert tg.load_checkpoint(ckpt, tg.build(cfg, data)[0], None) == 3
    rest = tg.train(cfg, data, resume=ckpt, save=True, evaluate_val=False, log=quiet)
    assert rest.losses == full.losses[3:]
    # telemetry: JSON lines, one record per (logged step, layer)
    lines = (tmp_path / "telemetry.jsonl").read_text().splitlines()
    assert len(lines) >= cfg.layers
