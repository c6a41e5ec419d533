"""The native paged prefill attention (leanserve/kernels/prefill_attention.cpp): close to float64 causal attention
(fp32 path within 1e-5, bf16 path within bf16's bounds), on random caches and on the model's own q/k/v; a query
row's result bitwise independent of its chunk (length, start), of the physical blocks and of stale cache contents;
bad input refused; paged_attention sends prefill chunks to it."""

from __future__ import annotations

import sys

import leanserve  # noqa: F401  (first: OpenMP wait policy)
from leanserve.kernels import native_ops
from leanserve.model.attention import AttentionMetadata, PrefillChunk, paged_attention
from leanserve.model.prefill_attention import PrefillAttentionKernel, amx_takes, prefill_attention_kernel

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import kernel_isa_paths, use_kernel_isa

pytestmark = pytest.mark.skipif(native_ops() is None, reason="the native kernels did not build")

FP32_ATOL = 1e-5  # fp32 path vs float64 (unit-normal data; measured ~1e-6)
# bf16 path: Q, K, V and P rounded to bf16 (unit roundoff 2**-9). Against float64 on the rounded Q, K, V only P's
# rounding remains: |error| <= 2**-9 * max|v| per output (a convex combination of rows of v with weights off by
# 2**-9 relative at most); against the exact float64 result on unit-normal data the scores' rounding adds ~1e-2.
BF16_P_BOUND = 2.0 ** -9
BF16_ATOL = 3e-2


@pytest.fixture(autouse=True, params=kernel_isa_paths())
def kernel_isa(request, monkeypatch):
    """Every test runs on each instruction-set path (the avx2 one has no AVX512_BF16: the fp32 path only)."""
    use_kernel_isa(request, monkeypatch, sys.modules[__name__])
    return request.param


def _bf16_engines() -> list[str]:
    """The bf16 path's engines this build and process can run: vdpbf16ps, the AMX program on emulated tiles, and
    on AMX hardware the tiles themselves."""
    ext = native_ops()
    if not ext.prefill_attention_bf16_simd():
        return []
    return ["avx512_bf16", "amx_emulated"] + (["amx"] if ext.amx_bf16_status() == "ready" else [])


# (use_bf16, engine) of each path a test runs on; a path this build or CPU lacks is skipped
PATHS = {"fp32": (False, "avx512_bf16"), "bf16": (True, "avx512_bf16"), "bf16-amx_emulated": (True, "amx_emulated"),
         "bf16-amx": (True, "amx")}


def _path(name: str) -> tuple[bool, str]:
    bf16, engine = PATHS[name]
    if bf16 and engine not in _bf16_engines():
        pytest.skip(f"no {engine} bf16 engine in this build or process")
    return bf16, engine


def _cache(num_blocks: int, bs: int, kvh: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(num_blocks, bs, kvh, d, generator=g), torch.randn(num_blocks, bs, kvh, d, generator=g))


def _reference(q, k_cache, v_cache, ids, ctx):
    """float64 causal attention of q [n, H, D] (row i at position ctx + i) over the blocks ``ids``."""
    n, _, d = q.shape
    kvh = k_cache.shape[2]
    keys = k_cache[ids].reshape(-1, kvh, d)[:ctx + n].double().transpose(0, 1)[None]
    values = v_cache[ids].reshape(-1, kvh, d)[:ctx + n].double().transpose(0, 1)[None]
    mask = torch.arange(ctx + n)[None] <= (ctx + torch.arange(n))[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], keys, values, attn_mask=mask,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.bfloat16().float()


@pytest.mark.parametrize("shape", [(16, 3, 3, 64), (32, 2, 4, 128), (16, 1, 2, 32)],
                         ids=["bs16-gqa3-d64", "bs32-gqa4-d128", "bs16-d32-scalar"])
@pytest.mark.parametrize("ctx,n", [(0, 1), (0, 45), (7, 33), (100, 256), (1000, 70)])
def test_matches_float64_attention(shape, ctx, n):
    bs, kvh, group, d = shape
    k_cache, v_cache = _cache(100, bs, kvh, d, seed=ctx + n)
    g = torch.Generator().manual_seed(1)
    ids = torch.randperm(100, generator=g)[:-(-(ctx + n) // bs)]  # scattered blocks
    q = torch.randn(n, kvh * group, d, generator=g)
    ext = native_ops()
    out = ext.paged_prefill_attention(q, k_cache, v_cache, ids, ctx, d ** -0.5, False)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert (out.double() - _reference(q, k_cache, v_cache, ids, ctx)).abs().max().item() <= FP32_ATOL
    for engine in _bf16_engines() if d in (64, 128) else []:
        out = ext.paged_prefill_attention(q, k_cache, v_cache, ids, ctx, d ** -0.5, True, engine=engine).double()
        assert (out - _reference(q, k_cache, v_cache, ids, ctx)).abs().max().item() <= BF16_ATOL, engine
        ref = _reference(_bf16(q), _bf16(k_cache), _bf16(v_cache), ids, ctx)
        vmax = v_cache[ids].abs().max().item()
        assert (out - ref).abs().max().item() <= BF16_P_BOUND * vmax, engine


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("path", list(PATHS))
def test_row_bitwise_independent_of_chunking(path, bs):
    """Also where the AMX path's key unit (64 keys) spans several cache blocks and a chunk starts inside one."""
    bf16, engine = _path(path)
    kvh, group, d, total = 3, 3, 64, 300
    k_cache, v_cache = _cache(60, bs, kvh, d, seed=3)
    g = torch.Generator().manual_seed(4)
    ids = torch.randperm(60, generator=g)[:-(-total // bs)]
    q = torch.randn(total, kvh * group, d, generator=g)

    def run(*args):
        return native_ops().paged_prefill_attention(*args, engine=engine)
    whole = run(q, k_cache, v_cache, ids, 0, d ** -0.5, bf16)
    for ctx, n in [(0, 9), (37, 263), (100, 8), (129, 171), (250, 1), (290, 10), (16, 16)]:
        stale_k, stale_v = k_cache.clone(), v_cache.clone()
        flat_k = stale_k[ids].reshape(-1, kvh, d)
        flat_k[ctx + n:] = 1e4  # slots past the chunk's end: another sequence's stale keys and values
        flat_v = stale_v[ids].reshape(-1, kvh, d)
        flat_v[ctx + n:] = -3e3
        stale_k[ids] = flat_k.view(-1, bs, kvh, d)
        stale_v[ids] = flat_v.view(-1, bs, kvh, d)
        part = run(q[ctx:ctx + n].contiguous(), stale_k, stale_v, ids, ctx, d ** -0.5, bf16)
        assert torch.equal(part, whole[ctx:ctx + n]), (ctx, n)
    # the same keys in other physical blocks (a prefix-cache hit reads the cached copy)
    moved_ids = torch.arange(60 - len(ids), 60)
    moved_k, moved_v = k_cache.clone(), v_cache.clone()
    moved_k[moved_ids], moved_v[moved_ids] = k_cache[ids], v_cache[ids]
    assert torch.equal(run(q[200:].contiguous(), moved_k, moved_v, moved_ids, 200, d ** -0.5, bf16), whole[200:])


@pytest.mark.parametrize("path", list(PATHS))
def test_strided_q_and_out_equal_the_contiguous_call(path):
    """q read in place from the fused qkv product's columns (rows at a stride), the result written into a slice of
    a larger tensor: bitwise the contiguous call's, nothing outside the slice touched; the wrapper copies a q whose
    heads are not contiguous and fills an ``out`` of any layout."""
    bf16, engine = _path(path)
    bs, kvh, group, d, ctx, n = 16, 3, 3, 64, 40, 50
    heads = kvh * group
    k_cache, v_cache = _cache(20, bs, kvh, d, seed=11)
    g = torch.Generator().manual_seed(12)
    ids = torch.randperm(20, generator=g)[:-(-(ctx + n) // bs)]
    qkv = torch.randn(n, (heads + 2 * kvh) * d, generator=g)
    q = qkv[:, :heads * d].view(n, heads, d)  # row stride (heads + 2 kvh) d
    assert not q.is_contiguous()
    ext = native_ops()
    want = ext.paged_prefill_attention(q.contiguous(), k_cache, v_cache, ids, ctx, d ** -0.5, bf16, engine=engine)
    assert torch.equal(ext.paged_prefill_attention(q, k_cache, v_cache, ids, ctx, d ** -0.5, bf16, engine=engine),
                       want)
    big = torch.full((n + 7, heads, d), 7.0)
    got = ext.paged_prefill_attention(q, k_cache, v_cache, ids, ctx, d ** -0.5, bf16, engine=engine,
                                      out=big[3:3 + n])
    assert got.data_ptr() == big[3].data_ptr() and torch.equal(big[3:3 + n], want)
    assert (big[:3] == 7).all() and (big[3 + n:] == 7).all()
    kernel = PrefillAttentionKernel(ext, bf16, engine)
    swapped = qkv[:, :heads * d].view(n, d, heads).transpose(1, 2)  # heads not contiguous: copied first
    assert torch.equal(kernel(swapped, k_cache, v_cache, ids, ctx, d ** -0.5),
                       ext.paged_prefill_attention(swapped.contiguous(), k_cache, v_cache, ids, ctx, d ** -0.5, bf16,
                                                   engine=engine))
    odd_out = torch.zeros(n, d, heads).transpose(1, 2)
    kernel(q, k_cache, v_cache, ids, ctx, d ** -0.5, out=odd_out)
    assert torch.equal(odd_out, want)
    with pytest.raises(RuntimeError, match="heads contiguous"):
        ext.paged_prefill_attention(swapped, k_cache, v_cache, ids, ctx, d ** -0.5, bf16, engine=engine)
    with pytest.raises(RuntimeError, match="out must be"):
        ext.paged_prefill_attention(q, k_cache, v_cache, ids, ctx, d ** -0.5, bf16, engine=engine,
                                    out=torch.empty(n, heads, 32))


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_float16_cache_equals_the_kernel_on_its_widened_values(bf16):
    """A float16 cache (benchmarks.throughput's, llama.cpp's default KV type): the blocks the chunk reads are
    widened to float32 and attended as an fp32 cache holding the same values, bitwise."""
    if bf16 and not native_ops().prefill_attention_bf16_simd():
        pytest.skip("no AVX512_BF16 path in this build")
    bs, kvh, group, d, ctx, n = 16, 3, 3, 64, 70, 45
    k_cache, v_cache = (c.half() for c in _cache(40, bs, kvh, d, seed=9))
    g = torch.Generator().manual_seed(10)
    ids = torch.randperm(40, generator=g)[:-(-(ctx + n) // bs) + 2]  # the table may run past the chunk
    q = torch.randn(n, kvh * group, d, generator=g)
    kernel = prefill_attention_kernel(native_ops(), d, bs, "bf16" if bf16 else "lane")
    out = kernel(q, k_cache, v_cache, ids, ctx, d ** -0.5)
    want = native_ops().paged_prefill_attention(q, k_cache.float(), v_cache.float(), ids, ctx, d ** -0.5, bf16)
    assert torch.equal(out, want)
    assert (out.double() - _reference(q, k_cache.float(), v_cache.float(), ids, ctx)).abs().max().item() <= (
        BF16_ATOL if bf16 else FP32_ATOL)


def test_model_qkv_close_to_float64(loaded):
    """The model's own queries and keys (RoPE applied, real softmax sharpness) from a forward of a long prompt."""
    from leanserve.model import llama
    from leanserve.model.llama import LlamaModel
    from leanserve.worker.model_runner import allocate_kv_cache

    model = LlamaModel(loaded.config, loaded.weights)
    bs = 16
    ids = loaded.tokenizer.encode("The history of the printing press begins in East Asia. " * 30)[:400]
    kv = allocate_kv_cache(model, -(-len(ids) // bs), bs)
    seen = []

    def capture(q, k, v, k_cache, v_cache, meta):
        out = paged_attention(q, k, v, k_cache, v_cache, meta)
        seen.append((q.clone(), k_cache, v_cache))
        return out

    n = len(ids)
    meta = AttentionMetadata(slot_mapping=torch.arange(n),
                             prefills=[PrefillChunk(0, n, 0, torch.arange(-(-n // bs)))])
    orig = llama.paged_attention
    llama.paged_attention = capture
    try:
        with torch.inference_mode():
            model.forward(torch.tensor(ids), torch.arange(n), kv, meta)
    finally:
        llama.paged_attention = orig
    assert len(seen) == loaded.config.num_layers
    ext = native_ops()
    block_ids = torch.arange(-(-n // bs))
    d = seen[0][0].shape[2]
    for layer in (0, len(seen) // 2, len(seen) - 1):
        q, k_cache, v_cache = seen[layer]
        ctx = 150  # a chunk after a context, as chunked prefill runs it
        ref = _reference(q[ctx:], k_cache, v_cache, block_ids, ctx)
        out = ext.paged_prefill_attention(q[ctx:].contiguous(), k_cache, v_cache, block_ids, ctx, d ** -0.5, False)
        scale = ref.abs().max().item()
        assert (out.double() - ref).abs().max().item() <= FP32_ATOL * max(1.0, scale)
        for engine in _bf16_engines():
            out = ext.paged_prefill_attention(q[ctx:].contiguous(), k_cache, v_cache, block_ids, ctx, d ** -0.5,
                                              True, engine=engine)
            ref16 = _reference(_bf16(q[ctx:]), _bf16(k_cache), _bf16(v_cache), block_ids, ctx)
            vmax = v_cache[block_ids].abs().max().item()
            assert (out.double() - ref16).abs().max().item() <= BF16_P_BOUND * vmax, engine


@pytest.mark.parametrize("shape", [(16, 3, 3, 64), (32, 2, 4, 128), (128, 1, 2, 64)], ids=["bs16", "bs32-d128",
                                                                                            "bs128"])
def test_amx_hardware_equals_its_emulation(shape):
    """On an AMX machine: the tiles against the same program on emulated tiles (which follow the Intel SDM's
    pseudocode of TDPBF16PS). The hardware rounds a tile's sums otherwise than the pseudocode (as in the bf16 GEMM,
    test_lane_dequant), which the softmax can amplify: both stay within the bf16 path's bound of the float64
    attention of the rounded operands, and nearly all outputs agree to 1e-5."""
    if "amx" not in _bf16_engines():
        pytest.skip(f"AMX tiles: {native_ops().amx_bf16_status()}")
    bs, kvh, group, d = shape
    k_cache, v_cache = _cache(80, bs, kvh, d, seed=21)
    g = torch.Generator().manual_seed(22)
    ctx, n = 300, 200
    ids = torch.randperm(80, generator=g)[:-(-(ctx + n) // bs)]
    q = torch.randn(n, kvh * group, d, generator=g)
    run = native_ops().paged_prefill_attention
    hw = run(q, k_cache, v_cache, ids, ctx, d ** -0.5, True, engine="amx").double()
    emu = run(q, k_cache, v_cache, ids, ctx, d ** -0.5, True, engine="amx_emulated").double()
    ref = _reference(_bf16(q), _bf16(k_cache), _bf16(v_cache), ids, ctx)
    vmax = v_cache[ids].abs().max().item()
    for out in (hw, emu):
        assert (out - ref).abs().max().item() <= BF16_P_BOUND * vmax
    diff = (hw - emu).abs()  # measured: median 7e-9, 0.1-0.4% of the outputs apart by more than 1e-5
    assert diff.median().item() <= 1e-6 and (diff > 1e-5).double().mean().item() <= 0.05


def test_bad_input_refused():
    ext = native_ops()
    k_cache, v_cache = _cache(4, 16, 1, 64, seed=5)
    q = torch.randn(20, 3, 64)
    with pytest.raises(RuntimeError, match="block table"):
        ext.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0]), 0, 0.125, False)
    with pytest.raises(RuntimeError, match="out of range"):
        ext.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 9]), 0, 0.125, False)
    with pytest.raises(RuntimeError, match="float32"):
        ext.paged_prefill_attention(q.double(), k_cache, v_cache, torch.tensor([0, 1]), 0, 0.125, False)
    with pytest.raises(RuntimeError, match="KVH dividing H"):
        ext.paged_prefill_attention(torch.randn(20, 3, 32), k_cache, v_cache, torch.tensor([0, 1]), 0, 0.125, False)
    if not ext.prefill_attention_bf16_simd():
        with pytest.raises(RuntimeError, match="AVX512_BF16"):
            ext.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 1]), 0, 0.125, True)
    with pytest.raises(RuntimeError, match="block_size and KVH > 0"):  # not a division by zero
        ext.paged_prefill_attention(q, torch.zeros(4, 16, 0, 64), torch.zeros(4, 16, 0, 64), torch.tensor([0, 1]), 0,
                                    0.125, False)
    with pytest.raises(RuntimeError, match="block_size and KVH > 0"):
        ext.paged_prefill_attention(torch.zeros(0, 3, 64), torch.zeros(4, 0, 1, 64), torch.zeros(4, 0, 1, 64),
                                    torch.tensor([0]), 0, 0.125, False)
    with pytest.raises(RuntimeError, match="block table"):  # context_len + n would overflow int64
        ext.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 1]), 2 ** 63 - 5, 0.125, False)
    with pytest.raises(RuntimeError, match="engine must be"):
        ext.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 1]), 0, 0.125, True, engine="tiles")
    if ext.amx_bf16_status() != "ready":
        with pytest.raises(RuntimeError, match="cannot run AMX"):
            ext.paged_prefill_attention(q, k_cache, v_cache, torch.tensor([0, 1]), 0, 0.125, True, engine="amx")


def test_float16_cache_bad_table_refused_as_the_kernel_does():
    """The wrapper gathers a float16 cache's blocks before the kernel sees the table: it raises the kernel's
    RuntimeError (not index_select's IndexError, not a message about the gathered table) and reads nothing."""
    kernel = PrefillAttentionKernel(native_ops(), False)
    k_cache, v_cache = (c.half() for c in _cache(4, 16, 1, 64, seed=5))
    q = torch.randn(20, 3, 64)
    for ids, msg in ((torch.tensor([0, -1]), "out of range"), (torch.tensor([0, 9]), "out of range"),
                     (torch.tensor([0]), "block table does not cover"),
                     (torch.tensor([0, 1], dtype=torch.int32), "int64 block ids")):
        with pytest.raises(RuntimeError, match=msg):
            kernel(q, k_cache, v_cache, ids, 0, 0.125)
    with pytest.raises(RuntimeError, match=r"q and out \[n, H, D\]"):
        kernel(q.reshape(20, 192), k_cache, v_cache, torch.tensor([0, 1]), 0, 0.125)
    out = kernel(q, k_cache, v_cache, torch.tensor([2, 1]), 0, 0.125)  # a good table still runs
    assert torch.equal(out, kernel(q, k_cache.float(), v_cache.float(), torch.tensor([2, 1]), 0, 0.125))


def test_selection_and_paged_attention_dispatch():
    ext = native_ops()
    assert prefill_attention_kernel(None, 64, 16, "bf16") is None
    assert prefill_attention_kernel(ext, 256, 16, "bf16") is None  # no SIMD path: the torch path is faster
    assert prefill_attention_kernel(ext, 64, 8, "lane") is None
    assert not prefill_attention_kernel(ext, 64, 16, "lane").bf16
    assert not prefill_attention_kernel(ext, 64, 16, "bf16x3").bf16
    assert prefill_attention_kernel(ext, 64, 16, "bf16").bf16 == ext.prefill_attention_bf16_simd()
    # the bf16 path follows the bf16 GEMM's engine onto AMX tiles; the fp32 path has no engine to choose
    on_amx = prefill_attention_kernel(ext, 64, 16, "bf16", "amx")
    assert on_amx.engine == ("amx" if ext.prefill_attention_bf16_simd() else "avx512_bf16")
    assert prefill_attention_kernel(ext, 64, 16, "bf16", "avx512_bf16").engine == "avx512_bf16"
    assert prefill_attention_kernel(ext, 64, 16, "lane", "amx").engine == "avx512_bf16"
    for bs in (48, 80, 144):  # block sizes the AMX path does not take run (and say) avx512_bf16
        assert prefill_attention_kernel(ext, 64, bs, "bf16", "amx").engine == "avx512_bf16"
    # the kernel's rule (a build without the bf16 path has no AMX path: no block size)
    takes = [True, True, False, True, True, True, False, False, False, False]
    assert [amx_takes(ext, bs) for bs in (16, 32, 48, 64, 96, 128, 144, 0, -16, 8)] == [
        t and bool(ext.prefill_attention_bf16_simd()) for t in takes]
    assert not amx_takes(None, 64)
    assert prefill_attention_kernel(ext, 64, 48, "bf16", "amx").describe() == (
        "native bf16 on avx512_bf16" if ext.prefill_attention_bf16_simd() else "native fp32")
    assert prefill_attention_kernel(ext, 64, 16, "lane", "amx").describe() == "native fp32"
    # a chunk of 20 tokens after 30 cached ones, through paged_attention: the kernel's result, the K/V written
    k_cache, v_cache = _cache(8, 16, 3, 64, seed=6)
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(20, 9, 64, generator=g), torch.randn(20, 3, 64, generator=g), torch.randn(20, 3, 64,
                                                                                                  generator=g)
    block_ids = torch.tensor([5, 2, 7, 0])
    slots = torch.tensor([int(block_ids[p // 16]) * 16 + p % 16 for p in range(30, 50)])
    kernel = prefill_attention_kernel(ext, 64, 16, "lane")
    meta = AttentionMetadata(slot_mapping=slots, prefills=[PrefillChunk(0, 20, 30, block_ids)], prefill_kernel=kernel)
    out = paged_attention(q, k, v, k_cache, v_cache, meta)
    assert torch.equal(k_cache.view(-1, 3, 64)[slots], k)
    assert torch.equal(out, ext.paged_prefill_attention(q, k_cache, v_cache, block_ids, 30, 0.125, False))
    assert (out.double() - _reference(q, k_cache, v_cache, block_ids, 30)).abs().max().item() <= FP32_ATOL
