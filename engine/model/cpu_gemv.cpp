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
// however the panels are split over threads. x is float32 or bfloat16 (widened exactly), the bias float32, and
// y has x's dtype: a bfloat16 y is each output's float32 sum plus bias rounded once to nearest even, as
// `.to(torch.bfloat16)` rounds it. The panels are split evenly over torch's intra-op threads (at::parallel_for).
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
#include <type_traits>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Bytes ahead of the weight vector being read that a pass prefetches (measured on an AMD EPYC with AVX-512,
// 16 rows: 2-4 KB alike, 1 KB and 8 KB slower, none at all 20% slower). Whether and into which cache a pass of
// M rows prefetches: prefetch<M>(), per ISA below.
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
// Round to bf16, nearest even (c10::BFloat16's rule: bits + 0x7FFF + the kept part's lowest bit, NaN to
// 0x7FC0), W values stored.
inline void store_bf16(c10::BFloat16* p, vec v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
// Panels at once for a pass of M rows: R * M accumulators and R weight vectors within the 32 registers.
template <int M>
constexpr int panels_at_once() { return M == 1 ? 8 : M == 2 ? 6 : M <= 4 ? 4 : M <= 8 ? 2 : 1; }
// At one or two rows the hardware's own prefetch keeps up with the 6-8 weight streams and the explicit one (two
// a cache line) costs time: without it one row ran 10-40% faster and two rows 0-15% faster on an AMD EPYC
// (AVX-512, 2 threads, bf16 and float32 decode shapes of qwen2.5-0.5b), while 8 and 16 rows ran 10-25% slower.
template <int M>
inline void prefetch(const void* p) {
  if constexpr (M > 2) _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0);
}
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
inline void store_bf16(c10::BFloat16* p, vec v) {  // as the AVX-512 one
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  // Lanes hold values below 2^16: pack them to 16 bits (per 128-bit half), then the halves' low quarters.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
// Within the 16 registers. From 3 rows one panel at a time: two panels of 3 or 4 rows ran 1.1-1.6x slower than
// one (a pass over qwen2.5-0.5b's decode matrices, AVX2 build on an AMD EPYC, capped, 2 threads: bf16 weights
// 67-70 ms against 42-44 ms, float32 64-65 against 57), while at one and two rows 4, 6 or 8 panels ran alike.
template <int M>
constexpr int panels_at_once() { return M <= 2 ? 4 : 1; }
// Prefetching pays at every pass size here (AVX2 build on the same EPYC, capped: one and two rows 0-12% faster
// with it than without), into L2 at one or two rows (a pass over the decode matrices 5-12% faster than into L1)
// and into L1 from 3 rows (4 and 8 rows 4-6% slower into L2).
template <int M>
inline void prefetch(const void* p) {
  if constexpr (M <= 2) {
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T1);
  } else {
    _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH_BYTES, _MM_HINT_T0);
  }
}
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
inline void out_val(float* y, float v) { *y = v; }
inline void out_val(c10::BFloat16* y, float v) { *y = c10::BFloat16(v); }  // round to nearest even

// Output columns [n, n + W) of the pass's M rows from one panel's sums: bias added, the last panel's padding
// left out.
template <int M, typename O>
inline void put(const float* sums /* [M][W] */, const float* bias, O* y, int64_t N, int64_t n) {
  const int valid = int(std::min<int64_t>(W, N - n));
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < valid; ++j) out_val(y + i * N + n + j, sums[i * W + j] + (bias ? bias[n + j] : 0.f));
}

#ifndef GEMV_SCALAR
inline vec wload(const float* p) { return load_f32(p); }
inline vec wload(const uint16_t* p) { return load_bf16(p); }
inline void store_out(float* p, vec v) { store_f32(p, v); }
inline void store_out(c10::BFloat16* p, vec v) { store_bf16(p, v); }

// R panels (consecutive, each K * W weights) against the pass's M rows of xt ([K][M], x transposed).
template <int R, int M, typename T, typename O>
inline void panels(const float* xt, int64_t K, const T* wp, const float* bias, O* y, int64_t N, int64_t n) {
  vec acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) acc[r][i] = vzero();
  const int64_t stride = K * W;
  for (int64_t k = 0; k < K; ++k) {
    const float* xk = xt + k * M;
    for (int r = 0; r < R; ++r) {
      const T* p = wp + r * stride + k * W;
      prefetch<M>(p);
      vec wv = wload(p);
      for (int i = 0; i < M; ++i) acc[r][i] = fma(bcast(xk[i]), wv, acc[r][i]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t nr = n + r * W;
    if (nr + W <= N) {
      vec b = bias ? load_f32(bias + nr) : vzero();
      for (int i = 0; i < M; ++i) store_out(y + i * N + nr, add(acc[r][i], b));
    } else {
      alignas(64) float sums[M * W];
      for (int i = 0; i < M; ++i) store_f32(sums + i * W, acc[r][i]);
      put<M>(sums, bias, y, N, nr);
    }
  }
}

// Panels [p, p1) R at a time, the rest R / 2 at a time, and so on: a thread's last panels keep several
// accumulator chains in flight too (one panel of one row is a single chain, bound by the add's latency).
template <int R, int M, typename T, typename O>
inline void panel_range(const float* xt, int64_t K, const T* wp, const float* bias, O* y, int64_t N, int64_t p,
                        int64_t p1) {
  for (; p + R <= p1; p += R) panels<R, M>(xt, K, wp + p * K * W, bias, y, N, p * W);
  if constexpr (R > 1) panel_range<R / 2, M>(xt, K, wp, bias, y, N, p, p1);
}

template <int M, typename T, typename O>
void pass(const float* xt, int64_t K, const T* wp, const float* bias, O* y, int64_t N, int64_t P) {
  at::parallel_for(0, P, 4, [&](int64_t p0, int64_t p1) {
    panel_range<panels_at_once<M>(), M>(xt, K, wp, bias, y, N, p0, p1);
  });
}
#else
template <int M, typename T, typename O>
void pass(const float* xt, int64_t K, const T* wp, const float* bias, O* y, int64_t N, int64_t P) {
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

template <typename T, typename O, int M = MAX_M>
void pass_of(int m, const float* xt, int64_t K, const T* wp, const float* bias, O* y, int64_t N, int64_t P) {
  if constexpr (M > 1) {
    if (m < M) return pass_of<T, O, M - 1>(m, xt, K, wp, bias, y, N, P);
  }
  pass<M>(xt, K, wp, bias, y, N, P);
}

inline float xval(float v) { return v; }
inline float xval(c10::BFloat16 v) { return bf16_to_f32(v.x); }

template <typename T, typename X, typename O>
void run(const X* x, int64_t m, int64_t K, const T* wp, const float* bias, O* y, int64_t N, int64_t P) {
  // The pass's rows in float32, transposed ([K][rows]), reused across calls on this thread; one float32 row is
  // x itself.
  thread_local std::vector<float> xt;
  for (int64_t i = 0; i < m; i += MAX_M) {
    const int rows = int(std::min<int64_t>(MAX_M, m - i));
    const X* xi = x + i * K;
    const float* xp;
    if (rows == 1 && std::is_same_v<X, float>) {
      xp = reinterpret_cast<const float*>(xi);
    } else {
      xt.resize(size_t(K) * rows);
      for (int64_t k = 0; k < K; ++k)
        for (int r = 0; r < rows; ++r) xt[k * rows + r] = xval(xi[r * K + k]);
      xp = xt.data();
    }
    pass_of<T, O>(rows, xp, K, wp, bias, y + i * N, N, P);
  }
}

template <typename T, typename X>
void run_on(const at::Tensor& x, const at::Tensor& panels, const float* bias, at::Tensor& y, int64_t N) {
  const int64_t K = x.size(1), P = panels.size(0);
  const T* wp = reinterpret_cast<const T*>(panels.data_ptr());
  const X* xp = reinterpret_cast<const X*>(x.data_ptr());
  if (y.scalar_type() == at::kFloat) {
    run(xp, x.size(0), K, wp, bias, y.data_ptr<float>(), N, P);
  } else {
    run(xp, x.size(0), K, wp, bias, y.data_ptr<c10::BFloat16>(), N, P);
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

// x [..., K] float32 or bfloat16 (any strides) -> y [..., N] in x's dtype.
at::Tensor gemv(const at::Tensor& x_in, const at::Tensor& panels, const c10::optional<at::Tensor>& bias, int64_t N) {
  TORCH_CHECK(x_in.dim() >= 1 && (x_in.scalar_type() == at::kFloat || x_in.scalar_type() == at::kBFloat16),
              "x: float32 or bfloat16 [..., K]");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == W, "panels: pack()'s [P, K, W]");
  const int64_t K = x_in.size(-1);
  TORCH_CHECK(panels.size(1) == K, "panels: K as x's");
  const at::Tensor x = x_in.reshape({-1, K}).contiguous();
  const int64_t P = panels.size(0);
  TORCH_CHECK(N > (P - 1) * W && N <= P * W, "N: the packed weight's output rows");
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), "bias: float32 [N]");
    b = bias->data_ptr<float>();
  }
  TORCH_CHECK(panels.scalar_type() == at::kFloat || panels.scalar_type() == at::kBFloat16,
              "panels: float32 or bfloat16");
  std::vector<int64_t> shape = x_in.sizes().vec();
  shape.back() = N;
  auto y = at::empty({x.size(0), N}, x.options());
  if (x.size(0) > 0) {
    const bool fp32_w = panels.scalar_type() == at::kFloat, fp32_x = x.scalar_type() == at::kFloat;
    if (fp32_w && fp32_x) run_on<float, float>(x, panels, b, y, N);
    else if (fp32_w) run_on<float, c10::BFloat16>(x, panels, b, y, N);
    else if (fp32_x) run_on<uint16_t, float>(x, panels, b, y, N);
    else run_on<uint16_t, c10::BFloat16>(x, panels, b, y, N);
  }
  return y.view(shape);
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
