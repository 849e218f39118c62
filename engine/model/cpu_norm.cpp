// RMSNorm of bfloat16 rows, bit for bit what transformers' chain gives: the norm of engine/model/cpu_norm.py.
//
// transformers (and RMSNorm in engine/model/transformer.py) normalise a bf16 row as
//   weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(bfloat16)
// which torch runs as a dozen operators: at one decode row each costs more in dispatch than in arithmetic. Here
// it is one call per layer norm, the same float32 operations in the same order:
// - the squares, each rounded to float32 (torch squares into a tensor before it sums: no fused multiply-add
//   here either, see the pragma below);
// - their sum in the order of torch's vectorized inner sum (aten/src/ATen/native/cpu/SumKernel.cpp) for
//   `width`-lane vectors, the width of torch's own float vectors on this CPU (16 under its AVX-512 kernels, 8
//   under AVX2 and its default ones): whole vectors summed as 4 interleaved streams of lane-wise partial sums in
//   a cascade of 4 levels of 2^max(4, ceil(log2(vectors / 4)) / 4) steps, the vectors left over added to the
//   first stream, the streams added in order, then the elements past the last whole vector in order from 0, and
//   the lanes of the first stream added to that one by one;
// - that sum divided by n, eps added (as float32), 1 / sqrt of it;
// - each x times it, rounded to bf16 to nearest even, and the weight times that, rounded again (a NaN comes out
//   as a quiet NaN: its bits are not torch's, which differ between its own vector and scalar conversions).
// cpu_norm.py checks this against torch's chain on random rows before a model uses it (and tests/engine/
// test_cpu_norm.py under both vector widths): where it differs, the model keeps torch's operators.
//
// Rows are split over torch's intra-op threads (a row's result does not depend on the split).
// Built by splitserve.engine.native, once per machine.

// The squares must be rounded before they are summed, as torch rounds them: no contraction into FMAs.
#pragma GCC optimize("fp-contract=off")

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float widen(uint16_t b) {
  const uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Round to nearest even, as torch converts float32 to bfloat16 (a NaN stays a quiet NaN).
inline uint16_t round_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

inline int64_t ceil_log2(int64_t x) {  // torch's utils::CeilLog2: 1 for x <= 2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = uint64_t(x) - 1; v != 0; v >>= 1) ++bits;
  return bits;
}

// sq[0, n) summed in the order of torch's vectorized inner sum with W-lane vectors (see the file's comment).
template <int W>
float sum_in_torch_order(const float* sq, int64_t n) {
  constexpr int64_t streams = 4, levels = 4;
  const int64_t vectors = n / W;
  const int64_t steps = vectors / streams;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(steps) / levels);
  const int64_t level_step = int64_t(1) << level_power;
  const int64_t level_mask = level_step - 1;
  float acc[levels][streams][W] = {};
  auto add_step = [&](int64_t i) {
    for (int64_t k = 0; k < streams; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += sq[(i * streams + k) * W + l];
  };
  int64_t i = 0;
  while (i + level_step <= steps) {
    for (int64_t j = 0; j < level_step; ++j, ++i) add_step(i);
    for (int64_t level = 1; level < levels; ++level) {
      for (int64_t k = 0; k < streams; ++k)
        for (int l = 0; l < W; ++l) {
          acc[level][k][l] += acc[level - 1][k][l];
          acc[level - 1][k][l] = 0.f;
        }
      if ((i & (level_mask << (level * level_power))) != 0) break;
    }
  }
  for (; i < steps; ++i) add_step(i);
  for (int64_t level = 1; level < levels; ++level)
    for (int64_t k = 0; k < streams; ++k)
      for (int l = 0; l < W; ++l) acc[0][k][l] += acc[level][k][l];
  for (int64_t v = steps * streams; v < vectors; ++v)
    for (int l = 0; l < W; ++l) acc[0][0][l] += sq[v * W + l];
  for (int64_t k = 1; k < streams; ++k)
    for (int l = 0; l < W; ++l) acc[0][0][l] += acc[0][k][l];
  float total = 0.f;
  for (int64_t t = vectors * W; t < n; ++t) total += sq[t];
  for (int l = 0; l < W; ++l) total += acc[0][0][l];
  return total;
}

template <int W>
void norm_rows(const uint16_t* x, int64_t x_stride, const uint16_t* weight, float eps, uint16_t* out, int64_t n,
               int64_t begin, int64_t end) {
  std::vector<float> row(n), sq(n);
  for (int64_t r = begin; r < end; ++r) {
    const uint16_t* xr = x + r * x_stride;
    for (int64_t t = 0; t < n; ++t) {
      row[t] = widen(xr[t]);
      sq[t] = row[t] * row[t];
    }
    const float mean = sum_in_torch_order<W>(sq.data(), n) / float(n);
    const float rstd = 1.0f / std::sqrt(mean + eps);
    uint16_t* o = out + r * n;
    for (int64_t t = 0; t < n; ++t) o[t] = round_bf16(widen(weight[t]) * widen(round_bf16(row[t] * rstd)));
  }
}

at::Tensor rms_norm_bf16(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t width) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.stride(1) == 1,
              "cpu_norm.rms_norm: x must be a CPU bfloat16 [rows, n] tensor with contiguous rows");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.numel() == x.size(1),
              "cpu_norm.rms_norm: weight must be a contiguous bfloat16 [n] tensor");
  TORCH_CHECK(width == 8 || width == 16, "cpu_norm.rms_norm: width must be 8 or 16, not ", width);
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows, n}, x.options());
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float epsf = float(eps);
  // Enough rows per thread that a decode step's few rows stay on this thread.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    if (width == 16)
      norm_rows<16>(xp, x.stride(0), wp, epsf, op, n, begin, end);
    else
      norm_rows<8>(xp, x.stride(0), wp, epsf, op, n, begin, end);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_bf16(Tensor x, Tensor weight, float eps, int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) { m.impl("rms_norm_bf16", &rms_norm_bf16); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {}
