// y[m, N] = x[m, K] . w[N, K]^T (+ bias) for a few rows m: the row-streaming kernel of engine/model/cpu_gemv.py.
//
// A decode step's linear layers read each weight once per step, so at one to a few rows they are bound by
// memory bandwidth, not arithmetic. This kernel streams w in its own [N, K] layout (float32, or bfloat16
// widened to float32 exactly in registers) and reuses each loaded weight vector for every row of x in a pass:
// R output rows at once, each against M rows of x, sums in float32 with one accumulator vector per (output
// row, x row) over K in order, then one horizontal sum. So a row's sums are the same whatever rows run beside
// it and however the work is tiled or split over threads. x and the bias are float32, and so is y; the
// caller rounds y back to its dtype. The output rows are split evenly over torch's intra-op threads
// (at::parallel_for).
//
// Where the compiler targets AVX-512 (-march=native on such a CPU): 16-float vectors, passes of up to 16 rows
// of x. AVX2 with FMA: 8-float vectors, passes of up to 8 (16 registers). Elsewhere plain loops. Past a few
// rows a blocked GEMM (oneDNN, MKL) wins, as it keeps x in the cache across K: the linear tuner times both and
// offers this kernel up to cpu_gemv.MAX_ROWS rows.
//
// Built by splitserve.engine.native, once per machine (the build key includes the CPU's flags).

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// Output rows at once for one row of x: eight weight streams keep more loads in flight (measured: 8, 12 and 16
// alike, 4 slower by about a fifth on an AMD EPYC with AVX-512).
constexpr int ROWS_1 = 8;

#if defined(__AVX512F__)
constexpr int W = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec load_f32(const float* p) { return _mm512_loadu_ps(p); }
inline vec load_f32_tail(const float* p, int n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
inline vec load_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline vec load_bf16_tail(const uint16_t* p, int n) {
  __m256i v = _mm256_maskz_loadu_epi16((__mmask16)((1u << n) - 1), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
inline vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float hsum(vec v) { return _mm512_reduce_add_ps(v); }
constexpr int MAX_M = 16;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int W = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec load_f32(const float* p) { return _mm256_loadu_ps(p); }
inline __m256i tail_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vec load_f32_tail(const float* p, int n) { return _mm256_maskload_ps(p, tail_mask(n)); }
inline vec load_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
inline vec load_bf16_tail(const uint16_t* p, int n) {
  alignas(16) uint16_t buf[8] = {0};
  for (int i = 0; i < n; ++i) buf[i] = p[i];
  return load_bf16(buf);
}
inline vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float hsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
constexpr int MAX_M = 8;
#else
#define GEMV_SCALAR 1
constexpr int W = 1;
constexpr int MAX_M = 16;
#endif

inline float bf16_to_f32(uint16_t v) {
  uint32_t u = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float wval(const float* w, int64_t i) { return w[i]; }
inline float wval(const uint16_t* w, int64_t i) { return bf16_to_f32(w[i]); }

#ifndef GEMV_SCALAR
inline vec wload(const float* p) { return load_f32(p); }
inline vec wload(const uint16_t* p) { return load_bf16(p); }
inline vec wload_tail(const float* p, int n) { return load_f32_tail(p, n); }
inline vec wload_tail(const uint16_t* p, int n) { return load_bf16_tail(p, n); }

// R weight rows at once, each against M rows of x.
template <int R, int M, typename T>
inline void block(const float* x, int64_t K, const T* w, float* out /* [M][R] */) {
  vec acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < M; ++i) acc[r][i] = vzero();
  int64_t k = 0;
  for (; k + W <= K; k += W) {
    vec xv[M];
    for (int i = 0; i < M; ++i) xv[i] = load_f32(x + i * K + k);
    for (int r = 0; r < R; ++r) {
      vec wv = wload(w + r * K + k);
      for (int i = 0; i < M; ++i) acc[r][i] = fma(wv, xv[i], acc[r][i]);
    }
  }
  if (k < K) {
    int n = int(K - k);
    vec xv[M];
    for (int i = 0; i < M; ++i) xv[i] = load_f32_tail(x + i * K + k, n);
    for (int r = 0; r < R; ++r) {
      vec wv = wload_tail(w + r * K + k, n);
      for (int i = 0; i < M; ++i) acc[r][i] = fma(wv, xv[i], acc[r][i]);
    }
  }
  for (int i = 0; i < M; ++i)
    for (int r = 0; r < R; ++r) out[i * R + r] = hsum(acc[r][i]);
}
#endif

template <int R, int M, typename T>
void rows(const float* x, int64_t K, const T* w, const float* bias, float* y, int64_t N, int64_t n0, int64_t n1) {
  float out[M * R];
  int64_t n = n0;
#ifndef GEMV_SCALAR
  for (; n + R <= n1; n += R) {
    block<R, M>(x, K, w + n * K, out);
    for (int i = 0; i < M; ++i)
      for (int r = 0; r < R; ++r) y[i * N + n + r] = out[i * R + r] + (bias ? bias[n + r] : 0.f);
  }
  for (; n < n1; ++n) {
    block<1, M>(x, K, w + n * K, out);
    for (int i = 0; i < M; ++i) y[i * N + n] = out[i] + (bias ? bias[n] : 0.f);
  }
#else
  (void)out;
  for (; n < n1; ++n)
    for (int i = 0; i < M; ++i) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += wval(w, n * K + k) * x[i * K + k];
      y[i * N + n] = s + (bias ? bias[n] : 0.f);
    }
#endif
}

// Rows of x in passes of 16, 8, 4, 2 or 1 (at most MAX_M), each pass over the thread's output rows with as
// many output rows at once (R) as the registers hold beside its accumulators.
template <typename T>
void run(const float* x, int64_t m, int64_t K, const T* w, const float* bias, float* y, int64_t N) {
  at::parallel_for(0, N, 256, [&](int64_t n0, int64_t n1) {
    for (int64_t i = 0; i < m;) {
      const int64_t left = m - i;
      const float* xi = x + i * K;
      float* yi = y + i * N;
      if (MAX_M >= 16 && left >= 16) {
        rows<1, (MAX_M >= 16 ? 16 : 1)>(xi, K, w, bias, yi, N, n0, n1);
        i += 16;
      } else if (MAX_M >= 8 && left >= 8) {
        rows<(W == 16 ? 2 : 1), (MAX_M >= 8 ? 8 : 1)>(xi, K, w, bias, yi, N, n0, n1);
        i += 8;
      } else if (left >= 4) {
        rows<(W == 16 ? 4 : 2), 4>(xi, K, w, bias, yi, N, n0, n1);
        i += 4;
      } else if (left >= 2) {
        rows<4, 2>(xi, K, w, bias, yi, N, n0, n1);
        i += 2;
      } else {
        rows<ROWS_1, 1>(xi, K, w, bias, yi, N, n0, n1);
        i += 1;
      }
    }
  });
}

}  // namespace

at::Tensor gemv(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: float32 [m, K], contiguous");
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.size(1) == x.size(1), "w: [N, K] contiguous, K as x's");
  int64_t m = x.size(0), K = x.size(1), N = w.size(0);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N && bias->is_contiguous(), "bias: float32 [N]");
    b = bias->data_ptr<float>();
  }
  auto y = at::empty({m, N}, x.options());
  if (w.scalar_type() == at::kFloat) {
    run<float>(x.data_ptr<float>(), m, K, w.data_ptr<float>(), b, y.data_ptr<float>(), N);
  } else {
    TORCH_CHECK(w.scalar_type() == at::kBFloat16, "w: float32 or bfloat16");
    run<uint16_t>(x.data_ptr<float>(), m, K, reinterpret_cast<const uint16_t*>(w.data_ptr()), b, y.data_ptr<float>(), N);
  }
  return y;
}

// The vector width this build uses (16 AVX-512, 8 AVX2, 1 plain loops) and the rows it takes in one pass.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("gemv", &gemv);
#if defined(GEMV_SCALAR)
  mod.def("vector_width", [] { return 1; });
#else
  mod.def("vector_width", [] { return W; });
#endif
  mod.def("max_rows", [] { return MAX_M; });
}
