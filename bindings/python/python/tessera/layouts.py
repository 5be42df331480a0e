"""The public path of the layout helpers (``tessera.layouts``); they live in
:mod:`tessera.core.layouts`, whose docstring describes them."""

from .core.layouts import (  # noqa: F401  (the public path of the layout helpers)
    __all__,
    dilated_window,
    global_tokens,
    neighborhood,
    tile_order,
    tiled_neighborhood,
)
