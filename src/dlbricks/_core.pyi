# Stubs for the C++ extension (cpp/bindings/module.cpp); keep in step with it.
# Array arguments accept anything numpy can convert (forcecast to the given dtype,
# C-contiguous); results are freshly allocated numpy arrays.

import mmap
from collections.abc import Mapping, Sequence
from typing import Annotated, SupportsIndex, SupportsInt, TypedDict, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import NotRequired  # typing has it from Python 3.11

_Int32Array = Annotated[npt.ArrayLike, np.int32]
_Int64Array = Annotated[npt.ArrayLike, np.int64]
_UInt8Array = Annotated[npt.ArrayLike, np.uint8]
_Float64Array = Annotated[npt.ArrayLike, np.float64]
_Int = SupportsInt | SupportsIndex

SEQUENCE_DIGEST_VERSION: int
# Size limits both loaders apply (cpp/include/dlbricks/limits.hpp).
MAX_ELEMENTS: int
INLINE_BYTES: int
PARAM_MAX_ELEMENTS: int
INT_PARAM_MAX_ELEMENTS: int

class _DedupResult(TypedDict):
    layer_ids: npt.NDArray[np.int32]
    unique_layer_first: npt.NDArray[np.int64]
    seq_model_offsets: npt.NDArray[np.int64]
    seq_offsets: npt.NDArray[np.int64]
    seq_members: npt.NDArray[np.int32]
    seq_ids: npt.NDArray[np.int32]
    # With sequence_digests=True (the default) the digests; otherwise the compact form
    # of each unique sequence, for expand_sequence_keys() and sequence_digests().
    unique_seq_digests: NotRequired[npt.NDArray[np.uint8]]
    unique_seq_compact: NotRequired[npt.NDArray[np.uint8]]
    unique_seq_compact_offsets: NotRequired[npt.NDArray[np.int64]]
    unique_seq_first: npt.NDArray[np.int64]
    model_unique_layers: npt.NDArray[np.int64]
    model_unique_seqs: npt.NDArray[np.int64]
    layer_repeats: npt.NDArray[np.uint8]

def digest128(data: bytes) -> bytes:
    """BLAKE2b with a 16-byte digest (equals hashlib.blake2b(data, digest_size=16))."""

def topo_order(n_nodes: _Int, edge_src: _Int32Array, edge_dst: _Int32Array) -> npt.NDArray[np.int32]: ...

# G follows the optional slot arrays without a default: pass it by position after
# both slots, or by keyword.
@overload
def split_sequences(
    digests: _UInt8Array,
    edge_src: _Int32Array,
    edge_dst: _Int32Array,
    edge_src_slot: _Int32Array | None,
    edge_dst_slot: _Int32Array | None,
    G: _Int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.uint8]]: ...
@overload
def split_sequences(
    digests: _UInt8Array,
    edge_src: _Int32Array,
    edge_dst: _Int32Array,
    edge_src_slot: _Int32Array | None = None,
    edge_dst_slot: _Int32Array | None = None,
    *,
    G: _Int,
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.uint8]]: ...
def critical_path(
    weights: _Float64Array, edge_src: _Int32Array, edge_dst: _Int32Array
) -> tuple[float, npt.NDArray[np.int32]]: ...
@overload
def dedup_corpus(
    node_offsets: _Int64Array,
    edge_offsets: _Int64Array,
    digests: _UInt8Array,
    edge_src: _Int32Array,
    edge_dst: _Int32Array,
    edge_src_slot: _Int32Array | None,
    edge_dst_slot: _Int32Array | None,
    G: _Int,
    sequence_digests: bool = True,
) -> _DedupResult: ...
@overload
def dedup_corpus(
    node_offsets: _Int64Array,
    edge_offsets: _Int64Array,
    digests: _UInt8Array,
    edge_src: _Int32Array,
    edge_dst: _Int32Array,
    edge_src_slot: _Int32Array | None = None,
    edge_dst_slot: _Int32Array | None = None,
    *,
    G: _Int,
    sequence_digests: bool = True,
) -> _DedupResult: ...
def dedup_corpus_many(
    node_offsets: _Int64Array,
    edge_offsets: _Int64Array,
    digests: _UInt8Array,
    edge_src: _Int32Array,
    edge_dst: _Int32Array,
    edge_src_slot: _Int32Array | None = None,
    edge_dst_slot: _Int32Array | None = None,
    *,
    Gs: Sequence[int],
    sequence_digests: bool = True,
) -> list[_DedupResult]: ...  # one per G, all holding the same layer arrays
def sequence_digests(keys: _UInt8Array, key_offsets: _Int64Array) -> npt.NDArray[np.uint8]:
    """Sequence digests of canonical keys (expand_sequence_keys makes them)."""
def compact_sequence_digests(
    compact: _UInt8Array, offsets: _Int64Array, layer_digests: _UInt8Array
) -> npt.NDArray[np.uint8]:
    """Sequence digests straight from the compact forms dedup_corpus(..., sequence_digests=False) returns."""
def expand_sequence_keys(
    compact: _UInt8Array, offsets: _Int64Array, layer_digests: _UInt8Array
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int64]]:
    """Canonical keys and offsets from the compact forms dedup_corpus(..., sequence_digests=False)
    returns; layer_digests: the corpus' unique layers, by id."""
def repeated_kinds(
    node_offsets: _Int64Array, repeated: npt.NDArray[np.uint8], kind_codes: _Int32Array
) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int32], npt.NDArray[np.int64]]: ...
def jaccard_matrix(node_offsets: _Int64Array, layer_ids: _Int32Array) -> npt.NDArray[np.float64]: ...

# The fast loader (cpp/include/dlbricks/onnx_scan.hpp, docs/core.md).
_Buffer = bytes | bytearray | memoryview | mmap.mmap

class WireError(ValueError): ...

def canonical_attributes(attribute_fields: _Buffer, defaults: Mapping[str, bytes] | None) -> bytes | None:
    """The attributes part of a layer head from serialized attribute fields; None when
    an attribute is not plain (see digest.make_head_from_fields)."""

def flush_denormals() -> bool | None:
    """Whether this thread flushes subnormals to zero (x86-64: MXCSR FTZ and DAZ; aarch64:
    FPCR.FZ); None where the CPU is not supported."""

def set_flush_denormals(on: bool) -> bool | None:
    """Sets or clears this thread's flush-to-zero mode; returns the previous state as
    flush_denormals() reads it, or None (nothing changed) where the CPU is not supported."""

def disable_fastbins() -> bool:
    """Turns glibc's fastbins off for the process; False where the C library is not
    glibc or refuses."""

def canonical_attribute_body(attribute: _Buffer) -> bytes | None:
    """The canonical body (type, reference flag, value) of one serialized AttributeProto;
    None when it is not plain (see digest._schema_defaults)."""

class _ScanResult(TypedDict, total=False):
    fallback: str  # always present; the other keys only when it is ""
    output_types: list[tuple[int, tuple[int, ...]]]
    layer_op_keys: npt.NDArray[np.int32]
    layer_names: bytes
    layer_name_ends: npt.NDArray[np.int64]
    digests: npt.NDArray[np.uint8]
    edge_src: npt.NDArray[np.int32]
    edge_src_slot: npt.NDArray[np.int32]
    edge_dst: npt.NDArray[np.int32]
    edge_dst_slot: npt.NDArray[np.int32]

class HeadTable:
    def __init__(self, max_entries: int = 16384, max_bytes: int = 67108864) -> None: ...
    def __len__(self) -> int: ...
    def clear(self) -> None: ...

class OnnxScan:
    def __init__(self, data: _Buffer) -> None: ...
    @property
    def fallback(self) -> str: ...
    @property
    def ir_version(self) -> int: ...
    @property
    def opsets(self) -> list[tuple[str, int]]: ...
    @property
    def op_keys(self) -> list[tuple[str, str]]: ...
    @property
    def head_node(self) -> list[int]: ...
    @property
    def output_names(self) -> list[str]: ...
    @property
    def head_op_key(self) -> list[int]: ...
    @property
    def inputs(self) -> list[tuple[str, int, list[tuple[int, int, str]]]]: ...
    def resolve_heads(self, data: _Buffer, table: HeadTable, op_versions: Sequence[int]) -> list[tuple[int, int, bytes]]: ...
    def set_head(self, head: int, canonical: bytes, table: HeadTable) -> None: ...
    def set_plain_heads(
        self,
        data: _Buffer,
        heads: Sequence[int],
        prefixes: Sequence[bytes],
        defaults: Sequence[Mapping[str, bytes] | None],
        table: HeadTable,
    ) -> list[int]: ...
    def light_model(self, data: _Buffer, input_shapes: Sequence[Sequence[int]]) -> bytes: ...
    def finish(
        self,
        data: _Buffer,
        inferred: _Buffer,
        input_shapes: Sequence[Sequence[int]],
        dim_subst: Mapping[str, int],
    ) -> _ScanResult: ...
