"""The FlexAttention engine behind ``tessera.torch.attention`` and ``tessera.cp.attention``
(docs/semantics.md#engines-and-devices): the same semantics (docs/semantics.md#attention) on any device FlexAttention runs on, over the plan's
``BlockMask``.

- The plan's ``BlockMask`` is built once per (plan, device) from its work lists and kept on the
  plan (device-resident); ``plan.to_flex_block_mask(device)`` returns that same object.
- FlexAttention runs compiled: inside the caller's ``torch.compile`` it is traced into the
  caller's graph; outside, through one ``torch.compile(flex_attention)`` per process (shapes and
  score functions are its only specializations). On CPU tensors, outside a compiled step, it runs
  FlexAttention's unfused CPU path (forward only: FlexAttention has no CPU backward, and its
  compiled CPU kernel returns no LSE).
- Softcap is a ``score_mod`` (``c·tanh(s/c)``, after the scale); learned sinks are exact from
  the LSE: ``O' = O·sigmoid(LSE − σ_h)``, ``LSE' = logaddexp(LSE, σ_h)`` (a row with no allowed key
  keeps ``O = 0``, its LSE becomes ``σ_h``), differentiable in plain torch ops, so ``dσ`` and the
  LSE's gradient flow through FlexAttention's own backward. No host read in the step.
- Telemetry (docs/semantics.md#telemetry) on logging steps only, as fixed-shape device tensors with the Tessera
  kernel's per-head layout (``_tessera.TELEMETRY_COLUMNS``): sink mass from one extra pass whose
  ``score_mod`` keeps only the sink keys (its LSE against the row's), entropy from one extra pass
  whose ``score_mod`` weighs each score by ``LSE − s`` (``Σ_j p_j (LSE − s_j)`` is the entropy),
  the pre-softcap max logit from one pass without softcap (FlexAttention's ``max_scores`` where
  the device has it; else the LSE of the scores times 2^24, divided back), outliers from O.

Tests swap FlexAttention's kernels for a stand-in explicitly with :func:`use_kernel` (e.g.
:func:`reference_kernel`, FlexAttention's own differentiable dense math), to run the backward of
the code around FlexAttention on CPU; user code never falls back to it.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
from torch import Tensor

from ..core.flex_tables import _key


ENGINES = ("auto", "tessera", "flex")


# The LSE of the scores times 2^24, divided by 2^24, is their max to within log(ties) / 2^24: the
# max logit where FlexAttention cannot return max_scores (its CPU path).
_MAX_BETA = float(2**24)


_KERNEL: Optional[Callable[..., Tuple[Tensor, Optional[Tensor], Optional[Tensor]]]] = None

# FlexAttention's kernel backend while the ``flex_flash`` engine runs (``"FLASH"``); None: its default.
_BACKEND: Optional[str] = None


def engine_for(engine: Any, q: Any) -> str:
    """``"tessera"`` or ``"flex"``: ``auto`` picks Tessera's kernels for CPU tensors and
    FlexAttention for any other device."""
    if engine not in ENGINES:
        raise ValueError(f"engine: expected one of {ENGINES}, got {engine!r}")
    if engine != "auto":
        return engine
    on_cpu = not isinstance(q, Tensor) or q.device.type == "cpu"
    return "tessera" if on_cpu else "flex"


# -- the kernel: FlexAttention, or a stand-in chosen by a test --------------------------------------


@contextlib.contextmanager
def use_kernel(kernel: Optional[Callable]) -> Iterator[None]:
    """Runs the flex engine on ``kernel`` instead of FlexAttention inside the block (``None``:
    FlexAttention). A kernel is called as ``kernel(q, k, v, score_mod, block_mask, scale, *,
    enable_gqa, lse, max_scores)`` and returns ``(O, LSE or None, max_scores or None)``, LSE and
    max in natural-log units. For tests: :func:`reference_kernel` has a backward on CPU."""
    global _KERNEL
    old, _KERNEL = _KERNEL, kernel
    try:
        yield
    finally:
        _KERNEL = old


def reference_kernel(q, k, v, score_mod, block_mask, scale, *, enable_gqa, lse, max_scores):
    """FlexAttention's own dense math (``torch._higher_order_ops.flex_attention.math_attention``):
    the same ``score_mod``/``mask_mod`` semantics, differentiable in plain torch ops on any device.
    It materializes every score: a stand-in for FlexAttention's GPU kernels in tests."""
    import importlib

    fa = importlib.import_module("torch._higher_order_ops.flex_attention")
    mod = score_mod if score_mod is not None else (lambda s, b, h, i, j: s)
    o, lse2, max2 = fa.math_attention(q, k, v, mod, block_mask.as_tuple(), scale, {}, (), ())
    ln2 = math.log(2.0)
    return o, (lse2 * ln2 if lse else None), (max2 * ln2 if max_scores else None)


_compiled: Optional[Callable] = None


def _compiled_flex() -> Callable:
    """``torch.compile(flex_attention)``, made once per process."""
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _flex_kernel(q, k, v, score_mod, block_mask, scale, *, enable_gqa, lse, max_scores):
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    aux = AuxRequest(lse=lse, max_scores=max_scores) if (lse or max_scores) else None
    kw = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
              return_aux=aux)
    rows = q.shape[2] * (q.shape[1] // k.shape[1])
    if q.device.type != "cpu" and q.shape[2] < 128 and rows > block_mask.BLOCK_SIZE[0]:
        # FlexAttention picks its decoding kernel for short queries, whose row block (queries times
        # the GQA group, to a power of two) must divide the BlockMask's q block; past it, torch 2.11
        # finds no kernel config (NoValidChoicesError on an H200). Its main kernel takes any length.
        kw["kernel_options"] = {"BACKEND": "TRITON"}
    if _BACKEND is not None:
        kw["kernel_options"] = {"BACKEND": _BACKEND}
    if not torch.is_grad_enabled():  # FlexAttention's CPU path refuses inputs that require grad
        q, k, v = q.detach(), k.detach(), v.detach()
    if torch.compiler.is_compiling() or q.device.type == "cpu":
        # Inside the caller's compiled step: traced into its graph. On CPU tensors: the unfused
        # CPU path (it compiles with an eager backend; the inductor CPU kernel has no LSE).
        out = flex_attention(q, k, v, **kw)
    else:
        fn = _compiled_flex()
        # one compiled entry per (shapes, score function): more than dynamo's default limit of 8
        limit = getattr(getattr(torch._dynamo, "utils", None), "disable_cache_limit", None)
        with limit() if limit is not None else contextlib.nullcontext():
            out = fn(q, k, v, **kw)
    if aux is None:
        return out, None, None
    o, a = out
    return o, (a.lse if lse else None), a.max_scores


def _has_max_scores(device: torch.device) -> bool:
    if _KERNEL is not None:
        return bool(getattr(_KERNEL, "has_max_scores", False))
    return device.type not in ("cpu", "mps")


def _min_head_dim(device: torch.device) -> int:
    """The smallest head dim FlexAttention's kernels take on ``device``: its GPU kernels need 16
    (``tl.dot``; torch 2.11 on an H200: "NYI: embedding dimension ... must be at least 16")."""
    return 0 if device.type == "cpu" else 16


def _run(q, k, v, score_mod, bm, scale, *, lse=False, max_scores=False):
    kernel = _KERNEL if _KERNEL is not None else _flex_kernel
    # Head dims below the kernels' minimum are zero-padded: zero q/k features add nothing to a
    # score (the scale stays the caller's), zero value columns are sliced off the output, and the
    # gradients of the padding are discarded by the pad's own backward.
    need = _min_head_dim(q.device)
    dv = v.shape[-1]
    if q.shape[-1] < need:
        q = torch.nn.functional.pad(q, (0, need - q.shape[-1]))
        k = torch.nn.functional.pad(k, (0, need - k.shape[-1]))
    if dv < need:
        v = torch.nn.functional.pad(v, (0, need - dv))
    o, l, m = kernel(q, k, v, score_mod, bm, scale, enable_gqa=q.shape[1] != k.shape[1], lse=lse,
                     max_scores=max_scores)
    return (o[..., :dv] if o.shape[-1] != dv else o), l, m


def check_grad(q: Tensor, k: Tensor, v: Tensor, what: str = "tessera.torch.attention") -> None:
    """FlexAttention has no CPU backward: a clear error instead of its own (tests pass a stand-in
    kernel with :func:`use_kernel`)."""
    if _KERNEL is None and q.device.type == "cpu" and torch.is_grad_enabled() and (
        q.requires_grad or k.requires_grad or v.requires_grad
    ):
        raise NotImplementedError(
            f"{what}(engine='flex') on CPU tensors: FlexAttention has no CPU backward (forward "
            "only: run under torch.no_grad(), or use engine='tessera', Tessera's CPU kernels with "
            "backward)"
        )


def block_mask(plan: Any, device: Any):
    """The plan's ``BlockMask`` on ``device``: built on first use, then kept on the plan."""
    bm = plan._flex.get("bm", {}).get(_key(device))
    if bm is None:
        bm = _outside("bm")(plan, device) if torch.compiler.is_compiling() else _build_block_mask(plan, device)
    return bm


def _build_block_mask(plan: Any, device: Any):
    _wrap_builders()
    from ..core.flex_tables import to_flex_block_mask

    return to_flex_block_mask(plan, device)


def _sink_positions(plan: Any, device: Any) -> Tensor:
    """``int32 [B' or 1, Lkv]`` on ``device``: each key's position in its document (``-1`` for
    padding keys), or in the row when the mask has no documents. Built once per device."""
    pos = plan._flex.get("pos", {}).get(_key(device))
    if pos is None:
        pos = _outside("pos")(plan, device) if torch.compiler.is_compiling() else _build_positions(plan, device)
    return pos


def _build_positions(plan: Any, device: Any) -> Tensor:
    _wrap_builders()
    from ..core.plans import sink_positions

    if plan._p is None or plan._p.mask is None:
        raise ValueError(
            "telemetry: the FlexAttention engine cannot tell the sink keys of a plan without a "
            "mask (a rank's local plan of a sharding)"
        )
    pos = torch.from_numpy(sink_positions(plan)).to(device)
    plan._flex.setdefault("pos", {})[_key(device)] = pos
    return pos


# Inside a compiled step, the builders run outside the graph (a graph break; with fullgraph=True,
# an error that says what to do). The wrappers are made outside any trace (importing dynamo is
# slow: on the first eager build, or at import when dynamo is loaded already).
_OUTSIDE = (
    "tessera: a plan's FlexAttention BlockMask (and, for telemetry, its sink-key positions) is built "
    "on the host once per (plan, device), which a compiled step cannot do: call "
    "plan.to_flex_block_mask(device=...) before the compiled step (telemetry: run one logging step "
    "eagerly first), or run the first step eagerly"
)


_BUILDERS: Dict[str, Callable] = {}


def _wrap_builders() -> None:
    if not _BUILDERS and not torch.compiler.is_compiling():
        import importlib

        dynamo = importlib.import_module("torch._dynamo")
        _BUILDERS["bm"] = dynamo.disable(_build_block_mask, reason=_OUTSIDE)
        _BUILDERS["pos"] = dynamo.disable(_build_positions, reason=_OUTSIDE)


def _outside(what: str) -> Callable:
    fn = _BUILDERS.get(what)
    if fn is None:
        raise RuntimeError(_OUTSIDE)
    return fn


_MODS: Dict[Any, Callable] = {}


def _softcap_mod(softcap: Optional[float]) -> Optional[Callable]:
    """``c·tanh(s/c)`` as a ``score_mod``, one function object per ``c`` (so compiled calls
    reuse their graphs)."""
    if softcap is None:
        return None
    mod = _MODS.get(softcap)
    if mod is None:
        if torch.compiler.is_compiling():
            # Traced by the caller's compiled step: the captured float is a constant of its graph.
            cap = float(softcap)

            def traced_softcap_mod(score, b, h, q_idx, kv_idx):
                return cap * torch.tanh(score / cap)

            return traced_softcap_mod
        # The constant is written into the function's code, not captured: FlexAttention's own
        # compilation (dynamic shapes) would turn a captured float into a symbolic one, which it
        # refuses.
        c = repr(float(softcap))
        ns: Dict[str, Any] = {"torch": torch}
        exec(f"def softcap_mod(score, b, h, q_idx, kv_idx):\n    return {c} * torch.tanh(score / {c})\n", ns)
        mod = _MODS[softcap] = ns["softcap_mod"]
    return mod


# -- attention -----------------------------------------------------------------------------------


def _with_sinks(o: Tensor, lse: Tensor, sinks: Tensor) -> Tuple[Tensor, Tensor]:
    """Learned sinks from the LSE: ``O·sigmoid(LSE − σ)``, ``logaddexp(LSE, σ)``. The per-row
    factors are taken in float64 (LSE-sized, small), so ``dσ``, a sum over every row of terms of
    both signs, is accumulated in float64 as well."""
    s = sinks.double()[None, :, None]
    lse64 = lse.double()
    w = torch.sigmoid(lse64 - s).float()
    return (o.float() * w[..., None]).to(o.dtype), torch.logaddexp(lse64, s).float()


def forward(q, k, v, bm, scale, softcap, sinks, need_lse):
    """``(O, LSE, LSE before the sinks)``, differentiable (LSE None unless ``need_lse`` or sinks)."""
    need = need_lse or sinks is not None
    o, lse, _ = _run(q, k, v, _softcap_mod(softcap), bm, scale, lse=need)
    plain = lse
    if sinks is not None:
        o, lse = _with_sinks(o, lse, sinks)
    return o, lse, plain


def attention(q, k, v, plan, *, scale, softcap, sinks, return_lse, telemetry, layer, backend=None):
    """``tessera.torch.attention`` on FlexAttention (arguments already checked); ``backend``:
    FlexAttention's ``kernel_options["BACKEND"]`` (``"FLASH"`` for the ``flex_flash`` engine)."""
    global _BACKEND
    if backend is not None:
        old, _BACKEND = _BACKEND, backend
        try:
            return attention(q, k, v, plan, scale=scale, softcap=softcap, sinks=sinks,
                             return_lse=return_lse, telemetry=telemetry, layer=layer)
        finally:
            _BACKEND = old
    check_grad(q, k, v)
    bm = block_mask(plan, q.device)
    logging = telemetry is not None and telemetry.should_log()
    o, lse, plain = forward(q, k, v, bm, scale, softcap, sinks, return_lse or logging)
    if logging:
        with torch.no_grad():
            stats = summary(q.detach(), k.detach(), v.detach(), o.detach(), plain.detach(),
                            None if sinks is None else sinks.detach(), bm, scale, softcap, plan,
                            telemetry.config)
        telemetry._record(layer, sinks is not None, stats, q.shape[0] * q.shape[2])
    return (o, lse) if return_lse else o


# -- telemetry -----------------------------------------------------------------------------------


def summary(q, k, v, o, lse, sinks, bm, scale, softcap, plan, cfg) -> Tensor:
    """The Tessera kernel's per-head telemetry row (``float64 [Hq, 9]``: valid rows, Σ sink mass,
    Σ learned-sink mass, Σ entropy, max logit, max |O|, Σ O², O elements, outliers) computed from
    FlexAttention passes, on the device. ``lse``: the LSE before the sinks."""
    from .. import _tessera

    b, hq, lq, _ = q.shape
    dev = q.device
    f64 = torch.float64
    stats = torch.zeros((hq, _tessera.TELEMETRY_COLUMNS), dtype=f64, device=dev)
    cap = _softcap_mod(softcap)

    def capped(score):
        return score if cap is None else cap(score, None, None, None, None)

    if cfg["sink_stream"]:
        valid = torch.isfinite(lse)
        lse0 = torch.where(valid, lse, torch.zeros_like(lse))  # no NaN in captured buffers
        if sinks is not None:
            sig = sinks.float()[None, :, None]
            lse_all = torch.logaddexp(lse0, sig)
            p_sink = torch.exp(sig - lse_all)
        else:
            lse_all, p_sink = lse0, torch.zeros_like(lse0)
        mass = torch.zeros_like(lse0)
        st = cfg["sink_tokens"]
        if st > 0:
            pos = _sink_positions(plan, dev)
            flags = (pos >= 0) & (pos < st)
            one_row = flags.shape[0] == 1

            def sink_keys(score, bb, hh, q_idx, kv_idx):
                keep = flags[bb * 0 if one_row else bb, kv_idx]
                return torch.where(keep, capped(score), float("-inf"))

            _, lse_s, _ = _run(q, k, v, sink_keys, bm, scale, lse=True)
            mass = torch.exp(lse_s - lse_all)

        def entropy_weight(score, bb, hh, q_idx, kv_idx):
            s = capped(score)
            return s + torch.log(torch.clamp_min(lse0[bb, hh, q_idx] - s, 0.0))

        _, lse_e, _ = _run(q, k, v, entropy_weight, bm, scale, lse=True)
        ent = torch.exp(lse_e - lse0)  # Σ_j p_j (LSE − s_j) over the keys
        if sinks is not None:
            ent = (1 - p_sink) * (lse_all - lse0 + ent) + p_sink * (lse_all - sig)

        def total(x):
            return torch.where(valid, x, torch.zeros_like(x)).to(f64).sum(dim=(0, 2))

        stats[:, 0] = valid.to(f64).sum(dim=(0, 2))
        stats[:, 1] = total(mass)
        if sinks is not None:
            stats[:, 2] = total(p_sink.expand_as(lse0))
        stats[:, 3] = total(ent)

    # max logit (pre-softcap): one pass without softcap
    if _has_max_scores(dev):
        _, _, mx = _run(q, k, v, None, bm, scale, max_scores=True)
    else:

        def times_beta(score, bb, hh, q_idx, kv_idx):
            return score * _MAX_BETA

        _, lb, _ = _run(q, k, v, times_beta, bm, scale, lse=True)
        mx = lb / _MAX_BETA
    stats[:, 4] = mx.to(f64).amax(dim=(0, 2))

    if cfg["outlier_stream"]:
        o32 = o.float()
        sq = torch.sum(o32 * o32, dim=(2, 3), dtype=f64)  # [B, Hq]
        n = o32.shape[2] * o32.shape[3]
        thr = cfg["outlier_ratio"] * torch.sqrt(sq / n)
        # |o| > thr (reals) iff |o| > the largest f32 <= thr, as the kernel counts
        t32 = thr.float()
        t32 = torch.where(t32.to(f64) > thr, torch.nextafter(t32, torch.full_like(t32, -math.inf)), t32)
        stats[:, 5] = o32.abs().amax(dim=(2, 3)).to(f64).amax(dim=0)
        stats[:, 6] = sq.sum(dim=0)
        stats[:, 7] = float(b * n)
        stats[:, 8] = (o32.abs() > t32[..., None, None]).sum(dim=(2, 3)).to(f64).sum(dim=0)
    return stats


if "torch._dynamo" in sys.modules:
    _wrap_builders()
