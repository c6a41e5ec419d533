"""Zero-filled CPU tensors in their own anonymous memory mapping (the KV cache pools).

:func:`anonymous_zeros` maps ``nbytes`` (+ up to 2 MiB to align the start) with ``mmap(MAP_PRIVATE |
MAP_ANONYMOUS)``: the kernel guarantees the pages read as zero and maps them lazily, on first write, so a pool costs
no time and no resident memory until its blocks are used; ``madvise(MADV_HUGEPAGE)`` asks for transparent huge
pages (2 MiB, where the kernel has them: ``/sys/kernel/mm/transparent_hugepage/enabled`` "always" or "madvise"),
which cut the TLB misses of decode attention's scattered block reads. The mapping belongs to the tensor (through
``torch.frombuffer``'s reference to the ``mmap`` object) and is unmapped when the last tensor or view of it is
freed. Unlike ``calloc`` / ``numpy.zeros``, where the memory comes from does not depend on malloc's settings
(``MALLOC_MMAP_THRESHOLD_`` or ``mallopt``, :mod:`leanserve.worker.malloc_tuning`): on the heap calloc writes every
byte and gets no huge pages.
"""

from __future__ import annotations

import ctypes
import mmap

import torch

HUGE_PAGE = 2 << 20  # bytes: x86-64's and arm64's (4 KiB granule) transparent huge page


def anonymous_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An all-zero contiguous CPU tensor of ``shape`` and ``dtype`` in a fresh anonymous mapping whose first byte
    is 2 MiB aligned, with ``MADV_HUGEPAGE`` applied where the platform defines it (a no-op elsewhere).

    Raises:
        ValueError: a negative dimension. OSError: the mapping fails (out of address space or ``vm.max_map_count``).
    """
    if any(s < 0 for s in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    nbytes = dtype.itemsize
    for s in shape:
        nbytes *= s
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # mmap's length is rounded up to pages by the kernel; the slack lets the tensor start on a huge-page boundary
    # (untouched slack pages are never backed by memory)
    m = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
    address = ctypes.addressof(ctypes.c_char.from_buffer(m))  # the export ends with this temporary
    offset = -address % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            m.madvise(advice, offset, nbytes)
        except OSError:  # THP compiled out or disabled for this process: small pages, still correct
            pass
    flat = torch.frombuffer(m, dtype=torch.uint8, count=nbytes, offset=offset)  # holds a reference to m
    return flat.view(dtype).view(shape)


PAGE = 4096  # bytes: the smallest page size of the platforms served (x86-64, arm64 4 KiB granule)


def prefault(t: torch.Tensor) -> None:
    """Makes a contiguous CPU tensor's memory resident and writable now, its contents unchanged: every page's first
    byte is written back with its own value, so the kernel maps the page (a huge page where THP applies) at this
    call instead of at the tensor's first write. Not for a tensor another thread writes meanwhile (a byte written
    there between the read and the write-back would be lost). A tensor on another device: nothing is done.

    Raises:
        ValueError: a non-contiguous tensor."""
    if t.device.type != "cpu" or t.numel() == 0:
        return
    if not t.is_contiguous():
        raise ValueError("prefault needs a contiguous tensor")
    flat = t.view(-1).view(torch.uint8)
    for touched in (flat[::PAGE], flat[-1:]):  # one byte in each page, the last page's included
        touched.copy_(touched.clone())
