// GGUF K-quant (Q4_K, Q6_K) matrices in their file bytes: y = x @ w.T with fp32 activations and output, and the
// dequantization. Block layouts and arithmetic are ggml's (ggml-common.h, ggml-quants.c dequantize_row_q4_K /
// dequantize_row_q6_K), 256 weights per super-block:
//   Q4_K (144 bytes): d fp16, dmin fp16, scales[12] (8 pairs of 6-bit scale / min), qs[128] (4-bit codes);
//                     w = d * sc_j * q - dmin * m_j for sub-block j of 32.
//   Q6_K (210 bytes): ql[128] (low 4 bits), qh[64] (high 2 bits), scales[16] int8, d fp16;
//                     w = d * sc_j * (q - 32) for sub-block j of 16.
// w: [N, K / 256 * type_size] uint8 (one row of the file per output). The GEMM dequantizes one super-block of a
// row into 256 floats on the stack (L1) and dots it with every activation row: weights are read once per call,
// at 4.5 / 6.56 bits each, instead of 32 for a dequantized fp32 matrix. Rows of w are shared out over the threads.
#include <torch/extension.h>

#include <cstring>

#include "spin_pool.h"

namespace {

constexpr int64_t QK = 256;

inline float fp16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

inline void scale_min_k4(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// One super-block -> 256 floats.
inline void dequant_q4_k(const uint8_t* b, float* y) {
  const float d = fp16(b), dmin = fp16(b + 2);
  const uint8_t* scales = b + 4;
  const uint8_t* q = b + 16;
  int is = 0;
  for (int j = 0; j < QK; j += 64) {
    uint8_t sc, m;
    scale_min_k4(is, scales, &sc, &m);
    const float d1 = d * sc, m1 = dmin * m;
    scale_min_k4(is + 1, scales, &sc, &m);
    const float d2 = d * sc, m2 = dmin * m;
    for (int l = 0; l < 32; ++l) y[l] = d1 * (q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) y[32 + l] = d2 * (q[l] >> 4) - m2;
    y += 64;
    q += 32;
    is += 2;
  }
}

inline void dequant_q6_k(const uint8_t* b, float* y) {
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = fp16(b + 208);
  for (int n = 0; n < QK; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = static_cast<int8_t>((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = static_cast<int8_t>((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = static_cast<int8_t>((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = static_cast<int8_t>((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * sc[is] * q1;
      y[l + 32] = d * sc[is + 2] * q2;
      y[l + 64] = d * sc[is + 4] * q3;
      y[l + 96] = d * sc[is + 6] * q4;
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

int64_t type_size(int64_t qtype) {
  TORCH_CHECK(qtype == 12 || qtype == 14, "K-quant type must be Q4_K (12) or Q6_K (14), got ", qtype);
  return qtype == 12 ? 144 : 210;
}

inline void dequant_block(int64_t qtype, const uint8_t* b, float* y) {
  if (qtype == 12) dequant_q4_k(b, y);
  else dequant_q6_k(b, y);
}

}  // namespace

// x [M, K] float32 contiguous; w [N, K / 256 * type_size] uint8; qtype: GGML type id (Q4_K = 12, Q6_K = 14).
// Returns [M, N] float32.
torch::Tensor kquant_gemm(torch::Tensor x, torch::Tensor w, int64_t qtype) {
  const int64_t ts = type_size(qtype);
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(), "x must be [M, K] float32");
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous(), "w must be [N, bytes] uint8");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(K % QK == 0 && w.size(1) == K / QK * ts, "w's row bytes do not match K = ", K);
  auto y = torch::zeros({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t nb = K / QK;
  leanserve::SpinPool::parallel_for(N, 16, [&](int64_t begin, int64_t end) {
    alignas(64) float buf[QK];
    std::vector<float> acc(M);
    for (int64_t n = begin; n < end; ++n) {
      std::fill(acc.begin(), acc.end(), 0.f);
      const uint8_t* row = wp + n * nb * ts;
      for (int64_t b = 0; b < nb; ++b) {
        dequant_block(qtype, row + b * ts, buf);
        for (int64_t m = 0; m < M; ++m) {
          const float* xr = xp + m * K + b * QK;
          float s = 0.f;
          for (int64_t i = 0; i < QK; ++i) s += buf[i] * xr[i];
          acc[m] += s;
        }
      }
      for (int64_t m = 0; m < M; ++m) yp[m * N + n] = acc[m];
    }
  });
  return y;
}

// w [N, K / 256 * type_size] uint8 -> [N, K] float32 (ggml's dequantization).
torch::Tensor kquant_dequantize(torch::Tensor w, int64_t qtype) {
  const int64_t ts = type_size(qtype);
  TORCH_CHECK(w.dtype() == torch::kUInt8 && w.dim() == 2 && w.is_contiguous() && w.size(1) % ts == 0,
              "w must be [N, blocks * type_size] uint8");
  const int64_t N = w.size(0), nb = w.size(1) / ts;
  auto y = torch::empty({N, nb * QK}, torch::dtype(torch::kFloat32));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  leanserve::SpinPool::parallel_for(N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t b = 0; b < nb; ++b) dequant_block(qtype, wp + (n * nb + b) * ts, yp + (n * nb + b) * QK);
  }, false);
  return y;
}
