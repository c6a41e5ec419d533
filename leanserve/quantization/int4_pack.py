"""torch's CPU int4 packed weight layout (``_convert_weight_to_int4pack_for_cpu``), and its inverse.

The layout, found by probing torch 2.13 and checked by ``tests/quantization/test_int4_pack.py``: an ``[N, K]``
matrix of 4-bit codes becomes ``[N, K // 2]`` uint8, read as ``[N // 64, K, 32]`` bytes: output rows are taken in
blocks of 64, and for each block and input column ``k`` 32 bytes hold rows ``j`` (low nibble) and ``j + 32``
(high nibble), ``j`` in 0..31. A last block of fewer than 64 rows uses a different interleave, so
:func:`unpack_int4` needs ``N % 64 == 0`` (packing and the matmul do not).
"""

from __future__ import annotations

import torch

BLOCK_N = 64  # output rows per packed block


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


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The codes [N, K] uint8 (0..15) that :func:`pack_int4` packed into ``packed`` [N, K // 2] uint8.

    Raises:
        ValueError: N is not a multiple of 64 (the tail block's interleave is not decoded).
    """
    n, half_k = packed.shape
    if n % BLOCK_N:
        raise ValueError(f"unpack_int4 needs a multiple of {BLOCK_N} rows, got {n}")
    k = 2 * half_k
    b = packed.reshape(n // BLOCK_N, k, BLOCK_N // 2)  # [blocks, K, 32]
    lo, hi = b & 15, b >> 4
    rows = torch.cat([lo, hi], dim=2)  # [blocks, K, 64]: row j of the block at [.., j]
    return rows.transpose(1, 2).reshape(n, k).contiguous()
