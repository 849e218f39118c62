// y[m, N] = x[m, K] . w[N, K]^T (+ bias) for decode-sized m: the panel kernel of engine/model/cpu_gemv.py.
//
// A decode step's linear layers read each weight once per step, so at one to a few rows they are bound by
// memory bandwidth, and at 16 rows by the arithmetic and the bandwidth together. `pack` lays the weight out
// once in panels of W output rows (the vector width), k-major: panels[p][k][j] = w[p * W + j][k], the last
// panel padded with zeros. A pass over a panel loads one vector of W weights per k and multiplies it by every
// row of x in the pass (x's element broadcast from a transposed copy that stays in the caches), so each
// weight is read from memory once per pass of up to MAX_M rows and feeds MAX_M fused multiply-adds; a few rows
// take R panels at once, to keep as many weight streams in flight. The weight stays in its dtype (float32, or
// bfloat16 widened exactly to float32 in registers); sums are float32, one accumulator lane per (row, output),
// over k in order, with no horizontal sums: a row's outputs are the same whatever rows run beside it and
// however the panels are split over threads. x and the bias are float32, and so is y; the caller rounds y
// back to its dtype. The panels are split evenly over torch's intra-op threads (at::parallel_for).
//
// Where the compiler targets AVX-512 (-march=native on such a CPU): panels of 16, passes of up to 16 rows.
// AVX2 with FMA: panels of 8, passes of up to 8 (16 registers). Elsewhere plain loops over panels of 8. Past a
// pass or two a blocked GEMM (oneDNN, MKL) wins, as it keeps a block of the weight in the cache across many
// rows: the linear tuner times both and offers this kernel up to cpu_gemv.MAX_ROWS rows.
//
// Built by splitserve.engine.native, once per machine (the build key includes the CPU's flags).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Bytes ahead of the weight vector being read that a pass prefetches (measured on an AMD EPYC with AVX-512,
// 16 rows: 2-4 KB alike, 1 KB and 8 KB slower, none at all 20% slower).
constexpr int PREFETCH_BYTES = 2048;

#if defined(__AVX512F__)
constexpr int W = 16;
constexpr int MAX_M = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec bcast(float v) { return _mm512_set1_ps(v); }
inline vec load_f32(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f32(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
// Panels at once for a pass of M rows: R * M accumulators and R weight vectors within the 32 registers.
template <int M>
constexpr int panels_at_once() { return M == 1 ? 8 : M == 2 ? 6 : M <= 4 ? 4 : M <= 8 ? 2 : 1; }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
constexpr int MAX_M = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec bcast(float v) { return _mm256_set1_ps(v); }
inline vec load_f32(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f32(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
// Within the 16 registers.
template <int M>
constexpr int panels_at_once() { return M <= 2 ? 4 : M <= 4 ? 2 : 1; }
#else
#define GEMV_SCALAR 1
constexpr int W = 8;
constexpr int MAX_M = 16;
#endif

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float wval(const float* w) { return *w; }
inline float wval(const uint16_t* w) { return bf16_to_f32(*w); }

// Output columns [n, n + W) of the pass's M rows from one panel's sums: bias added, the last panel's padding
// left out.
template <int M>
inline void put(const float* sums /* [M][W] */, const float* bias, float* y, int64_t N, int64_t n) {
  const int valid = int(std::min<int64_t>(W, N - n));
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < valid; ++j) y[i * N + n + j] = sums[i * W + j] + (bias ? bias[n + j] : 0.f);
}

#ifndef GEMV_SCALAR
inline vec wload(const float* p) { return load_f32(p); }
inline vec wload(const uint16_t* p) { return load_bf16(p); }

// R panels (consecutive, each K * W weights) against the pass's M rows of xt ([K][M], x transposed).
template <int R, int M, typename T>
inline void panels(const float* xt, int64_t K, const T* wp, const float* bias, float* y, int64_t N, int64_t n) {
  vec acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) acc[r][i] = vzero();
  const int64_t stride = K * W;
  for (int64_t k = 0; k < K; ++k) {
    const float* xk = xt + k * M;
    for (int r = 0; r < R; ++r) {
      const T* p = wp + r * stride + k * W;
      _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0);
      vec wv = wload(p);
      for (int i = 0; i < M; ++i) acc[r][i] = fma(bcast(xk[i]), wv, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t nr = n + r * W;
    if (nr + W <= N) {
      vec b = bias ? load_f32(bias + nr) : vzero();
      for (int i = 0; i < M; ++i) store_f32(y + i * N + nr, add(acc[r][i], b));
    } else {
      alignas(64) float sums[M * W];
      for (int i = 0; i < M; ++i) store_f32(sums + i * W, acc[r][i]);
      put<M>(sums, bias, y, N, nr);
    }
  }
}

// Panels [p, p1) R at a time, the rest R / 2 at a time, and so on: a thread's last panels keep several
// accumulator chains in flight too (one panel of one row is a single chain, bound by the add's latency).
template <int R, int M, typename T>
inline void panel_range(const float* xt, int64_t K, const T* wp, const float* bias, float* y, int64_t N, int64_t p,
                        int64_t p1) {
  for (; p + R <= p1; p += R) panels<R, M>(xt, K, wp + p * K * W, bias, y, N, p * W);
  if constexpr (R > 1) panel_range<R / 2, M>(xt, K, wp, bias, y, N, p, p1);
}

template <int M, typename T>
void pass(const float* xt, int64_t K, const T* wp, const float* bias, float* y, int64_t N, int64_t P) {
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    panel_range<panels_at_once<M>(), M>(xt, K, wp, bias, y, N, p0, p1);
  });
}
#else
template <int M, typename T>
void pass(const float* xt, int64_t K, const T* wp, const float* bias, float* y, int64_t N, int64_t P) {
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    float sums[M * W];
    for (int64_t p = p0; p < p1; ++p) {
      const T* w = wp + p * K * W;
      std::fill(sums, sums + M * W, 0.f);
      for (int64_t k = 0; k < K; ++k)
        for (int i = 0; i < M; ++i)
          for (int j = 0; j < W; ++j) sums[i * W + j] += xt[k * M + i] * wval(w + k * W + j);
      put<M>(sums, bias, y, N, p * W);
    }
  });
}
#endif

template <typename T, int M = MAX_M>
void pass_of(int m, const float* xt, int64_t K, const T* wp, const float* bias, float* y, int64_t N, int64_t P) {
  if constexpr (M > 1) {
    if (m < M) return pass_of<T, M - 1>(m, xt, K, wp, bias, y, N, P);
  }
  pass<M>(xt, K, wp, bias, y, N, P);
}

template <typename T>
void run(const float* x, int64_t m, int64_t K, const T* wp, const float* bias, float* y, int64_t N, int64_t P) {
  // The pass's rows transposed ([K][rows]), reused across calls on this thread; one row is x itself.
  thread_local std::vector<float> xt;
  for (int64_t i = 0; i < m; i += MAX_M) {
    const int rows = int(std::min<int64_t>(MAX_M, m - i));
    const float* xi = x + i * K;
    if (rows > 1) {
      xt.resize(size_t(K) * rows);
      for (int64_t k = 0; k < K; ++k)
        for (int r = 0; r < rows; ++r) xt[k * rows + r] = xi[r * K + k];
      xi = xt.data();
    }
    pass_of<T>(rows, xi, K, wp, bias, y + i * N, N, P);
  }
}

}  // namespace

// [N, K] float32 or bfloat16 -> [ceil(N / W), K, W] of the same dtype: panel p holds output rows p * W ... as
// columns, k-major; rows past N are zeros.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2, "w: [N, K]");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16, "w: float32 or bfloat16");
  const int64_t N = w.size(0), K = w.size(1), P = (N + W - 1) / W;
  auto padded = at::zeros({P * W, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({P, W, K}).transpose(1, 2).contiguous();
}

at::Tensor gemv(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: float32 [m, K], contiguous");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == W, "panels: pack()'s [P, K, W]");
  TORCH_CHECK(panels.size(1) == x.size(1), "panels: K as x's");
  const int64_t P = panels.size(0);
  TORCH_CHECK(N > (P - 1) * W && N <= P * W, "N: the packed weight's output rows");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), "bias: float32 [N]");
    b = bias->data_ptr<float>();
  }
  auto y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return y;
  if (panels.scalar_type() == at::kFloat) {
    run<float>(x.data_ptr<float>(), x.size(0), x.size(1), panels.data_ptr<float>(), b, y.data_ptr<float>(), N, P);
  } else {
    TORCH_CHECK(panels.scalar_type() == at::kBFloat16, "panels: float32 or bfloat16");
    run<uint16_t>(x.data_ptr<float>(), x.size(0), x.size(1), reinterpret_cast<const uint16_t*>(panels.data_ptr()), b,
                  y.data_ptr<float>(), N, P);
  }
  return y;
}

// The panel width this build uses (16 AVX-512, 8 AVX2 and plain loops), whether it is vectorized, and the rows
// it takes in one pass.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("pack", &pack);
  mod.def("gemv", &gemv);
  mod.def("panel_width", [] { return W; });
#if defined(GEMV_SCALAR)
  mod.def("vector_width", [] { return 1; });
#else
  mod.def("vector_width", [] { return W; });
#endif
  mod.def("max_rows", [] { return MAX_M; });
}
