"""The native KV write (``write_kv_``, leanserve/kernels/kv_write.cpp) against the torch path it replaces
(``index_copy_`` of ``k.to(cache dtype)``): bitwise the same cache on random slot mappings, float32 and float16
caches, strided k / v (the columns of the fused qkv product), special values; bad slots raise before writing; the
torch fallback (no native kernels, other devices) stores the same."""

from __future__ import annotations

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import native_ops
from leanserve.model import attention
from leanserve.model.attention import write_kv

import pytest
import torch

from tests.conftest import kernel_isa_paths, use_kernel_isa

BS, KVH, D, QH = 16, 3, 64, 9


@pytest.fixture(params=kernel_isa_paths())
def native(request, monkeypatch):
    """write_kv on each instruction-set path's native kernel."""
    use_kernel_isa(request, monkeypatch, attention)
    return attention.native_ops()


def _reference(k_cache, v_cache, k, v, slots) -> None:
    """The torch path write_kv had before the native call."""
    n, bs, h, d = k_cache.shape
    k_cache.view(n * bs, h, d).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(n * bs, h, d).index_copy_(0, slots, v.to(v_cache.dtype))


def _step(t: int, seed: int, special: bool = False):
    """k, v [t, KVH, D] as strided views of a fused qkv [t, (QH + 2 KVH) D] row (as LlamaModel.forward makes
    them), random normal values (with fp16 edge cases when ``special``)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (QH + 2 * KVH) * D, generator=g) * 3
    if special:  # fp16 overflow, subnormals, exact ties to even, signed zeros, infinities
        vals = torch.tensor([70000.0, -65520.0, 65504.0, 1e-6, -3e-8, 6e-5, 1 + 2 ** -11, 1 + 3 * 2 ** -11, -0.0,
                             float("inf"), float("-inf"), 2 ** -24 * 1.5, 2 ** -25])
        qkv.view(-1)[torch.randint(0, qkv.numel(), (400,), generator=g)] = vals[torch.randint(0, len(vals), (400,),
                                                                                             generator=g)]
    q_size, kv_size = QH * D, KVH * D
    _, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return k.view(t, KVH, D), v.view(t, KVH, D)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t", [1, 7, 300])
def test_native_write_equals_index_copy(native, cache_dtype, t) -> None:
    num_blocks = 40
    g = torch.Generator().manual_seed(t)
    slots = torch.randperm(num_blocks * BS, generator=g)[:t]
    for special in (False, True):
        k, v = _step(t, seed=t + special, special=special)
        assert t == 1 or not k.is_contiguous()
        ref_k = torch.randn(num_blocks, BS, KVH, D, generator=g).to(cache_dtype)  # old contents stay where not written
        ref_v = torch.randn(num_blocks, BS, KVH, D, generator=g).to(cache_dtype)
        got_k, got_v = ref_k.clone(), ref_v.clone()
        _reference(ref_k, ref_v, k, v, slots)
        native.write_kv_(k, v, got_k, got_v, slots)
        assert torch.equal(got_k.view(torch.int16 if cache_dtype == torch.float16 else torch.int32),
                           ref_k.view(torch.int16 if cache_dtype == torch.float16 else torch.int32))
        assert torch.equal(got_v.view(torch.uint8), ref_v.view(torch.uint8))
        # and write_kv picks it
        got_k2, got_v2 = got_k.clone().zero_(), got_v.clone().zero_()
        ref_k.zero_(), ref_v.zero_()
        _reference(ref_k, ref_v, k, v, slots)
        write_kv(got_k2, got_v2, k, v, slots)
        assert torch.equal(got_k2.view(torch.uint8), ref_k.view(torch.uint8))
        assert torch.equal(got_v2.view(torch.uint8), ref_v.view(torch.uint8))


def test_native_write_head_strided_and_nan(native) -> None:
    """Heads not adjacent within a token (a transposed view) and NaNs (which stay NaN)."""
    g = torch.Generator().manual_seed(3)
    k = torch.randn(KVH, 20, D, generator=g).transpose(0, 1)  # [20, KVH, D], stride(1) = 20 * D
    v = torch.randn(KVH, 20, D, generator=g).transpose(0, 1)
    k[4, 1, 7] = float("nan")
    slots = torch.randperm(8 * BS, generator=g)[:20]
    for dtype in (torch.float32, torch.float16):
        ref_k, ref_v = torch.zeros(8, BS, KVH, D, dtype=dtype), torch.zeros(8, BS, KVH, D, dtype=dtype)
        got_k, got_v = ref_k.clone(), ref_v.clone()
        _reference(ref_k, ref_v, k, v, slots)
        native.write_kv_(k, v, got_k, got_v, slots)
        assert torch.equal(got_v, ref_v)
        assert torch.equal(got_k.isnan(), ref_k.isnan()) and got_k.isnan().sum() == 1
        assert torch.equal(got_k.nan_to_num(0.0), ref_k.nan_to_num(0.0))


def test_native_write_bad_input_raises_and_writes_nothing(native) -> None:
    k, v = _step(5, seed=1)
    kc, vc = torch.zeros(2, BS, KVH, D), torch.zeros(2, BS, KVH, D)
    for bad in (torch.tensor([0, 1, 2, 3, 2 * BS]), torch.tensor([0, 1, -1, 3, 4])):
        with pytest.raises(RuntimeError, match="out of range"):
            native.write_kv_(k, v, kc, vc, bad)
        assert not kc.any() and not vc.any()
    with pytest.raises(RuntimeError, match="caches must be"):
        native.write_kv_(k, v, kc.to(torch.bfloat16), vc.to(torch.bfloat16), torch.arange(5))
    with pytest.raises(RuntimeError, match="k and v must be"):
        native.write_kv_(k.double(), v.double(), kc, vc, torch.arange(5))
    with pytest.raises(RuntimeError, match="slot_mapping"):
        native.write_kv_(k, v, kc, vc, torch.arange(4))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_torch_fallback_stores_the_same(monkeypatch, cache_dtype) -> None:
    """Without native kernels (and for dtypes the kernel does not take) write_kv keeps the index_copy_ path."""
    monkeypatch.setattr(attention, "native_ops", lambda: None)
    k, v = _step(33, seed=5, special=True)
    slots = torch.randperm(10 * BS, generator=torch.Generator().manual_seed(5))[:33]
    ref_k, ref_v = torch.zeros(10, BS, KVH, D, dtype=cache_dtype), torch.zeros(10, BS, KVH, D, dtype=cache_dtype)
    got_k, got_v = ref_k.clone(), ref_v.clone()
    _reference(ref_k, ref_v, k, v, slots)
    write_kv(got_k, got_v, k, v, slots)
    assert torch.equal(got_k.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), ref_v.view(torch.uint8))


def test_native_write_only_on_cpu_float_caches() -> None:
    """Other devices (CUDA; "meta" stands in where there is none) and dtypes take the torch path unchanged."""
    k, v = _step(4, seed=2)
    assert attention._native_kv_write(torch.zeros(2, BS, KVH, D, device="meta"), k, v) is None
    assert attention._native_kv_write(torch.zeros(2, BS, KVH, D, dtype=torch.bfloat16), k, v) is None
    assert attention._native_kv_write(torch.zeros(2, BS, KVH, D), k.double(), v.double()) is None
    if native_ops() is not None:
        assert attention._native_kv_write(torch.zeros(2, BS, KVH, D, dtype=torch.float16), k, v) is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_write_unchanged() -> None:
    k, v = (x.cuda() for x in _step(9, seed=4))
    slots = torch.randperm(4 * BS, generator=torch.Generator().manual_seed(4))[:9].cuda()
    for dtype in (torch.float32, torch.float16):
        ref_k, ref_v = (torch.zeros(4, BS, KVH, D, dtype=dtype, device="cuda") for _ in range(2))
        got_k, got_v = ref_k.clone(), ref_v.clone()
        _reference(ref_k, ref_v, k, v, slots)
        write_kv(got_k, got_v, k, v, slots)
        assert torch.equal(got_k, ref_k) and torch.equal(got_v, ref_v)
