"""Reading safetensors files: header validated first, tensors then viewed through a memory map;
and writing them with every tensor on a cache line (write_safetensors).

We parse the header ourselves (8-byte little-endian length, then a JSON object) because the
`safetensors` NumPy path copies every tensor and cannot express bfloat16 without ml_dtypes.
A memory map gives F32 weights with no second copy; F16/BF16 are widened to float32 by the caller.

The checks follow the reference parser: header at most 100,000,000 bytes and inside the file,
byte sizes computed with Python ints, offsets contiguous from 0 and ending exactly at the end.
"""

from __future__ import annotations

import json
import mmap
import os
from pathlib import Path

import numpy as np

from ..errors import CheckpointError
from ..memory import CACHE_LINE

MAX_HEADER_BYTES = 100_000_000

# safetensors dtype name -> NumPy dtype used to view the bytes (BF16 is viewed as raw uint16).
DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),
    "F64": np.dtype("<f8"),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


class TensorInfo:
    __slots__ = ("name", "dtype", "shape", "start", "end")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], start: int, end: int):
        self.name, self.dtype, self.shape, self.start, self.end = name, dtype, shape, start, end


def _reject_duplicates(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"duplicate key {key!r}")
        obj[key] = value
    return obj


def read_header(path: Path) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Parse and validate a safetensors header: ({name: TensorInfo}, metadata, data offset)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{path}: truncated safetensors file (no header length)")
            n = int.from_bytes(prefix, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(f"{path}: header length {n} exceeds the limit or the file size {size}")
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e}") from None
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicates)
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path}: header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map names to strings")

    data_start = 8 + n
    data_size = size - data_start
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: entry is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPES:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise CheckpointError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise CheckpointError(f"{where}: data_offsets must be two integers, got {offsets!r}")
        start, end = offsets
        nbytes = DTYPES[dtype].itemsize
        for d in shape:  # Python ints: no wrap-around however large the dims
            nbytes *= d
        if not 0 <= start <= end <= data_size or end - start != nbytes:
            raise CheckpointError(
                f"{where}: data_offsets {offsets} do not match shape {shape} x {dtype} inside {data_size} data bytes"
            )
        infos[name] = TensorInfo(name, dtype, tuple(shape), start, end)

    # Offsets must tile the data region exactly: sorted, contiguous from 0, ending at the file's end.
    position = 0
    for info in sorted(infos.values(), key=lambda i: (i.start, i.end)):
        if info.start != position:
            raise CheckpointError(f"{path}: tensor {info.name!r} starts at {info.start}, expected {position} (gap or overlap)")
        position = info.end
    if position != data_size:
        raise CheckpointError(f"{path}: tensors end at byte {position} of {data_size} data bytes (truncated or padded)")
    return infos, metadata, data_start


class SafetensorsFile:
    """A validated safetensors file whose tensors are read-only views of one memory map."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.tensors, self.metadata, data_start = read_header(self.path)
        self._data_start = data_start
        expected = max((info.end for info in self.tensors.values()), default=0)
        self._data = np.zeros(0, dtype=np.uint8)
        if self.path.stat().st_size > data_start:
            # Copy-on-write mapping: pages are shared with the page cache, arrays stay writeable
            # (one Numba specialisation for every weight), and nothing is ever written back.
            with open(self.path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            self._data = np.frombuffer(mapped, dtype=np.uint8, offset=data_start)
        if len(self._data) != expected:  # the file changed since its header was checked
            raise CheckpointError(f"{self.path}: file size changed while loading")

    def raw(self, name: str) -> np.ndarray:
        """The stored array, no copy (BF16 comes back as uint16 bit patterns)."""
        info = self.tensors[name]
        dtype = DTYPES[info.dtype]
        return self._data[info.start : info.end].view(dtype).reshape(info.shape)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) of a 1-D/2-D tensor as float32, read with pread (not through the map),
        so converting a large tensor touches no more memory than one chunk."""
        info = self.tensors[name]
        dtype = DTYPES[info.dtype]
        row = dtype.itemsize
        for d in info.shape[1:]:
            row *= d
        offset = self._data_start + info.start + start * row
        with open(self.path, "rb") as f:
            buf = os.pread(f.fileno(), (stop - start) * row, offset)
        if len(buf) != (stop - start) * row:
            raise CheckpointError(f"{self.path}: short read of tensor {name!r}")
        arr = np.frombuffer(buf, dtype=dtype).reshape((stop - start, *info.shape[1:]))
        return _widen(arr, info.dtype, self.path, name)

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32: a view when stored as F32, else widened (a new array)."""
        return _widen(self.raw(name), self.tensors[name].dtype, self.path, name)


def _widen(arr: np.ndarray, dtype: str, path: Path, name: str) -> np.ndarray:
    if dtype == "F32":
        return arr
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    if dtype in ("F16", "F64"):
        return arr.astype(np.float32)
    raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype}, not a float type")


def write_safetensors(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None,
                      dtypes: dict[str, str] | None = None) -> None:
    """Write `tensors` as a safetensors file whose tensor data start on 64-byte boundaries, so the
    loader runs them from the map in place (checkpoint.on_cache_lines copies misaligned ones).
    The header is padded with spaces, as the format allows, to put the data on a boundary;
    tensors whose size is a multiple of 64 bytes come first, in the given order, so each of them
    stays on one. The safetensors library pads to 8 bytes only. dtypes: a tensor's stored type
    where its array's does not say it (BF16, held as uint16 bits)."""
    names = {d: name for name, d in DTYPES.items() if name != "BF16"}  # BF16 is viewed as uint16
    order = sorted(tensors, key=lambda n: tensors[n].nbytes % CACHE_LINE != 0)  # stable: given order kept within each
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    position = 0
    for name in order:
        arr = tensors[name]
        if arr.dtype not in names:
            raise ValueError(f"{name}: dtype {arr.dtype} has no safetensors name here")
        header[name] = {"dtype": (dtypes or {}).get(name, names[arr.dtype]), "shape": list(arr.shape), "data_offsets": [position, position + arr.nbytes]}
        position += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-(8 + len(raw)) % CACHE_LINE)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name], dtype=tensors[name].dtype.newbyteorder("<")).data)  # no copy when contiguous
