"""Engines: the kernels that run attention over a plan, one module each (the middle layer).

- :mod:`.native_torch`: Tessera's CPU kernels as torch custom ops (forward, backward, logged
  forward), zero-copy on torch's tensors.
- :mod:`.flex`: PyTorch FlexAttention over the plan's ``BlockMask``, with exact sinks, softcap
  and telemetry around it (its Triton kernel, or its FLASH backend for ``flex_flash``).
- :mod:`.varlen`: ``torch.nn.attention.varlen.varlen_attn`` for plans of exactly causal,
  contiguous documents.
- :mod:`.select`: which engine runs a call (each engine's reasons not to, ``auto``'s priority
  list, the record ``last_dispatch``).
- :mod:`.native_xla`: Tessera's CPU kernels as XLA FFI custom calls, and the plan-handle
  registry they read.
- :mod:`.splash`: JAX Splash (Pallas; Mosaic on TPU) over the plan's ``MaskInfo``.
- :mod:`.xla_splash`: the same Splash kernels on torch_xla's XLA tensors through ``call_jax``
  (the plan as one device tensor, torch autograd, manual SPMD sharding).
- :mod:`.torch_dist`: the K/V exchange and dK/dV return of context parallelism over
  ``torch.distributed`` (shared by the torch engines' context-parallel paths).

Engines import only the core (and each other); frontends pick an engine and own autograd.
"""



