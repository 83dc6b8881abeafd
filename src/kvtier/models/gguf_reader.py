"""A small, fast GGUF reader: scalar metadata, array lengths, and dequantized tensors.

Why not ``gguf.GGUFReader``: it parses every metadata array element by element, which for a 262K
token vocabulary (three arrays of that length) takes 30-50 s, and transformers' GGUF loader runs it
twice. Here arrays are skipped (only their length is kept) unless asked for, so the header of any
GGUF file reads in well under a second; tensor data is memory-mapped and dequantized with the
``gguf`` package's own numpy kernels (the same ones transformers uses).

Format (GGUF v2/v3, little-endian): magic ``GGUF``, version u32, tensor count u64, metadata count
u64; then metadata (key string, value type u32, value), then tensor infos (name string, n_dims u32,
dims u64 each -- innermost first --, ggml type u32, offset u64); tensor data starts at the next
multiple of ``general.alignment`` (default 32). Strings are a u64 byte count then UTF-8 bytes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order (outermost first): the reverse of the file's dims
    ggml_type: int
    offset: int  # absolute, in the file


@dataclass(frozen=True)
class ArrayInfo:
    """A metadata array that was not read: its element type and length."""

    element_type: int
    length: int

    def __len__(self) -> int:
        return self.length


class GgufFile:
    """The header of one GGUF file; :meth:`tensor` dequantizes one tensor on demand."""

    def __init__(self, path: str | Path, read_arrays: tuple[str, ...] = ()):
        self.path = Path(path)
        self.metadata: dict[str, object] = {}
        self.tensors: dict[str, TensorInfo] = {}
        with open(self.path, "rb") as f:
            self._f = f
            if f.read(4) != b"GGUF":
                raise ValueError(f"{self.path} is not a GGUF file")
            self.version = self._u32()
            if self.version not in (2, 3):
                raise ValueError(f"{self.path}: unsupported GGUF version {self.version}")
            tensor_count, kv_count = self._u64(), self._u64()
            for _ in range(kv_count):
                key = self._string()
                self.metadata[key] = self._value(self._u32(), keep=key in read_arrays)
            infos = []
            for _ in range(tensor_count):
                name = self._string()
                dims = [self._u64() for _ in range(self._u32())]
                infos.append((name, tuple(reversed(dims)), self._u32(), self._u64()))
            alignment = int(self.metadata.get("general.alignment", 32))
            data_start = -(-f.tell() // alignment) * alignment
        del self._f
        for name, shape, ggml_type, offset in infos:
            self.tensors[name] = TensorInfo(name, shape, ggml_type, data_start + offset)

    def tensor(self, name: str):
        """The tensor ``name`` as a float32 numpy array of its torch shape (dequantized if needed)."""
        import numpy as np
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        info = self.tensors[name]
        qtype = GGMLQuantizationType(info.ggml_type)
        block_size, type_size = GGML_QUANT_SIZES[qtype]
        count = 1
        for dim in info.shape:
            count *= dim
        row = info.shape[-1]
        if row % block_size:
            raise ValueError(f"{name}: row of {row} values is not whole {qtype.name} blocks")
        nbytes = count // block_size * type_size
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(nbytes,))
        values = dequantize(np.array(raw).reshape(count // row, row // block_size * type_size), qtype)
        return np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape)

    # -- parsing -----------------------------------------------------------------------------------
    def _u32(self) -> int:
        return struct.unpack("<I", self._f.read(4))[0]

    def _u64(self) -> int:
        return struct.unpack("<Q", self._f.read(8))[0]

    def _string(self) -> str:
        return self._f.read(self._u64()).decode("utf-8", errors="replace")

    def _value(self, value_type: int, keep: bool = True):
        if value_type in _SCALARS:
            fmt = _SCALARS[value_type]
            return struct.unpack(fmt, self._f.read(struct.calcsize(fmt)))[0]
        if value_type == _STRING:
            return self._string()
        if value_type == _ARRAY:
            element_type, length = self._u32(), self._u64()
            if keep:
                return [self._value(element_type) for _ in range(length)]
            if element_type in _SCALARS:
                self._f.seek(length * struct.calcsize(_SCALARS[element_type]), 1)
            else:  # strings (or nested arrays): walk them without decoding
                for _ in range(length):
                    self._value(element_type, keep=False)
            return ArrayInfo(element_type, length)
        raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
