// The output tensor of a GEMM kernel that can write into a caller's buffer (lane_quant_gemm, bf16_gemm).
#pragma once

#include <ATen/ATen.h>

namespace leanserve {

// The [M, N] float32 output of a kernel: out when given (checked: a contiguous CPU float32 tensor of that shape,
// e.g. a block of rows of a larger output that the caller fills in parts), else a new tensor.
inline at::Tensor output_rows(const c10::optional<at::Tensor>& out, int64_t M, int64_t N,
                              const at::TensorOptions& options) {
  if (!out.has_value()) return at::empty({M, N}, options);
  const at::Tensor& y = *out;
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N && y.scalar_type() == at::kFloat &&
              y.is_contiguous() && y.device().is_cpu(), "out must be a contiguous [", M, ", ", N, "] float32 tensor");
  return y;
}

}  // namespace leanserve
