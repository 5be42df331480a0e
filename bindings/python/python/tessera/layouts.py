"""Masks for the token layouts people use, each a few leaves of the mask algebra (SPEC §13).

Contract: every helper returns a plain :class:`tessera.Mask` built from ``band``, ``window``
and ``prefix`` leaves whose per-token integer features are computed here in numpy
(O(L) memory, never an ``[Lq, Lkv]`` array), so a plan of it is exact and cheap like any other
mask and combines with ``&``, ``|``, ``~`` and ``heads``. Canvases are flattened row-major (the
last axis varies fastest) unless an ``order`` says where each token sits.

- :func:`neighborhood`: NATTEN neighborhood attention on 1-D, 2-D and 3-D canvases (windows
  clamped at the borders, dilation, stride, per-axis causal): one band per axis, plus one
  ``document`` leaf when dilation groups or tokens off the canvas need it.
- :func:`tiled_neighborhood`: Sliding Tile Attention (a canvas stored tile by tile, windows of
  whole tiles, optional text tokens after the canvas).
- :func:`tile_order`: the cell each token of a tile-by-tile canvas holds (for ``order=``).
- :func:`dilated_window`: a 1-D window keeping every ``dilation``-th key.
- :func:`global_tokens`: flagged rows attend everything, flagged columns are attended by every
  row (one band; ``|`` it with another mask).

Arguments are checked here: a wrong type raises ``TypeError``, a wrong value ``ValueError``,
each naming the function and the argument.
"""

from .core.layouts import (  # noqa: F401  (the public path of the layout helpers)
    __all__,
    dilated_window,
    global_tokens,
    neighborhood,
    tile_order,
    tiled_neighborhood,
)
