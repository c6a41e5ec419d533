// The decoder layers of a Llama-family model for a decode-only step on CPU, in one native call (leanserve's "fused
// decode"): per layer add+RMSNorm -> qkv (lane kernel) [+ bias] -> RoPE -> KV write (slot mapping) -> paged decode
// attention -> o -> add+RMSNorm -> gate_up -> SiLU(gate) * up -> down, then the final add+RMSNorm.
//
// It calls the very kernels of the per-op path (LlamaModel.forward in leanserve/model/llama.py): add_rms_norm_,
// lane_quant_gemm, rope_, paged_decode_attention and silu_mul (fused_ops.cpp), with the same shapes and
// in the same order, so its result is bitwise equal to that path's (tests/model/test_fused_decode.py asserts
// it). What it saves is the Python and torch dispatch between the ~12 kernels of each layer.
//
// DecodeLayers(layers, bits, final_norm, eps, num_heads, kv_heads, head_dim):
//   layers[l] = [input_norm [H], post_norm [H], qkv lanes, qkv dl, qkv ml, qkv bias ([Nqkv] or empty),
//                o lanes, o dl, o ml, gate_up lanes, gate_up dl, gate_up ml, down lanes, down dl, down ml]
//               (the lane layout of BlockQuantWeight: leanserve/quantization/weights.py; ml empty for 8-bit);
//   bits[l] = the bits (4 or 8) of qkv, o, gate_up, down.
// set_caches(k_caches, v_caches): per layer [num_blocks, block_size, kv_heads, head_dim] contiguous, all float32 or
//   all float16 (written as write_kv_ writes them: rounded to nearest even).
// forward(x, cos, sin, slot_mapping, block_table, seq_lens, scale) -> [M, H] float32, the final norm's output:
//   x [M, H] float32 contiguous, the embedded decode tokens (the residual stream, updated in place);
//   cos, sin [M, head_dim] float32; slot_mapping [M] int64; block_table [M, max_blocks] int64; seq_lens [M] int64
//   (as AttentionMetadata's single decode group); scale: the attention scale.
// set_profiling(on): when on, each forward that starts from then on adds its phases' wall time (steady_clock,
//   seconds) to per-phase totals; off by default (then no clock is read after the start). Call it and profile()
//   between forwards (a forward that is running keeps the setting it started with).
// profile() -> {phase: seconds} summed over the timed forwards since the last set_profiling(true), with "forwards" =
//   the number of those forward calls (a float).
// Errors: c10::Error (RuntimeError in Python) on a shape or dtype that does not match the layers.
#include <torch/extension.h>

#include "kv_write.h"

#include <array>
#include <atomic>
#include <chrono>
#include <cstring>
#include <map>
#include <string>
#include <vector>

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale);
torch::Tensor lane_quant_gemm(torch::Tensor x, torch::Tensor lanes, torch::Tensor dl, torch::Tensor ml,
                              int64_t bits, c10::optional<torch::Tensor> out = c10::nullopt);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor y, torch::Tensor w, double eps);
void rope_(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t q_heads, int64_t k_heads,
           int64_t head_dim);
torch::Tensor silu_mul(torch::Tensor gu);

namespace {

constexpr size_t kLayerTensors = 15;

// The phases of a layer, in order (the last one: the final norm after the layers).
enum Phase { kNorm, kQkv, kRope, kAttn, kO, kGateUp, kSilu, kDown, kFinal, kPhases };
constexpr std::array<const char*, kPhases> kPhaseNames = {
    "add+RMSNorm", "qkv GEMM", "bias, RoPE, KV write, q copy", "attention", "o GEMM", "gate_up GEMM",
    "SiLU(gate) * up", "down GEMM", "final add+RMSNorm"};

// Per-phase wall-time totals; lap(p) charges the time since the previous lap (or start) to phase p. Whether a forward
// is timed is read once, at its start (forward runs without the GIL: set_profiling may come from another thread
// while one runs; that forward keeps the state it started with).
class PhaseClock {
 public:
  std::atomic<bool> on{false};
  void reset() { totals_.fill(0.0), forwards_ = 0; }
  void start() {
    timing_ = on.load(std::memory_order_acquire);
    last_ = std::chrono::steady_clock::now();
    if (timing_) ++forwards_;
  }
  void lap(Phase p) {
    if (!timing_) return;
    const auto now = std::chrono::steady_clock::now();
    totals_[p] += std::chrono::duration<double>(now - last_).count();
    last_ = now;
  }
  std::map<std::string, double> totals() const {
    std::map<std::string, double> out;
    for (int p = 0; p < kPhases; ++p) out[kPhaseNames[p]] = totals_[p];
    out["forwards"] = static_cast<double>(forwards_);
    return out;
  }

 private:
  std::array<double, kPhases> totals_{};
  int64_t forwards_ = 0;
  bool timing_ = false;  // this forward's snapshot of on
  std::chrono::steady_clock::time_point last_;
};

class DecodeLayers {
 public:
  DecodeLayers(std::vector<std::vector<torch::Tensor>> layers, std::vector<std::vector<int64_t>> bits,
               torch::Tensor final_norm, double eps, int64_t num_heads, int64_t kv_heads, int64_t head_dim)
      : layers_(std::move(layers)), bits_(std::move(bits)), final_norm_(std::move(final_norm)), eps_(eps),
        num_heads_(num_heads), kv_heads_(kv_heads), head_dim_(head_dim) {
    TORCH_CHECK(layers_.size() == bits_.size(), "one bits list per layer");
    for (size_t l = 0; l < layers_.size(); ++l) {
      TORCH_CHECK(layers_[l].size() == kLayerTensors, "a layer needs 15 tensors, got ", layers_[l].size());
      TORCH_CHECK(bits_[l].size() == 4, "a layer needs 4 bit widths");
    }
    TORCH_CHECK(num_heads > 0 && kv_heads > 0 && num_heads % kv_heads == 0 && head_dim > 0, "bad head counts");
  }

  void set_caches(std::vector<torch::Tensor> k_caches, std::vector<torch::Tensor> v_caches) {
    TORCH_CHECK(k_caches.size() == layers_.size() && v_caches.size() == layers_.size(), "one cache per layer");
    const auto dtype = k_caches.empty() ? torch::kFloat32 : k_caches[0].scalar_type();
    for (size_t l = 0; l < k_caches.size(); ++l) {
      for (const auto* c : {&k_caches[l], &v_caches[l]}) {
        TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kFloat16) && c->scalar_type() == dtype &&
                    c->is_contiguous() && c->dim() == 4 && c->size(2) == kv_heads_ && c->size(3) == head_dim_,
                    "KV caches must be [blocks, block_size, kv_heads, head_dim] contiguous, all float32 or all "
                    "float16");
      }
    }
    k_caches_ = std::move(k_caches);
    v_caches_ = std::move(v_caches);
  }

  torch::Tensor forward(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                        torch::Tensor block_table, torch::Tensor seq_lens, double scale) {
    TORCH_CHECK(k_caches_.size() == layers_.size(), "set_caches first");
    TORCH_CHECK(x.dim() == 2 && x.dtype() == torch::kFloat32 && x.is_contiguous(), "x must be [M, H] float32");
    const int64_t M = x.size(0), D = head_dim_, q_size = num_heads_ * D, kv_size = kv_heads_ * D;
    TORCH_CHECK(slot_mapping.dtype() == torch::kInt64 && slot_mapping.numel() == M, "slot_mapping must be [M] int64");
    auto slots_c = slot_mapping.contiguous();
    const int64_t* slots = slots_c.data_ptr<int64_t>();
    const torch::Tensor none;  // "no residual to add"
    const auto empty = torch::empty({0}, x.options());
    torch::Tensor pending = empty;
    clock_.start();
    for (size_t l = 0; l < layers_.size(); ++l) {
      const auto& w = layers_[l];
      const auto& b = bits_[l];
      auto h = add_rms_norm_(x, pending, w[0], eps_);
      clock_.lap(kNorm);
      auto qkv = lane_quant_gemm(h, w[2], w[3], w[4], b[0]);  // [M, q_size + 2 kv_size]
      clock_.lap(kQkv);
      if (w[5].numel() > 0) qkv = qkv + w[5];
      TORCH_CHECK(qkv.size(1) == q_size + 2 * kv_size, "qkv width does not match the heads");
      rope_(qkv, cos, sin, num_heads_, kv_heads_, D);
      const int64_t slots_total = k_caches_[l].size(0) * k_caches_[l].size(1);
      const float* qp = qkv.data_ptr<float>();
      const int64_t row = qkv.size(1);
      // the KV write (kv_write.h, shared with write_kv_): index_copy_ of the k and v columns through the slots
      if (k_caches_[l].scalar_type() == torch::kFloat16)
        leanserve::write_kv_rows(qp + q_size, qp + q_size + kv_size, row, D, row, D, slots, M, kv_heads_, D,
                                 k_caches_[l].data_ptr<at::Half>(), v_caches_[l].data_ptr<at::Half>(), slots_total);
      else
        leanserve::write_kv_rows(qp + q_size, qp + q_size + kv_size, row, D, row, D, slots, M, kv_heads_, D,
                                 k_caches_[l].data_ptr<float>(), v_caches_[l].data_ptr<float>(), slots_total);
      auto q = qkv.narrow(1, 0, q_size).contiguous().view({M, num_heads_, D});
      clock_.lap(kRope);
      auto attn = paged_decode_attention(q, k_caches_[l], v_caches_[l], block_table, seq_lens, scale);
      clock_.lap(kAttn);
      auto o = lane_quant_gemm(attn.view({M, q_size}), w[6], w[7], w[8], b[1]);
      clock_.lap(kO);
      h = add_rms_norm_(x, o, w[1], eps_);
      clock_.lap(kNorm);
      auto gu = lane_quant_gemm(h, w[9], w[10], w[11], b[2]);  // [M, 2 I]
      clock_.lap(kGateUp);
      auto act = silu_mul(gu);
      clock_.lap(kSilu);
      pending = lane_quant_gemm(act, w[12], w[13], w[14], b[3]);
      clock_.lap(kDown);
    }
    auto out = add_rms_norm_(x, pending, final_norm_, eps_);
    clock_.lap(kFinal);
    return out;
  }

  void set_profiling(bool on) {
    if (on) clock_.reset();
    clock_.on.store(on, std::memory_order_release);
  }
  std::map<std::string, double> profile() const { return clock_.totals(); }

 private:
  std::vector<std::vector<torch::Tensor>> layers_;
  std::vector<std::vector<int64_t>> bits_;
  torch::Tensor final_norm_;
  double eps_;
  int64_t num_heads_, kv_heads_, head_dim_;
  std::vector<torch::Tensor> k_caches_, v_caches_;
  PhaseClock clock_;
};

}  // namespace

void bind_decode_layers(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeLayers>(m, "DecodeLayers", "a Llama model's decoder layers for decode steps, in one call")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<int64_t>>, torch::Tensor,
                    double, int64_t, int64_t, int64_t>())
      .def("set_caches", &DecodeLayers::set_caches)
      .def("set_profiling", &DecodeLayers::set_profiling)
      .def("profile", &DecodeLayers::profile)
      .def("forward", &DecodeLayers::forward, py::call_guard<py::gil_scoped_release>());
}
