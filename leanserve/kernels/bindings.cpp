// Python bindings of leanserve's CPU kernels: one extension module, so that all kernels share one thread pool
// (spin_pool.h). Each function is documented in its source file.
#include <torch/extension.h>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
torch::Tensor block_quant_gemm(torch::Tensor x, torch::Tensor codes, torch::Tensor d, torch::Tensor mn,
                               int64_t bits);
torch::Tensor lane_quant_gemm(torch::Tensor x, torch::Tensor lanes, torch::Tensor dl, torch::Tensor ml,
                              int64_t bits, c10::optional<torch::Tensor> out);
torch::Tensor lane_q8_gemm(torch::Tensor x, torch::Tensor lanes, torch::Tensor dl, torch::Tensor ml,
                           c10::optional<torch::Tensor> out);
std::string lane_q8_gemm_isa();
void set_lane_prefetch_hint(const std::string& hint);
std::string lane_prefetch_hint();
torch::Tensor block_dequantize(torch::Tensor codes, torch::Tensor d, torch::Tensor mn, int64_t bits,
                               torch::Tensor out_buf);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps);
torch::Tensor kquant_gemm(torch::Tensor x, torch::Tensor w, int64_t qtype);
torch::Tensor kquant_dequantize(torch::Tensor w, int64_t qtype);
torch::Tensor f32_small_gemm(torch::Tensor x, torch::Tensor w);
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t q_heads, int64_t k_heads,
           int64_t head_dim);
torch::Tensor silu_mul(torch::Tensor gu);
bool bf16_gemm_simd();
void lane_dequant_bf16(torch::Tensor lanes, torch::Tensor dl, torch::Tensor ml, int64_t bits, torch::Tensor hi,
                       torch::Tensor lo);
torch::Tensor bf16_gemm(torch::Tensor x, torch::Tensor hi, torch::Tensor lo, int64_t N, const std::string& engine,
                        c10::optional<torch::Tensor> out);
std::string amx_bf16_status();
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                      torch::Tensor block_ids, int64_t context_len, double scale, bool use_bf16,
                                      c10::optional<torch::Tensor> out, const std::string& engine);
bool prefill_attention_bf16_simd();
bool prefill_attention_amx_takes(int64_t block_size);
void write_kv_(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache,
               torch::Tensor slot_mapping);
torch::Tensor argmax_rows(torch::Tensor x);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> lane_gather_rows(torch::Tensor lanes, torch::Tensor dl,
                                                                         torch::Tensor ml, int64_t bits,
                                                                         torch::Tensor ids);
void bind_decode_layers(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU, float32)");
  m.def("block_quant_gemm", &block_quant_gemm, "x @ w.T for GGUF block-quantized w (Q4_1/Q4_0/Q8_0 layout)");
  m.def("lane_quant_gemm", &lane_quant_gemm, "x @ w.T for block-quantized w in lane layout (many rows), into out when "
        "given", pybind11::arg("x"), pybind11::arg("lanes"), pybind11::arg("dl"), pybind11::arg("ml"),
        pybind11::arg("bits"), pybind11::arg("out") = pybind11::none());
  m.def("lane_q8_gemm", &lane_q8_gemm, "x @ w.T for 4-bit w in lane layout with int8 activations (prefill rows), "
        "into out when given", pybind11::arg("x"), pybind11::arg("lanes"), pybind11::arg("dl"), pybind11::arg("ml"),
        pybind11::arg("out") = pybind11::none());
  m.def("set_lane_prefetch_hint", &set_lane_prefetch_hint, "the lane kernels' software prefetch hint, "
        "process-wide: t0 or nta");
  m.def("lane_prefetch_hint", &lane_prefetch_hint, "the lane kernels' software prefetch hint: t0 or nta");
  m.def("lane_q8_gemm_isa", &lane_q8_gemm_isa, "the instruction set of lane_q8_gemm in this build: avx512_vnni, "
        "avx_vnni, avx2 or scalar");
  m.def("block_dequantize", &block_dequantize, "w [N, K] float32 from GGUF block-quantized codes and scales");
  m.def("kquant_gemm", &kquant_gemm, "x @ w.T for a GGUF Q4_K / Q6_K matrix in its file bytes (float32)");
  m.def("f32_small_gemm", &f32_small_gemm, "x @ w.T for float32 x [T <= 8, K] and w [N, K]");
  m.def("kquant_dequantize", &kquant_dequantize, "w [N, K] float32 from GGUF Q4_K / Q6_K bytes");
  m.def("add_rms_norm_", &add_rms_norm_, "x += y in place, then RMSNorm(x) * w (float32)");
  m.def("rope_", &rope_, "rotary embedding in place on the q and k heads of a fused qkv row (float32)");
  m.def("silu_mul", &silu_mul, "SwiGLU's silu(gate) * up of a fused [T, 2 I] gate|up product (float32)");
  m.def("bf16_gemm_simd", &bf16_gemm_simd, "whether bf16_gemm / lane_dequant_bf16 use AVX512_BF16");
  m.def("lane_dequant_bf16", &lane_dequant_bf16, "lane-layout w into pair-packed bf16 hi (and lo) buffers");
  m.def("bf16_gemm", &bf16_gemm, "x @ w.T, w pair-packed bf16 (bf16x3 with lo), fp32 accumulation and output, on "
        "the avx512_bf16, amx or amx_emulated engine", pybind11::arg("x"), pybind11::arg("hi"), pybind11::arg("lo"),
        pybind11::arg("N"), pybind11::arg("engine") = "avx512_bf16", pybind11::arg("out") = pybind11::none());
  m.def("amx_bf16_status", &amx_bf16_status, "whether this process can run AMX bf16 tiles: ready, or why not "
        "(build, cpu, os, permission)");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal prefill attention of one chunk read in place from the paged KV cache (CPU, float32 or bf16 dots; "
        "bf16 on the avx512_bf16, amx or amx_emulated engine), into out when given", pybind11::arg("q"), pybind11::arg("k_cache"), pybind11::arg("v_cache"),
        pybind11::arg("block_ids"), pybind11::arg("context_len"), pybind11::arg("scale"), pybind11::arg("use_bf16"),
        pybind11::arg("out") = pybind11::none(), pybind11::arg("engine") = "avx512_bf16");
  m.def("prefill_attention_bf16_simd", &prefill_attention_bf16_simd,
        "whether paged_prefill_attention has its AVX512_BF16 path");
  m.def("prefill_attention_amx_takes", &prefill_attention_amx_takes,
        "whether paged_prefill_attention's AMX path takes this block size (others run avx512_bf16)");
  m.def("write_kv_", &write_kv_, "new K/V rows into the paged cache through the slot mapping (float32 or float16)");
  m.def("argmax_rows", &argmax_rows, "x.argmax(-1) of [n, m] float32 (first of ties, NaN the maximum)");
  m.def("lane_gather_rows", &lane_gather_rows, "rows of a lane-layout block-quantized weight in file layout: "
        "(codes, d, mn)");
  bind_decode_layers(m);
}
