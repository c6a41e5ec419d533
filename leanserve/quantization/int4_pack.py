"""torch's CPU int4 packed weight layout (``_convert_weight_to_int4pack_for_cpu``), and its inverse.

The layout, found by probing torch 2.13 and checked by ``tests/quantization/test_weights.py``: an ``[N, K]``
matrix of 4-bit codes becomes ``[N, K // 2]`` uint8, read as ``[N // B, K, B // 2]`` bytes: output rows are taken
in blocks of ``B``, and for each block and input column ``k`` ``B // 2`` bytes hold rows ``j`` (low nibble) and
``j + B // 2`` (high nibble). ``B`` follows the CPU path torch picked at start-up (four float vectors: 64 rows with
AVX-512, 32 with AVX2 or none), so :func:`block_rows` finds it by packing a probe once. A last block of fewer
than ``B`` rows uses a different interleave, so :func:`unpack_int4` needs ``N % B == 0`` (packing and the matmul
do not).
"""

from __future__ import annotations

import functools

import torch

_CANDIDATE_BLOCKS = (64, 32, 16)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack 4-bit codes [N, K] (any integer dtype, values 0..15) for ``_weight_int4pack_mm_for_cpu``.

    Returns:
        [N, K // 2] uint8.

    Raises:
        ValueError: K is odd or a code is outside 0..15.
    """
    if codes.shape[1] % 2:
        raise ValueError(f"int4 packing needs an even input width, got {codes.shape[1]}")
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) > 15):
        raise ValueError("int4 codes must lie in 0..15")
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)


def _unpack_blocks(packed: torch.Tensor, block: int) -> torch.Tensor:
    n, half_k = packed.shape
    k = 2 * half_k
    b = packed.reshape(n // block, k, block // 2)  # [blocks, K, B / 2]
    rows = torch.cat([b & 15, b >> 4], dim=2)  # [blocks, K, B]: row j of the block at [.., j]
    return rows.transpose(1, 2).reshape(n, k).contiguous()


@functools.cache
def block_rows() -> int:
    """Output rows per packed block in this process's torch int4 layout (64 with AVX-512, 32 with AVX2).

    Raises:
        RuntimeError: torch packs in none of the known interleaves (a torch change this module must follow).
    """
    n = max(_CANDIDATE_BLOCKS) * 2
    probe = torch.randint(0, 16, (n, 8), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    packed = pack_int4(probe)
    for block in _CANDIDATE_BLOCKS:
        if torch.equal(_unpack_blocks(packed, block), probe):
            return block
    raise RuntimeError(f"unknown torch int4 packed layout (torch {torch.__version__})")


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] uint8 (0..15) that :func:`pack_int4` packed into ``packed`` [N, K // 2] uint8.

    Raises:
        ValueError: N is not a multiple of :func:`block_rows` (the tail block's interleave is not decoded).
    """
    block = block_rows()
    if packed.shape[0] % block:
        raise ValueError(f"unpack_int4 needs a multiple of {block} rows, got {packed.shape[0]}")
    return _unpack_blocks(packed, block)
