"""Writing small GGUF files with gguf-py's own writer, for the loader tests."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import gguf
import numpy as np

# Byte offsets of the float16 scales inside one block, for the types gguf-py cannot quantize.
F16_FIELDS = {
    gguf.GGMLQuantizationType.Q2_K: (80, 82),
    gguf.GGMLQuantizationType.Q3_K: (108,),
    gguf.GGMLQuantizationType.Q4_K: (0, 2),
    gguf.GGMLQuantizationType.Q5_K: (0, 2),
    gguf.GGMLQuantizationType.Q6_K: (208,),
}


def random_blocks(qtype: gguf.GGMLQuantizationType, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Random raw bytes of a ``qtype`` tensor of (element) ``shape``; its f16 scales are finite, in ±0.5."""
    rng = np.random.default_rng(seed)
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for offset in F16_FIELDS.get(qtype, ()):
        scales = rng.uniform(-0.5, 0.5, size=n_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def write_gguf_file(
    path: Path,
    arch: str,
    tensors: Iterable[tuple[str, np.ndarray, gguf.GGMLQuantizationType | None]],
    metadata: Callable[[gguf.GGUFWriter], None] | None = None,
) -> str:
    """Write a GGUF file: ``tensors`` are (name, array, raw type); a uint8 array with a raw type is taken as
    that type's bytes, a float array with None is stored as its own dtype (F32/F16)."""
    writer = gguf.GGUFWriter(str(path), arch)
    if metadata is not None:
        metadata(writer)
    for name, array, qtype in tensors:
        writer.add_tensor(name, array, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def gpt2_vocab() -> tuple[list[str], list[int], list[str]]:
    """A tiny byte-level BPE vocabulary: (tokens, token types, merges); ids 0-2 are control tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = [bytes_to_unicode()[b] for b in range(256)]
    words = ["Ġt", "he", "Ġthe", "Ġh", "Ġhe"]
    merges = ["Ġ t", "h e", "Ġt he", "Ġ h", "Ġh e"]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + byte_chars + words
    return tokens, [3, 3, 3] + [1] * (256 + len(words)), merges
