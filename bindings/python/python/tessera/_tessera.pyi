"""Type stubs of the native module ``tessera._tessera`` (PyO3). Users call the pure-Python layer
(``tessera``, ``tessera.torch``, ``tessera.jax``); these signatures are what it calls."""

from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt

__version__: str
TELEMETRY_COLUMNS: int
isa: str
# "used: AMX-BF16" (or the software model under TESSERA_AMX_MODEL=1), else "not used: <why>".
amx: str

class Mask:
    """An attention mask expression (the algebra of docs/semantics.md#masks)."""

    def __and__(self, other: Mask) -> Mask: ...
    def __or__(self, other: Mask) -> Mask: ...
    def __invert__(self) -> Mask: ...
    def __eq__(self, other: object) -> bool: ...
    def __hash__(self) -> int: ...
    def allowed(self, i: int, j: int, b: int = 0, h: int = 0) -> bool: ...
    def _tree(self) -> Tuple[Any, ...]: ...

class Plan:
    """A native plan; wrapped by :class:`tessera.Plan`."""

    @property
    def shape(self) -> Tuple[int, int, int, int]: ...
    @property
    def block(self) -> Tuple[int, int]: ...
    @property
    def groups(self) -> Tuple[int, int]: ...
    @property
    def mask(self) -> Optional[Mask]: ...
    @property
    def source(self) -> str: ...
    @property
    def contract(self) -> str: ...
    @property
    def stats(self) -> Dict[str, Any]: ...
    @property
    def has_masks(self) -> bool: ...
    def states(self) -> npt.NDArray[np.uint8]: ...
    def kv_segments(self) -> Optional[npt.NDArray[np.int64]]: ...
    def flops(self, d_qk: int, d_v: Optional[int] = None, backward: bool = False) -> float: ...
    def save_png(self, path: str, batch: int = 0, head: int = 0, title: Optional[str] = None) -> None: ...
    def _flex_arrays(self, packed: bool = False) -> Dict[str, Any]: ...
    def _flex_tables(
        self, per_tile: int, max_floor: int, bits: bool = True
    ) -> Tuple[List[np.ndarray], Optional[np.ndarray], Tuple[int, int, int, int, int, int, int, int]]: ...
    def _flex_compact(
        self, per_tile: int, max_floor: int, bits: bool = True
    ) -> Tuple[np.ndarray, np.ndarray, Optional[np.ndarray], Tuple[int, int, int, int, int, int, int, int]]: ...
    def _splash_arrays(
        self,
        head_shards: int = 1,
        q_seq_shards: int = 1,
        shrink_grid: bool = True,
        shrink_grid_dkv: bool = True,
        downcast_smem_data: bool = True,
    ) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]: ...

class Sharding:
    """A context-parallel sharding of a plan's row over ranks; wrapped by ``tessera.cp``."""

    @property
    def scheme(self) -> str: ...
    @property
    def world_size(self) -> int: ...
    @property
    def tile(self) -> int: ...
    @property
    def tokens_per_rank(self) -> int: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def costs(self) -> List[Dict[str, Any]]: ...
    def imbalance(self) -> float: ...
    def kv_fraction(self) -> float: ...
    def owned(self, rank: int) -> npt.NDArray[np.int64]: ...
    def positions(self, rank: int) -> npt.NDArray[np.int64]: ...
    def permutation(self) -> npt.NDArray[np.int64]: ...
    def needed(self, rank: int) -> List[npt.NDArray[np.int64]]: ...
    def local_kv_tiles(self, rank: int, mode: str) -> npt.NDArray[np.int64]: ...
    def local_plan(self, rank: int, mode: str, kv_tiles: int = 0) -> Plan: ...
    def clusters(self) -> npt.NDArray[np.int64]: ...

def shard(
    plan: Plan,
    world_size: int,
    scheme: str = "balanced",
    partial_overhead: float = 0.3,
    backward: float = 2.5,
    balance_cap: float = 1.02,
) -> Sharding: ...
def doc_mix(
    length: int,
    seed: int = 0,
    median: Optional[float] = None,
    sigma: Optional[float] = None,
    long_fraction: Optional[float] = None,
    long_docs: Optional[float] = None,
) -> npt.NDArray[np.int64]: ...
def simulate(
    lengths: List[int],
    ranks: List[int],
    seed: int = 0,
    flops: float = 400e12,
    link_gbps: float = 50.0,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    tile: int = 128,
    mix: str = "tokens",
    balance_cap: float = 1.02,
) -> Tuple[List[Dict[str, Any]], List[str]]: ...
def full() -> Mask: ...
def causal(offset: int = 0) -> Mask: ...
def window(left: int, right: int = 0) -> Mask: ...
def chunk(size: int) -> Mask: ...
def prefix(n: int) -> Mask: ...
def document(ids: npt.NDArray[np.int64], kv_ids: Optional[npt.NDArray[np.int64]] = None) -> Mask: ...
def band(
    q_feature: npt.NDArray[np.int64], kv_feature: npt.NDArray[np.int64], lo: int, hi: int
) -> Mask: ...
def dense(values: npt.NDArray[np.bool_]) -> Mask: ...
def heads(masks: Sequence[Mask]) -> Mask: ...
def blocks(kv_tiles: npt.NDArray[np.int64], q_block: int, kv_block: int, label: str = "kv_tiles") -> Mask: ...
def mask(
    expr: str,
    segments: Optional[npt.NDArray[np.int64]] = None,
    q_segments: Optional[npt.NDArray[np.int64]] = None,
    kv_segments: Optional[npt.NDArray[np.int64]] = None,
    dense: Optional[Dict[str, npt.NDArray[np.bool_]]] = None,
    features: Optional[Dict[str, npt.NDArray[np.int64]]] = None,
    blocks: Optional[Dict[str, npt.NDArray[np.int64]]] = None,
) -> Mask: ...
def plan(
    mask: Mask,
    q_len: int,
    kv_len: Optional[int] = None,
    heads: Optional[int] = None,
    batch: Optional[int] = None,
    block: Union[int, Tuple[int, int], None] = None,
    cache: bool = True,
    masks: bool = True,
) -> Plan: ...
def cache_stats() -> Dict[str, Any]: ...
def pack(docs: List[List[int]], seq_len: int, strategy: str = "best-fit", bos: int = 256) -> Dict[str, Any]: ...
def attention_forward(
    plan: Plan,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray,
    max_logit: np.ndarray,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Sequence[float]] = None,
) -> None: ...
def attention_backward(
    plan: Plan,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray,
    d_o: np.ndarray,
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    d_lse: Optional[np.ndarray] = None,
    dsinks: Optional[np.ndarray] = None,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Sequence[float]] = None,
) -> None: ...
def attention_forward_logged(
    plan: Plan,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    o: np.ndarray,
    lse: np.ndarray,
    max_logit: np.ndarray,
    stats: np.ndarray,
    scale: Optional[float] = None,
    softcap: Optional[float] = None,
    sinks: Optional[Sequence[float]] = None,
    sink_tokens: int = 1,
    outlier_ratio: float = 6.0,
    sink_stream: bool = True,
    outlier_stream: bool = True,
    sink_flags: Optional[npt.NDArray[np.bool_]] = None,
) -> None: ...
def telemetry_records(
    stats: npt.NDArray[np.float64],
    steps: List[int],
    layers: List[int],
    learned_sinks: List[bool],
    every: int,
    sink_tokens: int = 1,
    epsilon: float = 0.3,
    outlier_ratio: float = 6.0,
    sink_stream: bool = True,
    outlier_stream: bool = True,
    ranks: Optional[List[int]] = None,
    tokens: Optional[List[int]] = None,
) -> List[str]: ...
def telemetry_sink_flags(plan: Plan, batch: int, sink_tokens: int = 1) -> npt.NDArray[np.bool_]: ...
def outlier_candidates(
    o: np.ndarray, slice_len: int, ratio: float
) -> Tuple[npt.NDArray[np.float64], npt.NDArray[np.int64], npt.NDArray[np.float32]]: ...

# -- XLA FFI (tessera.jax on CPU) --------------------------------------------------------------
def ffi_targets() -> Dict[str, Any]: ...
def ffi_register(plan: Plan) -> int: ...
def ffi_register_local(local: Plan, global_plan: Plan, kv_positions: Sequence[int]) -> int: ...
def ffi_release(handle: int) -> None: ...
def ffi_registered(handle: int) -> bool: ...
def ffi_registry_size() -> int: ...
