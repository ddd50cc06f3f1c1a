"""Synthetic weights that every brick and model of one measurement run shares.

A brick's weight values never matter, only their type, shape and range. So rather
than drawing every tensor afresh and shipping it inside the serialized model (which
the generating process, the pipe and onnxruntime's parser each copy), the large
weights of the models one run generates are windows of a few files, one per dtype
and value range, that each model names as ONNX external data. Each session copies
its weights into its own memory (:func:`dlbricks.timing.session.create_session`;
onnxruntime repacks what its kernels prefer packed), so its working set is its own
size, as in the source model, whatever the windows share: every weight is the start
of its file, and a file is as large as the largest weight of its kind. Nothing else
copies them: no process draws, serializes or pipes them (the generating process spent
59 s of system time doing so in a ``dlbricks demo`` of 235 s on the 2-vCPU VM these
figures come from), and the pool is written once, at most a few times the largest
weight: on that VM, memory written afresh costs seconds per GiB (giving each of a
model's weights its own bytes made the nine light models' pool about 1 GB, and
writing it 16.6 s of a 61 s ``evaluate``).

Float ranges are those of :func:`dlbricks.bricks.weight_range`, with the fan-in
rounded to a power of two (a tensor's values then have within 1.19x of the scale it
would get on its own) so that a corpus needs a handful of files, not one per shape.
"""

from __future__ import annotations

import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from onnx import TensorProto, helper

if TYPE_CHECKING:  # pragma: no cover
    from dlbricks.model import TensorType

#: Weights smaller than this stay in the model: a pool reference saves little there.
MIN_POOLED_BYTES = 64 << 10
#: Values repeat a seeded block of this many (as :func:`dlbricks.bricks.repeating_uniform`).
_BLOCK = 1 << 16


class WeightPool:
    """The pool files of one run, in ``folder`` (which the pool owns and removes).

    Only the process that generates models writes to it; sessions copy from it what
    their model names as external data (``weights_dir`` of
    :class:`dlbricks.timing.session.SerializedModel`).
    """

    def __init__(self, folder: str | os.PathLike[str], *, seed: int = 0) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.seed = int(seed)
        self._files: dict[tuple[str, float, float], tuple[str, int]] = {}  # key -> (file name, bytes)

    @property
    def nbytes(self) -> int:
        """Bytes the pool's files hold."""
        return sum(size for _, size in self._files.values())

    def model(self) -> PoolWindow:
        """A fresh set of offsets for one model's weights."""
        return PoolWindow(self)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        self._files.clear()

    def __enter__(self) -> WeightPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _reserve(self, dtype: np.dtype, low: float, high: float, end: int) -> str:
        """The file holding values of ``dtype`` in [low, high), grown to at least ``end`` bytes."""
        key = (dtype.str, low, high)
        index = list(self._files).index(key) if key in self._files else len(self._files)
        name, size = self._files.get(key, (f"w{index}-{dtype.name}.bin", 0))
        if end > size:
            block = self._block(dtype, low, high, index)
            # Grown to what is asked for only: each byte written is memory touched afresh.
            new_size = -(-end // len(block)) * len(block)
            with open(self.folder / name, "ab") as f:
                for _ in range((new_size - size) // len(block)):
                    f.write(block)
            size = new_size
        self._files[key] = (name, size)
        return name

    def _block(self, dtype: np.dtype, low: float, high: float, index: int) -> bytes:
        rng = np.random.default_rng([self.seed & 0xFFFFFFFF, index])
        if np.issubdtype(dtype, np.integer):
            values = rng.integers(int(low), int(high), size=_BLOCK).astype(dtype)
        else:
            values = rng.uniform(low, high, size=_BLOCK).astype(dtype)
        return np.ascontiguousarray(values, dtype=dtype.newbyteorder("<")).tobytes()


class PoolWindow:
    """Places one model's weights in the pool (each at the start of its file)."""

    def __init__(self, pool: WeightPool) -> None:
        self.pool = pool
        self.nbytes = 0
        #: The pool files this model's weights are in.
        self.files: set[str] = set()

    @staticmethod
    def accepts(ttype: TensorType) -> bool:
        """Whether a weight of this type comes from the pool (large, numeric, a
        dtype numpy draws)."""
        dtype = ttype.dtype
        return ttype.nbytes >= MIN_POOLED_BYTES and (
            np.issubdtype(dtype, np.integer) or dtype in (np.float16, np.float32, np.float64))

    def tensor(self, name: str, ttype: TensorType, low: float, high: float) -> TensorProto:
        """An initializer ``name`` of type ``ttype`` whose values are external data in
        the pool, in [low, high) (float ranges symmetric about zero are rounded as the
        module says)."""
        dtype = ttype.dtype
        if np.issubdtype(dtype, np.floating) and low == -high and high > 0:
            fan_in = 3.0 / (high * high)
            high = math.sqrt(3.0 / 2.0 ** round(math.log2(fan_in)))
            low = -high
        nbytes = ttype.nbytes
        location = self.pool._reserve(dtype, low, high, nbytes)
        self.files.add(location)
        self.nbytes += nbytes
        t = TensorProto()
        t.name = name
        t.data_type = helper.np_dtype_to_tensor_dtype(dtype)
        t.dims.extend(ttype.shape)
        t.data_location = TensorProto.EXTERNAL
        for k, v in (("location", location), ("offset", "0"), ("length", str(nbytes))):
            entry = t.external_data.add()
            entry.key = k
            entry.value = v
        return t
