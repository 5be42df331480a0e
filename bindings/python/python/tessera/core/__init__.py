"""Tessera's framework-free core (the bottom layer of the package).

Masks (:mod:`.masks`), plans and their handles (:mod:`.plans`), packing (:mod:`.pack`), token
layouts (:mod:`.layouts`), context-parallel shardings and their cost model (:mod:`.sharding`),
telemetry configuration (:mod:`.telemetry`) and the argument checks every frontend shares
(:mod:`.args`) import numpy and the native module only. The two exporters hand a plan to another
engine as that engine's own data: :mod:`.flex_tables` (a torch ``BlockMask``, its ``mask_mod``
generated from the mask tree by :mod:`.flex_mask`) and
:mod:`.splash_tables` (JAX Splash ``MaskInfo``); they import their framework, and nothing in the
core imports them at import time. Nothing here imports an engine or a frontend.
"""



