"""Reading GGUF files: a faster ``gguf.GGUFReader``, metadata access and tensor dequantization.

Nothing here knows about model architectures; :mod:`leanserve.loader.gguf_loader` builds on it.
"""

from __future__ import annotations

import os
from typing import Any

from leanserve.errors import ModelLoadError, UnsupportedTensorTypeError

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

# The tensor types leanserve dequantizes (all through gguf-py's reference numpy code).
SUPPORTED_TYPES: frozenset[QT] = frozenset(
    {
        QT.F32,
        QT.F16,
        QT.BF16,
        QT.Q4_0,
        QT.Q4_1,
        QT.Q5_0,
        QT.Q5_1,
        QT.Q8_0,
        QT.Q2_K,
        QT.Q3_K,
        QT.Q4_K,
        QT.Q5_K,
        QT.Q6_K,
    }
)

_BLOCKS_PER_CHUNK = 1 << 16  # quant blocks dequantized per numpy call: bounds the temporaries (~8-16 MB)


class _FastGGUFReader(gguf.GGUFReader):
    """``gguf.GGUFReader`` slicing a plain ``ndarray`` view of its memory map instead of the ``np.memmap``.

    The stock reader makes a few views per metadata element, and every ``np.memmap`` view pays for
    ``memmap.__array_finalize__``, which dominates the load of a large vocabulary. The
    parsing is the reader's own (only its ``_get`` primitive is replaced), so fields and tensors are the
    same -- ``tests/loader/test_gguf_dequant.py`` checks that against the stock reader. Tensor ``data`` are
    read-only views of the file map.
    """

    def _plain_view(self) -> np.ndarray:
        """The file map as a plain ndarray (made once)."""
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        return plain

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        plain = self._plain_view()
        dt = np.dtype(dtype)
        count = int(count)
        arr = plain[offset : offset + dt.itemsize * count].view(dt)[:count]
        return arr.view(dt.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        """The stock parse, with arrays of strings and of scalars parsed in one pass instead of one recursive call
        per element (a 49k-token vocabulary is ~150k elements: ~1.2 s in the stock reader). The parts and data
        indexes are those the stock reader builds: [item type, length, then per element its parts]."""
        if gguf.GGUFValueType(raw_type) != gguf.GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, n = gguf.GGUFValueType(int(raw_itype[0])), int(alen[0])
        offs = orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        if itype == gguf.GGUFValueType.STRING:
            plain = self._plain_view()
            len_dt = np.dtype(np.uint64).newbyteorder(self.byte_order)
            for _ in range(n):
                slen_part = plain[offs:offs + 8].view(len_dt)
                slen = int(slen_part[0])
                parts.append(slen_part)
                parts.append(plain[offs + 8:offs + 8 + slen])
                offs += 8 + slen
            types = [gguf.GGUFValueType.ARRAY, itype] if n else [gguf.GGUFValueType.ARRAY]
            return offs - orig_offs, parts, list(range(3, 3 + 2 * n, 2)), types
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is None:  # nested arrays: the stock recursion
            return super()._get_field_parts(orig_offs, raw_type)
        values = self._get(offs, nptype, n)
        parts += [values[i:i + 1] for i in range(n)]
        types = [gguf.GGUFValueType.ARRAY, itype] if n else [gguf.GGUFValueType.ARRAY]
        return 12 + int(values.nbytes), parts, list(range(2, 2 + n)), types


def open_gguf(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """Open a GGUF file memory-mapped and parse its metadata and tensor index (no tensor data is read).

    Raises:
        ModelLoadError: the file is missing or is not a readable GGUF file.
    """
    try:
        return _FastGGUFReader(path, "r")
    except FileNotFoundError as exc:
        raise ModelLoadError(f"GGUF file not found: {path}") from exc
    except (ValueError, KeyError, IndexError, OSError) as exc:
        raise ModelLoadError(f"{path} is not a readable GGUF file: {exc}") from exc


def field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    """The value of metadata ``key``: ``int``/``float``/``bool``/``str``, or a ``list`` for arrays;
    ``default`` when the key is absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    if isinstance(value, np.generic):
        value = value.item()
    return value


def check_tensor_types(reader: gguf.GGUFReader) -> None:
    """Fail fast, before any dequantization, if a tensor of the file has a type outside ``SUPPORTED_TYPES``.

    Raises:
        UnsupportedTensorTypeError: naming the first such tensor and its GGML type name (e.g. ``IQ2_XXS``).
    """
    for tensor in reader.tensors:
        if tensor.tensor_type not in SUPPORTED_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
            raise UnsupportedTensorTypeError(
                f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which leanserve cannot "
                f"dequantize (supported: {supported})"
            )


def tensor_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """The numpy (row-major) shape of a GGUF tensor: its GGUF dims (``ne0`` = contiguous first) reversed.

    For a linear weight this is the HF ``[out_features, in_features]``.
    """
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def dequantize_tensor(tensor: gguf.ReaderTensor) -> np.ndarray:
    """Dequantize a GGUF tensor to a new, writable, C-contiguous float32 array of ``tensor_shape(tensor)``.

    The values are bit-identical to ``gguf.quants.dequantize(tensor.data, tensor.tensor_type)``; quantized
    types are done blockwise in chunks (one pass, bounded temporaries).

    Raises:
        UnsupportedTensorTypeError: the type is not in ``SUPPORTED_TYPES``.
        ModelLoadError: the tensor's data is truncated or its shape is inconsistent with its type.
    """
    qtype = tensor.tensor_type
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTensorTypeError(f"tensor {tensor.name!r} has unsupported type {qtype.name}")
    shape = tensor_shape(tensor)
    n_elems = int(np.prod(shape, dtype=np.int64))
    raw = np.asarray(tensor.data).reshape(-1)
    if qtype == QT.F32:
        out = np.array(raw.view(np.float32), dtype=np.float32, copy=True)
    elif qtype == QT.F16:
        out = raw.view(np.float16).astype(np.float32)
    else:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = raw.view(np.uint8)
        if n_elems % block_size or raw.size * block_size != n_elems * type_size:
            raise ModelLoadError(f"tensor {tensor.name!r}: {raw.size} bytes do not hold {shape} {qtype.name}")
        blocks = raw.reshape(-1, type_size)
        quant = getattr(gguf.quants, qtype.name)  # gguf-py's class for this type, e.g. gguf.quants.Q4_K
        out = np.empty((blocks.shape[0], block_size), dtype=np.float32)
        for start in range(0, blocks.shape[0], _BLOCKS_PER_CHUNK):
            stop = start + _BLOCKS_PER_CHUNK
            out[start:stop] = quant.dequantize_blocks(blocks[start:stop])
    if out.size != n_elems:
        raise ModelLoadError(
            f"tensor {tensor.name!r}: data holds {out.size} values, shape {shape} needs {n_elems}"
        )
    return out.reshape(shape)


def read_gguf_tensors(path_or_reader: str | os.PathLike[str] | gguf.GGUFReader) -> dict[str, np.ndarray]:
    """Every tensor of a GGUF file by GGUF name, dequantized to ``float32`` (see :func:`dequantize_tensor`).

    No renaming or re-layout is done: shapes are the GGUF dims reversed.

    Raises:
        UnsupportedTensorTypeError: a tensor's type is unsupported (checked before anything is dequantized).
        ModelLoadError: the file cannot be read.
    """
    reader = path_or_reader if isinstance(path_or_reader, gguf.GGUFReader) else open_gguf(path_or_reader)
    check_tensor_types(reader)
    return {tensor.name: dequantize_tensor(tensor) for tensor in reader.tensors}
