// Decode attention on the CPU that reads K/V in place from the paged cache through the block tables.
//
// The contract is paged_decode.py's PagedDecodeFn: q [B, H, d], cache_layer [num_blocks, 2, kv_heads,
// block_size, d] (contiguous), block_tables [B, max_blocks] int64, context_lens [B] int64; row b attends to
// positions [max(0, len - window), len) with len = max(context_lens[b], 1) (a zero-length padding row attends to
// position 0 of its first block). One work item per (row, KV head): the query group of that KV head is scored
// against each block the row attends to, straight from the cache, with an online softmax; scores, the softmax
// and the accumulation are float32 for every input dtype (float32, bfloat16). Items run on torch's intra-op
// threads (at::parallel_for), so torch.set_num_threads bounds them.
//
// Where the compiler targets AVX-512 (-march=native on such a CPU), blocks whose size and head_dim are multiples of
// 16 take attend_rows_avx512 (below); every other shape, and every other CPU, the portable loops. bfloat16 takes
// its own path (decode_rows_bf16): the steps of SDPA's CPU kernel, so that its output is transformers'.
//
// The same file holds the prefill attention (paged_prefill, at its end; engine/attention/cpu_paged_prefill.py),
// which shares the decode kernel's exp and its build.
//
// Built by engine/attention/cpu_paged_decode.py with torch.utils.cpp_extension, once per machine (the build
// key includes the CPU's flags: -march=native code runs only where it was built).

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <type_traits>
#include <vector>

namespace {

inline float load(float x) { return x; }

inline float load(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline void store(float* out, float x) { *out = x; }

inline void store(c10::BFloat16* out, float x) { *out = c10::BFloat16(x); }  // round to nearest even

// exp(x) for x <= 0 (a score minus the running maximum), vectorizable: 2^n * p(f) with a degree-6 polynomial,
// relative error about 2e-7 (the float32 library exp's order). Below -87 it returns 0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;  // log2(e)
  const float n = std::floor(t + 0.5f);
  const float f = (t - n) * 0.693147180559945309f;  // in [-ln2/2, ln2/2]
  float p = 1.3888889e-3f;
  p = p * f + 8.3333333e-3f;
  p = p * f + 4.1666667e-2f;
  p = p * f + 1.6666667e-1f;
  p = p * f + 0.5f;
  p = p * f + 1.0f;
  p = p * f + 1.0f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) << 23);
}

// Rows [t0, t1) of one block's keys or values as float32: in place for float32, converted into ``buf`` (which
// holds the whole block) for bfloat16, once per block rather than once per query of the group.
inline const float* rows(const float* block, int64_t, int64_t, int64_t, float*) { return block; }

inline const float* rows(const c10::BFloat16* block, int64_t t0, int64_t t1, int64_t d, float* buf) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(block);
#pragma omp simd
  for (int64_t i = t0 * d; i < t1 * d; ++i) {
    const uint32_t u = static_cast<uint32_t>(bits[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    buf[i] = f;
  }
  return buf;
}

// A row's blocks lie anywhere in the cache, each in pages of its own, so the hardware prefetcher does not follow
// from one to the next, and the kernel would wait on memory at the start of every block. The block PREFETCH_BLOCKS
// ahead is asked for while this one is scored, its cache lines spread over the block's work (part ``i`` of
// ``parts`` asks for its share of the lines), not in one burst that the CPU's miss queues would drop.
constexpr int64_t PREFETCH_BLOCKS = 2;

inline void prefetch_part(const char* p, int64_t bytes, int64_t i, int64_t parts) {
  if (p == nullptr) return;
  const int64_t lines = (bytes + 63) / 64, per = (lines + parts - 1) / parts;
  for (int64_t l = i * per; l < std::min(lines, (i + 1) * per); ++l) __builtin_prefetch(p + l * 64, 0, 3);
}

// The same with the share's size worked out by the caller once per block (``per`` lines each, of ``lines``): no
// division per part.
inline void prefetch_lines(const char* p, int64_t lines, int64_t i, int64_t per) {
  if (p == nullptr) return;
  for (int64_t l = i * per; l < std::min(lines, (i + 1) * per); ++l) __builtin_prefetch(p + l * 64, 0, 3);
}

// q . k over d elements: LANES independent partial sums (one vector register's worth), summed by halves.
constexpr int64_t LANES = 16;

inline float dot_product(const float* q, const float* k, int64_t d) {
  float part[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES) {
#pragma omp simd
    for (int64_t l = 0; l < LANES; ++l) part[l] += q[i + l] * k[i + l];
  }
  for (int64_t l = 0; l < 8; ++l) part[l] += part[l + 8];
  for (int64_t l = 0; l < 4; ++l) part[l] += part[l + 4];
  for (int64_t l = 0; l < 2; ++l) part[l] += part[l + 2];
  float sum = part[0] + part[1];
  for (; i < d; ++i) sum += q[i] * k[i];
  return sum;
}

#if defined(__AVX512F__)
// The AVX-512 path (block_size and head_dim multiples of 16): a block is taken 16 rows at a time. For each query
// of the group, the 16 rows' dot products are 16 vector accumulators reduced into one vector at once (lane t:
// row t), the softmax's exp is vectorized, and the value accumulation keeps each 16-wide slice of the output in a
// register across the rows. Rows of the 16 outside [t0, t1) are read (they lie in the same block) but masked out
// of the maximum and the sum, and never reach the values.
constexpr int64_t TILE = 16;

inline __m512 exp_nonpositive(__m512 x) {  // exp_nonpositive above, 16 lanes at once
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(_mm512_add_ps(t, _mm512_set1_ps(0.5f)), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.3888889e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.3333333e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(4.1666667e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.6666667e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// One vector whose lane t is the sum of v[t]'s 16 lanes: pairs, then quads, within 128-bit lanes, then across them.
inline __m512 sum_each(const __m512 (&v)[TILE]) {
  __m512 w[8], x[4];
  for (int k = 0; k < 8; ++k)
    w[k] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * k], v[2 * k + 1]), _mm512_unpackhi_ps(v[2 * k], v[2 * k + 1]));
  for (int k = 0; k < 4; ++k) {
    const __m512d a = _mm512_castps_pd(w[2 * k]), b = _mm512_castps_pd(w[2 * k + 1]);
    x[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // x[k], in each 128-bit lane L: the lane-L sums of v[4k .. 4k + 3]; add the four lanes, v[4j + i] to lane 4j + i.
  const __m512 z0 = _mm512_add_ps(_mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 z1 = _mm512_add_ps(_mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                  _mm512_shuffle_f32x4(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(z0, z1, _MM_SHUFFLE(3, 1, 3, 1)));
}

// acc[0 .. 16 W) = acc * correction + sum over t in [lo, hi) of p[t] v[t][0 .. 16 W) (rows of v d floats apart):
// even and odd rows in two sets of W accumulators, so that 2 W chains of FMAs run at once, not one per column.
template <int W>
inline void accumulate_values(float* acc, const float* p, const float* v, int64_t d, int64_t lo, int64_t hi,
                              float correction) {
  __m512 even[W], odd[W];
  const __m512 c = _mm512_set1_ps(correction);
  for (int j = 0; j < W; ++j) {
    even[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + 16 * j), c);
    odd[j] = _mm512_setzero_ps();
  }
  int64_t t = lo;
  for (; t + 1 < hi; t += 2) {
    const __m512 p0 = _mm512_set1_ps(p[t]), p1 = _mm512_set1_ps(p[t + 1]);
    for (int j = 0; j < W; ++j) {
      even[j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v + t * d + 16 * j), even[j]);
      odd[j] = _mm512_fmadd_ps(p1, _mm512_loadu_ps(v + (t + 1) * d + 16 * j), odd[j]);
    }
  }
  if (t < hi) {
    const __m512 p0 = _mm512_set1_ps(p[t]);
    for (int j = 0; j < W; ++j) even[j] = _mm512_fmadd_ps(p0, _mm512_loadu_ps(v + t * d + 16 * j), even[j]);
  }
  for (int j = 0; j < W; ++j) _mm512_storeu_ps(acc + 16 * j, _mm512_add_ps(even[j], odd[j]));
}

// Rows [t0, t1) of one block (keys, values: the block's rows as float32, all block_size of them readable) for the
// group's queries qf [group, d] (scaled), folded into the online softmax's run_max, run_sum and acc [group, d].
inline void attend_rows_avx512(const float* qf, const float* keys, const float* values, int64_t t0, int64_t t1,
                               int64_t group, int64_t d, float* run_max, float* run_sum, float* acc,
                               const char* pk, const char* pv, int64_t block_bytes) {
  alignas(64) float p[TILE];
  const int64_t parts = group * ((t1 - 1) / TILE - t0 / TILE + 1);  // one share of the prefetch per query and tile
  const int64_t lines = (block_bytes + 63) / 64, per = (lines + parts - 1) / parts;
  int64_t part = 0;
  for (int64_t c0 = t0 / TILE * TILE; c0 < t1; c0 += TILE) {
    const int64_t lo = std::max(t0, c0) - c0, hi = std::min(t1, c0 + TILE) - c0;
    const __mmask16 mask = static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
    const float* k = keys + c0 * d;
    const float* v = values + c0 * d;
    for (int64_t g = 0; g < group; ++g, ++part) {
      prefetch_lines(pk, lines, part, per);
      prefetch_lines(pv, lines, part, per);
      __m512 dots[TILE];
      for (int t = 0; t < TILE; ++t) dots[t] = _mm512_setzero_ps();
      for (int64_t i = 0; i < d; i += TILE) {
        const __m512 qv = _mm512_loadu_ps(qf + g * d + i);
        for (int t = 0; t < TILE; ++t) dots[t] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k + t * d + i), dots[t]);
      }
      const __m512 scores = sum_each(dots);
      const float new_max = std::max(run_max[g], _mm512_mask_reduce_max_ps(mask, scores));
      const float correction = exp_nonpositive(run_max[g] - new_max);  // about 0 on the first rows
      run_max[g] = new_max;
      const __m512 e = _mm512_maskz_mov_ps(mask, exp_nonpositive(_mm512_sub_ps(scores, _mm512_set1_ps(new_max))));
      run_sum[g] = run_sum[g] * correction + _mm512_reduce_add_ps(e);
      _mm512_store_ps(p, e);
      float* a = acc + g * d;
      for (int64_t i = 0; i < d; i += 4 * TILE) {  // 64 columns at a time, fewer at the end
        const int64_t w = std::min<int64_t>(4, (d - i) / TILE);
        if (w == 4) accumulate_values<4>(a + i, p, v + i, d, lo, hi, correction);
        else if (w == 3) accumulate_values<3>(a + i, p, v + i, d, lo, hi, correction);
        else if (w == 2) accumulate_values<2>(a + i, p, v + i, d, lo, hi, correction);
        else accumulate_values<1>(a + i, p, v + i, d, lo, hi, correction);
      }
    }
  }
}
#endif

// Work item ``item`` of a decode call: row b and KV head h, the row's length (at least 1: a padding row attends to
// position 0) and the first position it attends to (its window's).
struct Item {
  int64_t b, h, len, start;
};

inline Item item_of(int64_t item, int64_t kv_heads, const int64_t* lens, int64_t window) {
  const int64_t b = item / kv_heads, len = std::max<int64_t>(lens[b], 1);
  return {b, item % kv_heads, len, window > 0 ? std::max<int64_t>(0, len - window) : 0};
}

template <typename scalar_t>
void decode_rows(const scalar_t* q, const scalar_t* cache, const int64_t* tables, const int64_t* lens,
                 scalar_t* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t block_size,
                 int64_t head_dim, int64_t max_blocks, float scale, int64_t window) {
  const int64_t group = heads / kv_heads;
  const int64_t d = head_dim;
  const int64_t block_elems = block_size * d;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(scalar_t));
#if defined(__AVX512F__)
  const bool tiled = block_size % TILE == 0 && d % TILE == 0;
#endif
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores(group * block_size), run_max(group), run_sum(group);
    std::vector<float> kbuf(std::is_same_v<scalar_t, float> ? 0 : block_elems), vbuf(kbuf.size());
    for (int64_t item = begin; item < end; ++item) {
      const Item it = item_of(item, kv_heads, lens, window);
      const int64_t b = it.b, h = it.h, len = it.len, start = it.start;
      for (int64_t g = 0; g < group; ++g) {
        const scalar_t* qrow = q + (b * heads + h * group + g) * d;
        float* qg = qf.data() + g * d;
        for (int64_t i = 0; i < d; ++i) qg[i] = load(qrow[i]) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.0f);
      const int64_t* table = tables + b * max_blocks;
      // Block ``id``'s keys (kv 0) or values (kv 1) of this item's KV head: block_size x d contiguous elements.
      const auto head_run = [&](int64_t id, int64_t kv) { return cache + ((id * 2 + kv) * kv_heads + h) * block_elems; };
      for (int64_t blk = start / block_size; blk <= (len - 1) / block_size; ++blk) {
        const int64_t t0 = std::max<int64_t>(start - blk * block_size, 0);
        const int64_t t1 = std::min<int64_t>(len - blk * block_size, block_size);
        const int64_t id = table[blk];
        // The block PREFETCH_BLOCKS ahead of this one in the row's table, asked for while this one is scored.
        const bool ahead = blk + PREFETCH_BLOCKS <= (len - 1) / block_size;
        const char* pk = ahead ? reinterpret_cast<const char*>(head_run(table[blk + PREFETCH_BLOCKS], 0)) : nullptr;
        const char* pv = ahead ? reinterpret_cast<const char*>(head_run(table[blk + PREFETCH_BLOCKS], 1)) : nullptr;
        const float* keys = rows(head_run(id, 0), t0, t1, d, kbuf.data());
        const float* values = rows(head_run(id, 1), t0, t1, d, vbuf.data());
#if defined(__AVX512F__)
        if (tiled) {
          attend_rows_avx512(qf.data(), keys, values, t0, t1, group, d, run_max.data(), run_sum.data(), acc.data(), pk,
                             pv, block_bytes);
          continue;
        }
#endif
        for (int64_t t = t0; t < t1; ++t) {
          const float* k = keys + t * d;
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * d;
            scores[g * block_size + t] = dot_product(qg, k, d);
          }
        }
        for (int64_t g = 0; g < group; ++g) {
          prefetch_part(pk, block_bytes, g, group);
          prefetch_part(pv, block_bytes, g, group);
          float* s = scores.data() + g * block_size;
          float block_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = t0; t < t1; ++t) block_max = std::max(block_max, s[t]);
          const float new_max = std::max(run_max[g], block_max);
          const float correction = exp_nonpositive(run_max[g] - new_max);  // about 0 on the first block
          run_max[g] = new_max;
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = t0; t < t1; ++t) {
            s[t] = exp_nonpositive(s[t] - new_max);
            sum += s[t];
          }
          run_sum[g] = run_sum[g] * correction + sum;
          if (correction != 1.0f) {
            float* a = acc.data() + g * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) a[i] *= correction;
          }
        }
        for (int64_t t = t0; t < t1; ++t) {
          const float* v = values + t * d;
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * block_size + t];
            float* a = acc.data() + g * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) a[i] += p * v[i];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.0f / run_sum[g];
        const float* a = acc.data() + g * d;
        scalar_t* o = out + (b * heads + h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) store(o + i, a[i] * inv);
      }
    }
  });
}

// ---- bfloat16: the softmax as SDPA's CPU flash kernel computes it for reduced types ----
//
// transformers decodes a bf16 model through SDPA, whose CPU kernel (torch's flash attention) scores q . k in float32
// from the bf16 values and then scales them, takes each chunk of SDPA_KV_SPLIT keys' maximum (with the running one),
// sums exp(s - max) in float32, and multiplies the values by those probabilities *rounded to bf16*, rescaling the
// running sum and output between chunks; the output is the float32 sum of products times 1 / the float32 sum,
// rounded to bf16. The online softmax above (a running maximum per cache block, float32 probabilities) moved a
// fifth of the outputs by a bf16 step from SDPA's, and greedy bf16 output drifted from transformers' past the tie
// rule through it. This path takes SDPA's steps, its exp and its order of the probabilities' sum (``lanes``: the
// width of torch's float vectors, 16 under its AVX-512 kernels, 8 under AVX2 and its default build; ``poly``:
// whether its vectorized exp is the polynomial ``fexp_u20``, as under AVX2 and AVX-512, or std::exp), so the two
// differ only in the order of the dot products' and the values' float32 sums. One work item per (row, KV head), as
// above: the chunk's scores for the whole query group, then the softmax per query, then the values.
constexpr int64_t SDPA_KV_SPLIT = 512;  // keys per chunk of torch's flash attention (its kv_split_size)

// x rounded to the nearest bf16 (ties to even), as a float; x finite or inf (the probabilities are in [0, 1]).
inline float round_bf16(float x) {
  uint32_t u = std::bit_cast<uint32_t>(x);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  return std::bit_cast<float>(u);
}

// torch's Vectorized<float>::fexp_u20 (its AVX2 and AVX-512 kernels; SDPA's softmax on the CPU), one lane: the same
// operations in the same order, each fused multiply-add explicit and no other contracted (the product x * log2(e) is
// an FMA with 0, which rounds as the product does), so the result is the same bits.
inline float fexp_u20(float x) {
  const float ln_flt_min = std::bit_cast<float>(0xc2aeac50u), ln_flt_max = std::bit_cast<float>(0x42b17218u);
  const float log2e = std::bit_cast<float>(0x3fb8aa3bu);
  float src = __builtin_fmaf(x, log2e, 0.0f);
  const float frac = src - std::floor(src);
  float res = __builtin_fmaf(frac, -0.079204240219773236f, -0.22433836478672356f);
  res = __builtin_fmaf(frac, res, 0.30354260500649682f);
  res = __builtin_fmaf(frac, res, 0.00010703434948458272f);
  src = src - res;
  // 2^23 * src + 127 * 2^23, truncated to an integer: the float's bits. Clamped first only where the masks below
  // replace the result anyway (the conversion of an out-of-range float is undefined in C++).
  const float bits = std::min(std::max(__builtin_fmaf(8388608.0f, src, 1065353216.0f), 0.0f), 2147483520.0f);
  const float out = std::bit_cast<float>(static_cast<int32_t>(bits));
  return x < ln_flt_min ? 0.0f : (x > ln_flt_max ? std::numeric_limits<float>::infinity() : out);
}

// The chunk's probabilities, as torch's _exp_reduce_sum_fusion_kernel makes them: p[t] = exp(s[t] - max) over the
// whole vectors of ``lanes`` (fexp_u20 or std::exp), lane sums reduced by halves (its AVX2 and AVX-512 reduction) or
// one by one (its default build's), then the tail with std::exp added one by one. Returns the float32 sum; p is
// stored rounded to bf16, as SDPA's value product reads it.
inline float exp_sum(float* s, int64_t n, float max, int64_t lanes, bool poly) {
  float lane[16] = {};
  const int64_t whole = n / lanes * lanes;
  for (int64_t t0 = 0; t0 < whole; t0 += lanes) {
    if (poly) {
#pragma omp simd
      for (int64_t l = 0; l < lanes; ++l) {
        const float e = fexp_u20(s[t0 + l] - max);
        lane[l] += e;
        s[t0 + l] = round_bf16(e);
      }
    } else {
      for (int64_t l = 0; l < lanes; ++l) {
        const float e = std::exp(s[t0 + l] - max);
        lane[l] += e;
        s[t0 + l] = round_bf16(e);
      }
    }
  }
  float sum;
  if (poly) {
    for (int64_t half = lanes / 2; half >= 1; half /= 2)
      for (int64_t l = 0; l < half; ++l) lane[l] += lane[l + half];
    sum = lane[0];
  } else {
    sum = lane[0];
    for (int64_t l = 1; l < lanes; ++l) sum += lane[l];
  }
  for (int64_t t = whole; t < n; ++t) {
    const float e = std::exp(s[t] - max);
    sum += e;
    s[t] = round_bf16(e);
  }
  return sum;
}

// Eight floats in a vector register (GCC's vector extension: AVX2's ymm, or half of an AVX-512 zmm), loaded and
// stored unaligned. ``x * v`` of a float and a vector broadcasts the float; ``acc += x * v`` is one FMA per lane.
typedef float v8f __attribute__((vector_size(32)));

inline v8f vload(const float* p) {
  v8f v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void vstore(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }

// Q queries' scores against 16 keys: s[q * 16 + t] = sum over i, in order, of qf[q * d + i] * kt[i * ldk + t] (kt:
// the keys transposed, rows of ldk floats), each score one chain of FMAs, the 2 Q accumulators in registers.
template <int Q>
inline void score16(const float* qf, int64_t d, const float* kt, int64_t ldk, float* s) {
  v8f acc[Q][2] = {};
  for (int64_t i = 0; i < d; ++i) {
    const v8f k0 = vload(kt + i * ldk), k1 = vload(kt + i * ldk + 8);
    for (int q = 0; q < Q; ++q) {
      const float x = qf[q * d + i];
      acc[q][0] += x * k0;
      acc[q][1] += x * k1;
    }
  }
  for (int q = 0; q < Q; ++q) {
    vstore(s + q * 16, acc[q][0]);
    vstore(s + q * 16 + 8, acc[q][1]);
  }
}

// Up to 8 queries (one per lane of qt, the queries transposed: qt[i * 8 + q]) against K keys: s[j * 8 + q] = sum over
// i, in order, of qt[i * 8 + q] * keys[j * d + i], each score one chain of FMAs (the same sums as score16's), the K
// accumulators in registers; each key element is broadcast from the keys as float32 rows.
template <int K>
inline void score_keys(const float* qt, int64_t d, const float* keys, float* s) {
  v8f acc[K] = {};
  for (int64_t i = 0; i < d; ++i) {
    const v8f qv = vload(qt + i * 8);
    for (int j = 0; j < K; ++j) acc[j] += keys[j * d + i] * qv;
  }
  for (int j = 0; j < K; ++j) vstore(s + j * 8, acc[j]);
}

// a[0 .. 8 W) += sum over t < n, in order, of p[t] * v[t * d + 0 .. 8 W): the W accumulators in registers.
template <int W>
inline void values8(float* a, const float* p, const float* v, int64_t d, int64_t n) {
  v8f acc[W];
  for (int w = 0; w < W; ++w) acc[w] = vload(a + 8 * w);
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t];
    for (int w = 0; w < W; ++w) acc[w] += pt * vload(v + t * d + 8 * w);
  }
  for (int w = 0; w < W; ++w) vstore(a + 8 * w, acc[w]);
}

void decode_rows_bf16(const c10::BFloat16* q, const c10::BFloat16* cache, const int64_t* tables, const int64_t* lens,
                      c10::BFloat16* out, int64_t batch, int64_t heads, int64_t kv_heads, int64_t block_size,
                      int64_t head_dim, int64_t max_blocks, float scale, int64_t window, int64_t lanes, bool poly) {
  const int64_t group = heads / kv_heads;
  const int64_t d = head_dim;
  const int64_t block_elems = block_size * d;
  const int64_t block_bytes = block_elems * static_cast<int64_t>(sizeof(c10::BFloat16));
  const bool lanes_q = group >= 4;
  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), run_max(group), run_sum(group);
    // kt: a block's keys transposed, rows of ldk floats (block_size rounded up to 16; the columns past the block
    // are zero, scored and dropped).
    const int64_t ldk = (block_size + 15) / 16 * 16;
    std::vector<float> scores(group * SDPA_KV_SPLIT), kt(d * ldk, 0.0f), vbuf(block_elems), part(group * d);
    float tile[64];  // one call's scores: 4 queries x 16 keys (score16) or 8 keys x 8 queries (score_keys)
    // With 4 or more queries per KV head, the queries go in the vector lanes instead (score_keys): the keys need no
    // transposing, only their conversion to float32 rows.
    std::vector<float> qt(lanes_q ? (group + 7) / 8 * 8 * d : 0), kbuf(lanes_q ? block_elems : 0);
    for (int64_t item = begin; item < end; ++item) {
      const Item it = item_of(item, kv_heads, lens, window);
      const int64_t b = it.b, h = it.h, len = it.len, start = it.start;
      for (int64_t g = 0; g < group; ++g) {
        const c10::BFloat16* qrow = q + (b * heads + h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] = load(qrow[i]);
      }
      if (lanes_q) {  // the queries transposed, 8 per pass (lanes past the group zero)
        std::fill(qt.begin(), qt.end(), 0.0f);
        for (int64_t g = 0; g < group; ++g)
          for (int64_t i = 0; i < d; ++i) qt[(g / 8) * d * 8 + i * 8 + g % 8] = qf[g * d + i];
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(run_sum.begin(), run_sum.end(), 0.0f);
      const int64_t* table = tables + b * max_blocks;
      const auto head_run = [&](int64_t id, int64_t kv) { return cache + ((id * 2 + kv) * kv_heads + h) * block_elems; };
      for (int64_t c0 = start; c0 < len; c0 += SDPA_KV_SPLIT) {
        const int64_t c1 = std::min(len, c0 + SDPA_KV_SPLIT);
        // Scores: scores[g * SDPA_KV_SPLIT + (position - c0)] = (q_g . k) * scale, block by block.
        const int64_t last = (len - 1) / block_size;  // the row's last block
        if (c0 == start) {
          for (int64_t ahead = start / block_size; ahead < std::min(last + 1, start / block_size + PREFETCH_BLOCKS); ++ahead)
            for (int64_t kv = 0; kv < 2; ++kv) prefetch_part(reinterpret_cast<const char*>(head_run(table[ahead], kv)), block_bytes, 0, 1);
        }
        for (int64_t blk = c0 / block_size; blk <= (c1 - 1) / block_size; ++blk) {
          const int64_t base = blk * block_size;  // the block's first position
          const int64_t t0 = std::max(c0, base) - base, t1 = std::min(c1, base + block_size) - base;
          // The block PREFETCH_BLOCKS ahead, keys and values, asked for while this one is scored: the values are read
          // again after the chunk's softmax, from the caches.
          if (blk + PREFETCH_BLOCKS <= last)
            for (int64_t kv = 0; kv < 2; ++kv)
              prefetch_part(reinterpret_cast<const char*>(head_run(table[blk + PREFETCH_BLOCKS], kv)), block_bytes, 0, 1);
          // The block's scores, each q . k one chain of FMAs over the columns in order (with the values' sum in the
          // order of the positions below, the gather path's SDPA results bit for bit in the cases
          // tests/engine/test_cpu_decode_bf16.py measures; the float32 path's 16-lane dot products were not). With 4
          // or more queries per KV head the queries fill the vector lanes (score_keys, the keys as float32 rows);
          // with fewer, the block's keys are transposed (kt [d][ldk]) and 16 keys fill them (score16).
          if (lanes_q) {
            const float* keys = rows(head_run(table[blk], 0), t0, t1, d, kbuf.data());
            for (int64_t x0 = t0; x0 < t1; x0 += 8) {  // 8 keys at a time, 8 queries at once
              const int64_t nk = std::min<int64_t>(8, t1 - x0);
              for (int64_t g0 = 0; g0 < group; g0 += 8) {
                const float* qg = qt.data() + (g0 / 8) * d * 8;
                const float* kx = keys + x0 * d;
                switch (nk) {
                  case 8: score_keys<8>(qg, d, kx, tile); break;
                  case 7: score_keys<7>(qg, d, kx, tile); break;
                  case 6: score_keys<6>(qg, d, kx, tile); break;
                  case 5: score_keys<5>(qg, d, kx, tile); break;
                  case 4: score_keys<4>(qg, d, kx, tile); break;
                  case 3: score_keys<3>(qg, d, kx, tile); break;
                  case 2: score_keys<2>(qg, d, kx, tile); break;
                  default: score_keys<1>(qg, d, kx, tile); break;
                }
                for (int64_t r = 0; r < std::min<int64_t>(8, group - g0); ++r) {
                  float* sg = scores.data() + (g0 + r) * SDPA_KV_SPLIT;
                  for (int64_t j = 0; j < nk; ++j) sg[base + x0 + j - c0] = tile[j * 8 + r] * scale;
                }
              }
            }
            continue;
          }
          const uint16_t* kbits = reinterpret_cast<const uint16_t*>(head_run(table[blk], 0));
          for (int64_t t = t0; t < t1; ++t)
            for (int64_t i = 0; i < d; ++i) kt[i * ldk + t] = std::bit_cast<float>(uint32_t{kbits[t * d + i]} << 16);
          for (int64_t x0 = t0 / 16 * 16; x0 < t1; x0 += 16) {  // 16 keys at a time, up to 4 queries at once
            const int64_t lo = std::max(t0, x0), hi = std::min(t1, x0 + 16);
            for (int64_t g0 = 0; g0 < group; g0 += 4) {
              const int64_t nq = std::min<int64_t>(4, group - g0);
              const float* qg = qf.data() + g0 * d;
              if (nq == 4) score16<4>(qg, d, kt.data() + x0, ldk, tile);
              else if (nq == 3) score16<3>(qg, d, kt.data() + x0, ldk, tile);
              else if (nq == 2) score16<2>(qg, d, kt.data() + x0, ldk, tile);
              else score16<1>(qg, d, kt.data() + x0, ldk, tile);
              for (int64_t r = 0; r < nq; ++r) {  // key t of the block is position base + t: chunk offset base + t - c0
                float* sg = scores.data() + (g0 + r) * SDPA_KV_SPLIT;
                for (int64_t t = lo; t < hi; ++t) sg[base + t - c0] = tile[r * 16 + t - x0] * scale;
              }
            }
          }
        }
        // The softmax of the chunk, per query: the float32 sum of exp(s - max), the probabilities rounded to bf16.
        const int64_t n = c1 - c0;
        for (int64_t g = 0; g < group; ++g) {
          float* s = scores.data() + g * SDPA_KV_SPLIT;
          float chunk_max = -std::numeric_limits<float>::infinity();
          for (int64_t t = 0; t < n; ++t) chunk_max = std::max(chunk_max, s[t]);
          const float new_max = std::max(run_max[g], chunk_max);
          const float sum = exp_sum(s, n, new_max, lanes, poly);
          if (c0 > start) {  // torch: sum = chunk's + exp(old max - new) * sum; the output rescaled by the same
            const float correction = std::exp(run_max[g] - new_max);
            run_sum[g] = sum + correction * run_sum[g];
            float* a = acc.data() + g * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) a[i] *= correction;
          } else {
            run_sum[g] = sum;
          }
          run_max[g] = new_max;
        }
        // The values: the chunk's sum of p_g[t] * v[t] on its own, then added to the (rescaled) output, as SDPA's
        // value product adds its result to the output it scaled (beta 1), after the first chunk.
        float* const sums = c0 > start ? part.data() : acc.data();
        if (c0 > start) std::fill(part.begin(), part.end(), 0.0f);
        for (int64_t blk = c0 / block_size; blk <= (c1 - 1) / block_size; ++blk) {
          const int64_t base = blk * block_size;
          const int64_t t0 = std::max(c0, base) - base, t1 = std::min(c1, base + block_size) - base;
          const float* values = rows(head_run(table[blk], 1), t0, t1, d, vbuf.data());
          for (int64_t g = 0; g < group; ++g) {
            const float* p = scores.data() + g * SDPA_KV_SPLIT + (base + t0 - c0);  // position base + t0 first
            const float* v0 = values + t0 * d;
            const int64_t n = t1 - t0;
            float* a = sums + g * d;
            int64_t i = 0;
            for (; i + 32 <= d; i += 32) values8<4>(a + i, p, v0 + i, d, n);
            for (; i + 8 <= d; i += 8) values8<1>(a + i, p, v0 + i, d, n);
            for (; i < d; ++i)
              for (int64_t t = 0; t < n; ++t) a[i] += p[t] * v0[t * d + i];
          }
        }
        if (c0 > start) {
#pragma omp simd
          for (int64_t i = 0; i < group * d; ++i) acc[i] += part[i];
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float inv = 1.0f / run_sum[g];
        const float* a = acc.data() + g * d;
        c10::BFloat16* o = out + (b * heads + h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) store(o + i, a[i] * inv);
      }
    }
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, int64_t window, int64_t lanes, bool poly) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "cpu paged decode: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5, "cpu paged decode: q [B, H, d], cache [N, 2, kv_heads, bs, d]");
  TORCH_CHECK(q.scalar_type() == cache.scalar_type(), "cpu paged decode: q and the cache differ in dtype");
  TORCH_CHECK(cache.is_contiguous(), "cpu paged decode: the cache layer must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == torch::kLong && context_lens.scalar_type() == torch::kLong,
              "cpu paged decode: block tables and lengths must be int64");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = cache.size(2), block_size = cache.size(3);
  TORCH_CHECK(cache.size(1) == 2 && cache.size(4) == head_dim, "cpu paged decode: cache shape does not match q");
  TORCH_CHECK(heads % kv_heads == 0, "cpu paged decode: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == batch && context_lens.numel() == batch,
              "cpu paged decode: one block table and one length per row");
  const int64_t max_blocks = block_tables.size(1);
  TORCH_CHECK(max_blocks > 0 || batch == 0, "cpu paged decode: block tables need at least one column");
  TORCH_CHECK(lanes >= 1 && lanes <= 16 && (lanes & (lanes - 1)) == 0, "cpu paged decode: lanes must be 1, 2, 4, 8 or 16");
  auto out = torch::empty_like(q);
  if (batch == 0) return out;
  const float s = static_cast<float>(scale);
  if (q.scalar_type() == torch::kFloat) {
    decode_rows<float>(q.data_ptr<float>(), cache.data_ptr<float>(), block_tables.data_ptr<int64_t>(),
                       context_lens.data_ptr<int64_t>(), out.data_ptr<float>(), batch, heads, kv_heads, block_size,
                       head_dim, max_blocks, s, window);
  } else if (q.scalar_type() == torch::kBFloat16) {
    decode_rows_bf16(q.data_ptr<c10::BFloat16>(), cache.data_ptr<c10::BFloat16>(), block_tables.data_ptr<int64_t>(),
                     context_lens.data_ptr<int64_t>(), out.data_ptr<c10::BFloat16>(), batch, heads, kv_heads,
                     block_size, head_dim, max_blocks, s, window, lanes, poly);
  } else {
    TORCH_CHECK(false, "cpu paged decode: float32 or bfloat16 only, got ", q.scalar_type());
  }
  return out;
}

#if defined(__AVX512F__)
// ---- Prefill attention: a chunk of queries against its request's whole context, read from the paged cache ----
//
// The contract: q [Tq, H, d] (rows may be strided: the engine's q is a view of the fused projection), cache_layer as
// above, table [blocks] int64 (the request's blocks, covering context_len positions), context_len L; the chunk's
// queries sit at positions [L - Tq, L), query i attends to positions [max(0, p - window + 1), p] with p = L - Tq + i
// (window 0: [0, p]). float32 only, head_dim a multiple of 16, an AVX-512 build.
//
// First the context is packed once per call, per KV head, out of its blocks: the keys transposed (Kt [d][Lp], so that
// sixteen keys' scores are one vector) and the values as rows (V [Lp][d]), Lp = L rounded up to PF_KEYS with zeros.
// Then work items are (KV head, block of positions): the item's rows are its positions' queries of every head in the
// KV head's group (rows = positions x group, all against the same keys), scaled and packed. The item walks its keys
// in chunks of PF_CHUNK, each a GEMM-shaped product S = Q Kt (register tiles of PF_R rows x 32 keys), the causal and
// window mask applied to the chunk's edges, an online softmax (one rescale per chunk and row), and O += P V
// (register tiles of PF_RV rows x 64 columns). Items are taken most expensive first from a shared counter by torch's
// intra-op threads, so a causal chunk's long rows do not all land on one thread.
constexpr int64_t PF_KEYS = 32;    // keys per register tile of the scores (two vectors)
constexpr int64_t PF_CHUNK = 128;  // keys per chunk of the online softmax (a multiple of PF_KEYS)
constexpr int64_t PF_ROWS = 112;   // rows per item, about (positions x group)
constexpr int PF_R = 8;            // query rows per register tile of the scores
constexpr int PF_RV = 6;           // rows per register tile of the output

// S[r][0 .. 32) = Q[r] . Kt[:, 0 .. 32) for R rows: Q rows of d floats, Kt rows of ldk floats, S rows of lds.
template <int R>
inline void pf_scores(const float* qs, const float* kt, int64_t ldk, int64_t d, float* s, int64_t lds) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; ++i) {
    const __m512 k0 = _mm512_loadu_ps(kt + i * ldk), k1 = _mm512_loadu_ps(kt + i * ldk + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 q = _mm512_set1_ps(qs[r * d + i]);
      acc[r][0] = _mm512_fmadd_ps(q, k0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(q, k1, acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(s + r * lds, acc[r][0]);
    _mm512_storeu_ps(s + r * lds + 16, acc[r][1]);
  }
}

// O[r][c .. c + 16 W) += sum_t P[r][t] V[t][c .. c + 16 W) for R rows, t < n: P rows of ldp, V rows and O rows of d.
template <int R, int W>
inline void pf_values(const float* p, int64_t ldp, const float* v, int64_t n, int64_t d, float* o) {
  __m512 acc[R][W];
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) acc[r][w] = _mm512_loadu_ps(o + r * d + 16 * w);
  for (int64_t t = 0; t < n; ++t) {
    __m512 vv[W];
    for (int w = 0; w < W; ++w) vv[w] = _mm512_loadu_ps(v + t * d + 16 * w);
    for (int r = 0; r < R; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r * ldp + t]);
      for (int w = 0; w < W; ++w) acc[r][w] = _mm512_fmadd_ps(pr, vv[w], acc[r][w]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(o + r * d + 16 * w, acc[r][w]);
}

template <int R>
inline void pf_scores_rows(int rows, const float* qs, const float* kt, int64_t ldk, int64_t d, float* s, int64_t lds) {
  if constexpr (R > 0) {
    if (rows == R) return pf_scores<R>(qs, kt, ldk, d, s, lds);
    pf_scores_rows<R - 1>(rows, qs, kt, ldk, d, s, lds);
  }
}

template <int R, int W>
inline void pf_values_rows(int rows, const float* p, int64_t ldp, const float* v, int64_t n, int64_t d, float* o) {
  if constexpr (R > 0) {
    if (rows == R) return pf_values<R, W>(p, ldp, v, n, d, o);
    pf_values_rows<R - 1, W>(rows, p, ldp, v, n, d, o);
  }
}

template <int W>
inline void pf_values_all(int64_t rows, const float* p, int64_t ldp, const float* v, int64_t n, int64_t d, float* o) {
  for (int64_t r0 = 0; r0 < rows; r0 += PF_RV) {
    const int r = static_cast<int>(std::min<int64_t>(PF_RV, rows - r0));
    pf_values_rows<PF_RV, W>(r, p + r0 * ldp, ldp, v, n, d, o + r0 * d);
  }
}

// One item: rows [0, rows) are positions p0 + r / group, heads h * group + r % group.
void prefill_item(const float* q, int64_t q_row, int64_t heads, const float* kt, int64_t ldk, const float* vp,
                  float* out, int64_t d, int64_t group, int64_t h, int64_t p0, int64_t p1, int64_t first_pos,
                  float scale, int64_t window, float* qs, float* s, float* o, float* run_max, float* run_sum) {
  const int64_t rows = (p1 - p0) * group;
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + (p0 + r / group - first_pos) * q_row + (h * group + r % group) * d;
    for (int64_t i = 0; i < d; ++i) qs[r * d + i] = src[i] * scale;
  }
  std::fill(o, o + rows * d, 0.0f);
  std::fill(run_max, run_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(run_sum, run_sum + rows, 0.0f);
  const int64_t lowest = window > 0 ? std::max<int64_t>(0, p0 - window + 1) : 0;
  for (int64_t c0 = lowest / PF_KEYS * PF_KEYS; c0 < p1; c0 += PF_CHUNK) {
    const int64_t cols = (std::min(c0 + PF_CHUNK, p1) - c0 + PF_KEYS - 1) / PF_KEYS * PF_KEYS;
    for (int64_t r0 = 0; r0 < rows; r0 += PF_R) {
      const int r = static_cast<int>(std::min<int64_t>(PF_R, rows - r0));
      for (int64_t k0 = 0; k0 < cols; k0 += PF_KEYS)
        pf_scores_rows<PF_R>(r, qs + r0 * d, kt + c0 + k0, ldk, d, s + r0 * PF_CHUNK + k0, PF_CHUNK);
    }
    for (int64_t r = 0; r < rows; ++r) {
      // The row's keys in this chunk: [lo, hi) of its columns.
      const int64_t pos = p0 + r / group;
      const int64_t hi = std::min<int64_t>(cols, pos + 1 - c0);
      const int64_t lo = window > 0 ? std::clamp<int64_t>(pos - window + 1 - c0, 0, cols) : 0;
      float* sr = s + r * PF_CHUNK;
      if (hi <= lo) {  // none: nothing of this chunk reaches the row
        std::fill(sr, sr + cols, 0.0f);
        continue;
      }
      __m512 vmax = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      for (int64_t t = 0; t < cols; t += 16) {
        const int64_t a = std::clamp<int64_t>(lo - t, 0, 16), b = std::clamp<int64_t>(hi - t, 0, 16);
        const __mmask16 m = static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u));
        vmax = _mm512_mask_max_ps(vmax, m, vmax, _mm512_loadu_ps(sr + t));
      }
      const float new_max = std::max(run_max[r], _mm512_reduce_max_ps(vmax));
      const float correction = exp_nonpositive(run_max[r] - new_max);
      run_max[r] = new_max;
      const __m512 vnew = _mm512_set1_ps(new_max);
      __m512 vsum = _mm512_setzero_ps();
      for (int64_t t = 0; t < cols; t += 16) {
        const int64_t a = std::clamp<int64_t>(lo - t, 0, 16), b = std::clamp<int64_t>(hi - t, 0, 16);
        const __mmask16 m = static_cast<__mmask16>(((1u << b) - 1u) & ~((1u << a) - 1u));
        const __m512 e = _mm512_maskz_mov_ps(m, exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + t), vnew)));
        _mm512_storeu_ps(sr + t, e);
        vsum = _mm512_add_ps(vsum, e);
      }
      run_sum[r] = run_sum[r] * correction + _mm512_reduce_add_ps(vsum);
      if (correction != 1.0f) {
        const __m512 c = _mm512_set1_ps(correction);
        for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(o + r * d + i, _mm512_mul_ps(c, _mm512_loadu_ps(o + r * d + i)));
      }
    }
    const float* v = vp + c0 * d;
    for (int64_t c = 0; c < d; c += 64) {
      const int64_t w = std::min<int64_t>(64, d - c) / 16;
      if (w == 4) pf_values_all<4>(rows, s, PF_CHUNK, v + c, cols, d, o + c);
      else if (w == 3) pf_values_all<3>(rows, s, PF_CHUNK, v + c, cols, d, o + c);
      else if (w == 2) pf_values_all<2>(rows, s, PF_CHUNK, v + c, cols, d, o + c);
      else pf_values_all<1>(rows, s, PF_CHUNK, v + c, cols, d, o + c);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.0f / run_sum[r];
    float* dst = out + ((p0 + r / group - first_pos) * heads + h * group + r % group) * d;
    for (int64_t i = 0; i < d; ++i) dst[i] = o[r * d + i] * inv;
  }
}
#endif

torch::Tensor paged_prefill(torch::Tensor q, torch::Tensor cache, torch::Tensor table, int64_t context_len,
                            double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && cache.device().is_cpu(), "cpu paged prefill: tensors must be on the CPU");
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5, "cpu paged prefill: q [T, H, d], cache [N, 2, kv_heads, bs, d]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && cache.scalar_type() == torch::kFloat,
              "cpu paged prefill: float32 only");
  TORCH_CHECK(cache.is_contiguous(), "cpu paged prefill: the cache layer must be contiguous");
  TORCH_CHECK(table.scalar_type() == torch::kLong && table.dim() == 1, "cpu paged prefill: table must be int64 [blocks]");
  const int64_t tq = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = cache.size(2), block_size = cache.size(3);
  TORCH_CHECK(cache.size(1) == 2 && cache.size(4) == d, "cpu paged prefill: cache shape does not match q");
  TORCH_CHECK(heads % kv_heads == 0, "cpu paged prefill: heads must be a multiple of kv_heads");
  TORCH_CHECK(d % 16 == 0, "cpu paged prefill: head_dim must be a multiple of 16");
  TORCH_CHECK(tq >= 1 && context_len >= tq, "cpu paged prefill: 1 <= queries <= context_len");
  TORCH_CHECK(table.numel() * block_size >= context_len, "cpu paged prefill: the table does not cover the context");
#if !defined(__AVX512F__)
  TORCH_CHECK(false, "cpu paged prefill: this build has no AVX-512 path");
  return q;
#else
  if (q.stride(2) != 1 || q.stride(1) != d) q = q.contiguous();
  table = table.contiguous();
  const int64_t q_row = q.stride(0);
  const int64_t group = heads / kv_heads, length = context_len, first_pos = length - tq;
  const int64_t lp = (length + PF_KEYS - 1) / PF_KEYS * PF_KEYS;
  // Kt's rows are ldk floats apart: one cache line more than lp, so that the d rows a score tile reads do not all
  // fall in the same L1 sets when lp is a multiple of 1024.
  const int64_t ldk = lp + 16;
  const int64_t blocks = (length + block_size - 1) / block_size;
  auto packed = torch::empty({kv_heads * (ldk + lp) * d}, q.options());
  float* kt_all = packed.data_ptr<float>();
  float* v_all = kt_all + kv_heads * ldk * d;
  const float* c = cache.data_ptr<float>();
  const int64_t* ids = table.data_ptr<int64_t>();
  const int64_t block_elems = block_size * d;
  at::parallel_for(0, kv_heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, blk = item % blocks;
      const int64_t t0 = blk * block_size, n = std::min(block_size, length - t0);
      const float* ksrc = c + ((ids[blk] * 2 + 0) * kv_heads + h) * block_elems;
      const float* vsrc = c + ((ids[blk] * 2 + 1) * kv_heads + h) * block_elems;
      float* kt = kt_all + h * ldk * d;
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < d; ++i) kt[i * ldk + t0 + t] = ksrc[t * d + i];
      std::memcpy(v_all + h * lp * d + t0 * d, vsrc, n * d * sizeof(float));
    }
  });
  for (int64_t h = 0; h < kv_heads; ++h) {  // the padding keys: zero scores (masked) and zero values
    for (int64_t i = 0; i < d; ++i) std::fill(kt_all + h * ldk * d + i * ldk + length, kt_all + h * ldk * d + i * ldk + lp, 0.0f);
    std::fill(v_all + h * lp * d + length * d, v_all + (h + 1) * lp * d, 0.0f);
  }
  auto out = torch::empty({tq, heads, d}, q.options());
  const int64_t positions = std::max<int64_t>(1, PF_ROWS / group);
  const int64_t blocks_q = (tq + positions - 1) / positions, items = kv_heads * blocks_q;
  std::atomic<int64_t> next{0};
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float s = static_cast<float>(scale);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    const int64_t rows = positions * group;
    std::vector<float> qs(rows * d), sbuf(rows * PF_CHUNK), o(rows * d), run_max(rows), run_sum(rows);
    for (int64_t i = next++; i < items; i = next++) {
      const int64_t b = blocks_q - 1 - i / kv_heads, h = i % kv_heads;  // the latest positions (most keys) first
      const int64_t p0 = first_pos + b * positions, p1 = std::min(p0 + positions, length);
      prefill_item(qp, q_row, heads, kt_all + h * ldk * d, ldk, v_all + h * lp * d, op, d, group, h, p0, p1, first_pos,
                   s, window, qs.data(), sbuf.data(), o.data(), run_max.data(), run_sum.data());
    }
  });
  return out;
#endif
}

}  // namespace

// A torch operator (torch.ops.<extension name>.paged_decode), not a bare Python function: the dispatcher sees it,
// so dispatch modes (tests/engine/fake_graphs.py records a step's operators) and torch.compile see it too.
TORCH_LIBRARY(TORCH_EXTENSION_NAME, m) {
  m.def(
      "paged_decode(Tensor q, Tensor cache, Tensor block_tables, Tensor context_lens, float scale, int window, "
      "int lanes=8, bool poly=True) -> Tensor");
  m.def("paged_prefill(Tensor q, Tensor cache, Tensor table, int context_len, float scale, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(TORCH_EXTENSION_NAME, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_prefill", &paged_prefill);
}

// Loading the module registers the operator; ``tiled()`` says whether this build has the AVX-512 path.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
#if defined(__AVX512F__)
  m.def("tiled", [] { return true; });
#else
  m.def("tiled", [] { return false; });
#endif
}
