"""Dequantization of every supported GGUF tensor type, checked bit-exactly against gguf-py's reference."""

from __future__ import annotations

from leanserve.errors import UnsupportedTensorTypeError
from leanserve.loader import gguf_tensors
from leanserve.loader.gguf_tensors import SUPPORTED_TYPES, open_gguf, read_gguf_tensors

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf_helpers import random_blocks

QUANTIZABLE = (QT.BF16, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0)  # gguf-py can quantize these
K_QUANTS = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)  # random blocks instead


def _tensors_of_every_type() -> list[tuple[str, np.ndarray, QT | None]]:
    rng = np.random.default_rng(1)
    tensors: list[tuple[str, np.ndarray, QT | None]] = [
        ("f32", rng.standard_normal((3, 40)).astype(np.float32), None),
        ("f16_3d", rng.standard_normal((2, 3, 32)).astype(np.float16), None),
        ("vec_f32", rng.standard_normal(24).astype(np.float32), None),
    ]
    for qtype in QUANTIZABLE:
        values = rng.standard_normal((6, 96)).astype(np.float32)
        tensors.append((qtype.name.lower(), gguf.quants.quantize(values, qtype), qtype))
    for seed, qtype in enumerate(K_QUANTS):
        tensors.append((qtype.name.lower(), random_blocks(qtype, (5, 512), seed), qtype))
    return tensors


def test_supported_types_are_exactly_the_documented_ones():
    names = {t.name for t in SUPPORTED_TYPES}
    assert names == {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                     "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.parametrize("chunk", [1 << 16, 4])  # 4: many chunks and a partial last one
def test_every_supported_type_matches_gguf_reference(write_gguf, monkeypatch, chunk):
    monkeypatch.setattr(gguf_tensors, "_BLOCKS_PER_CHUNK", chunk)
    path = write_gguf("types.gguf", "llama", _tensors_of_every_type())
    ours = read_gguf_tensors(path)
    reader = gguf.GGUFReader(path)  # the stock reader, for an independent reference
    assert {t.tensor_type for t in reader.tensors} == SUPPORTED_TYPES
    assert set(ours) == {t.name for t in reader.tensors}
    for tensor in reader.tensors:
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        got = ours[tensor.name]
        assert np.isfinite(expected).all(), tensor.name
        assert got.dtype == np.float32 and got.flags.c_contiguous and got.flags.writeable
        assert got.shape == tuple(reversed(tensor.shape.tolist())), tensor.name
        np.testing.assert_array_equal(got, expected.reshape(got.shape), err_msg=tensor.name)


def test_dequantized_values_are_close_to_the_quantized_input(write_gguf):
    # Guards the reference itself: Q8_0 of N(0,1) data is accurate to ~1%.
    values = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    path = write_gguf("q8.gguf", "llama", [("w", gguf.quants.quantize(values, QT.Q8_0), QT.Q8_0)])
    got = read_gguf_tensors(path)["w"]
    assert got.shape == (4, 64)
    np.testing.assert_allclose(got, values, atol=0.03)


def test_f32_is_copied_out_of_the_file_map(write_gguf):
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = write_gguf("f32.gguf", "llama", [("w", values, None)])
    got = read_gguf_tensors(path)["w"]
    got += 1  # writable, and independent of the read-only memory map
    np.testing.assert_array_equal(read_gguf_tensors(path)["w"], values)


@pytest.mark.parametrize(
    "name, array, qtype",
    [
        ("blk.0.tq1", gguf.quants.quantize(np.ones((2, 256), np.float32), QT.TQ1_0), QT.TQ1_0),
        ("blk.0.iq2", random_blocks(QT.IQ2_XXS, (2, 256)), QT.IQ2_XXS),
        ("blk.0.q8_1", np.zeros((2, 2 * 40), np.uint8), QT.Q8_1),
        ("blk.0.f64", np.ones((2, 4), np.float64), None),
        ("blk.0.i32", np.ones((2, 4), np.int32), None),
    ],
)
def test_unsupported_type_is_rejected_before_any_dequantization(write_gguf, monkeypatch, name, array, qtype):
    type_name = qtype.name if qtype is not None else {np.float64: "F64", np.int32: "I32"}[array.dtype.type]
    ok = np.zeros((2, 32), np.float32)
    path = write_gguf("bad.gguf", "llama", [("ok", ok, None), (name, array, qtype)])
    calls = []
    monkeypatch.setattr(gguf_tensors, "dequantize_tensor", lambda t: calls.append(t.name))
    with pytest.raises(UnsupportedTensorTypeError) as info:
        read_gguf_tensors(path)
    assert name in str(info.value) and type_name in str(info.value)
    assert calls == []  # the check ran before the supported "ok" tensor was touched


def test_fast_reader_parses_like_the_stock_reader(write_gguf):
    def metadata(w: gguf.GGUFWriter) -> None:
        w.add_token_list(["a", "bc", "<|x|>", "你好"])
        w.add_token_types([1, 1, 3, 1])
        w.add_token_scores([0.0, -1.5, 2.0, 3.25])
        w.add_uint32("u", 7)
        w.add_float32("f", 1e-5)
        w.add_bool("b", True)
        w.add_string("s", "text")
        w.add_array("ints", [1, 2, 3])
        w.add_array("no_strings", [])
        w.add_array("one_string", [""])

    path = write_gguf("meta.gguf", "llama", _tensors_of_every_type(), metadata)
    fast, stock = open_gguf(path), gguf.GGUFReader(path)
    assert type(fast) is not gguf.GGUFReader  # really the fast subclass
    assert list(fast.fields) == list(stock.fields)
    for key, f in stock.fields.items():
        assert fast.fields[key].types == f.types, key
        assert fast.fields[key].contents() == f.contents(), key
        assert fast.fields[key].data == f.data, key  # the same parts, as the stock reader lays them out
        assert [(p.dtype, p.tolist()) for p in fast.fields[key].parts] == [(p.dtype, p.tolist()) for p in f.parts]
    assert fast.data_offset == stock.data_offset
    for a, b in zip(fast.tensors, stock.tensors, strict=True):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert a.shape.tolist() == b.shape.tolist()
        np.testing.assert_array_equal(a.data, b.data)
