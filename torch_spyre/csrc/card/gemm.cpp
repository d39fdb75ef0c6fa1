// The functional executor's matmul against a weight read in place from its
// stick layout (sim/direct.py).
//
// A weight [N, K] whose stick dim is K sits in device memory as sticks of S
// elements; permuted back to host order it is a strided [N, K / S, S] view
// (innermost contiguous).  Converting it to a contiguous fp32 host tensor on
// every read costs more than the math, and keeping that conversion costs 2x
// the weight's bytes of host memory; this kernel reads the 16-bit (or fp32)
// sticks where they are and accumulates in fp32, as the card's PE array does.
//
// Arithmetic: every product a[m, k] * w[n, k] is fused into an fp32
// accumulator (FMA); each (m, n) keeps 16 lane accumulators, lane j taking
// the elements j, j + 16, ... of each contiguous run of k (a stick, or the
// part of one inside a core's k chunk), then the 16 lanes are summed in a
// fixed pairwise tree.  The order is fixed, so results do not depend on the
// host's SIMD width or thread count: the scalar path computes the same bits.
#include "card.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "dl16.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace spyre_card {
namespace {

constexpr int kLanes = 16;
constexpr int kRows = 4;  // rows of a per block
constexpr int kCols = 4;  // rows of w per block

enum class WType { f16, bf16, f32, dl16 };

struct Job {
  const float* a;
  int64_t lda;
  const char* w;
  int64_t w_n, w_kb;  // strides in elements: per row of w, per stick
  int64_t stick;      // elements per stick
  int64_t elem;       // bytes per element of w
  int64_t m, n, k, chunk, parts;
  float* out;  // [parts, m, n]
  WType wt;
};

inline float hsum16(const float* v) {
  float t[kLanes];
  std::memcpy(t, v, sizeof(t));
  for (int s = kLanes / 2; s >= 1; s /= 2)
    for (int i = 0; i < s; ++i) t[i] += t[i + s];
  return t[0];
}

inline float w_at(const Job& j, const char* p) {
  switch (j.wt) {
    case WType::f16:
      return static_cast<float>(*reinterpret_cast<const c10::Half*>(p));
    case WType::bf16:
      return static_cast<float>(*reinterpret_cast<const c10::BFloat16*>(p));
    case WType::dl16:
      return dl16_decode_one(*reinterpret_cast<const int16_t*>(p));
    default:
      return *reinterpret_cast<const float*>(p);
  }
}

// Calls f(k0, len) for each contiguous run of w's k in [lo, hi): a stick, or
// the part of one inside the range.
template <class F>
inline void runs(const Job& j, int64_t lo, int64_t hi, F&& f) {
  for (int64_t k = lo; k < hi;) {
    int64_t len = std::min(j.stick - k % j.stick, hi - k);
    f(k, len);
    k += len;
  }
}

inline const char* w_ptr(const Job& j, int64_t n, int64_t k) {
  return j.w + ((n * j.w_n + (k / j.stick) * j.w_kb + k % j.stick) * j.elem);
}

void block_scalar(const Job& j, int64_t p, int64_t m0, int64_t n0) {
  int64_t lo = p * j.chunk, hi = std::min(j.k, lo + j.chunk);
  float acc[kRows][kCols][kLanes] = {};
  int64_t mr = std::min<int64_t>(kRows, j.m - m0), nc = std::min<int64_t>(kCols, j.n - n0);
  runs(j, lo, hi, [&](int64_t k, int64_t len) {
    for (int64_t i = 0; i < len; ++i) {
      int lane = static_cast<int>(i % kLanes);
      for (int64_t c = 0; c < nc; ++c) {
        float wv = w_at(j, w_ptr(j, n0 + c, k + i));
        for (int64_t r = 0; r < mr; ++r)
          acc[r][c][lane] = std::fma(j.a[(m0 + r) * j.lda + k + i], wv, acc[r][c][lane]);
      }
    }
  });
  for (int64_t r = 0; r < mr; ++r)
    for (int64_t c = 0; c < nc; ++c)
      j.out[(p * j.m + m0 + r) * j.n + n0 + c] = hsum16(acc[r][c]);
}

#if defined(__x86_64__)
template <WType WT>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline __m512 load_w(const char* p,
                                                                        __mmask16 mask) {
  if constexpr (WT == WType::f16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p));
  } else if constexpr (WT == WType::bf16) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p)), 16));
  } else if constexpr (WT == WType::dl16) {
    // dl16_decode_one on 16 lanes: sign, exponent rebiased, 9 fraction bits;
    // 0 -> +-0, the all-ones magnitude (NINF) -> NaN
    __m512i u = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, p));
    __m512i sign = _mm512_slli_epi32(_mm512_srli_epi32(u, 15), 31);
    __m512i mag = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFF));
    __m512i e = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_srli_epi32(mag, 9), _mm512_set1_epi32(kBiasShift)), 23);
    __m512i f = _mm512_slli_epi32(_mm512_and_si512(mag, _mm512_set1_epi32(0x1FF)), 14);
    __m512i b = _mm512_or_si512(sign, _mm512_or_si512(e, f));
    b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(mag, _mm512_setzero_si512()), sign);
    b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(mag, _mm512_set1_epi32(kNinf)),
                              _mm512_or_si512(sign, _mm512_set1_epi32(0x7FC00000)));
    return _mm512_castsi512_ps(b);
  } else {
    return _mm512_maskz_loadu_ps(mask, p);
  }
}

#define SPYRE_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))

// one vector step: 16 elements of k for MR rows of a and kCols rows of w
template <WType WT, int MR, bool FULL>
SPYRE_AVX512 __attribute__((always_inline)) inline void fma_step(
    __m512 (&acc)[MR][kCols], const float* const (&arow)[MR], const char* const (&wrow)[kCols],
    int64_t ka, int64_t wofs, __mmask16 mask) {
  __m512 wv[kCols], av[MR];
#pragma GCC unroll 4
  for (int c = 0; c < kCols; ++c) {
    if constexpr (FULL && WT == WType::f16) {
      wv[c] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow[c] + wofs)));
    } else if constexpr (FULL && WT == WType::f32) {
      wv[c] = _mm512_loadu_ps(wrow[c] + wofs);
    } else {
      wv[c] = load_w<WT>(wrow[c] + wofs, mask);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
    av[r] = FULL ? _mm512_loadu_ps(arow[r] + ka) : _mm512_maskz_loadu_ps(mask, arow[r] + ka);
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_fmadd_ps(av[r], wv[c], acc[r][c]);
}

// a run of len elements of k inside one stick (full vectors, then a masked one)
template <WType WT, int MR>
SPYRE_AVX512 __attribute__((always_inline)) inline void partial_run(
    __m512 (&acc)[MR][kCols], const float* const (&arow)[MR], const char* const (&wrow)[kCols],
    int64_t k, int64_t wofs, int64_t len) {
  constexpr int64_t elem = WT == WType::f32 ? 4 : 2;
  int64_t i = 0;
  for (; i + kLanes <= len; i += kLanes)
    fma_step<WT, MR, true>(acc, arow, wrow, k + i, wofs + i * elem, 0xFFFF);
  if (i < len)
    fma_step<WT, MR, false>(acc, arow, wrow, k + i, wofs + i * elem,
                            static_cast<__mmask16>((1u << (len - i)) - 1));
}

// MR rows of a (1..kRows) against kCols rows of w
template <WType WT, int MR>
SPYRE_AVX512 void block_avx512(const Job& j, int64_t p, int64_t m0, int64_t n0) {
  const int64_t lo = p * j.chunk, hi = std::min(j.k, lo + j.chunk);
  const int64_t nc = std::min<int64_t>(kCols, j.n - n0);
  constexpr int64_t elem = WT == WType::f32 ? 4 : 2;
  // rows of w past the edge repeat the last one; their sums are not stored
  const float* arow[MR];
  const char* wrow[kCols];
  for (int r = 0; r < MR; ++r) arow[r] = j.a + (m0 + r) * j.lda;
  for (int c = 0; c < kCols; ++c)
    wrow[c] = j.w + (n0 + std::min<int64_t>(c, nc - 1)) * j.w_n * elem;
  __m512 acc[MR][kCols];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) acc[r][c] = _mm512_setzero_ps();
  // runs of k inside one stick: a partial first one, whole sticks (the hot
  // loop: full vectors only, the accumulators stay in registers), a partial last
  const int64_t stick = j.stick, step = j.w_kb * elem;
  int64_t k = lo, wbase = (lo / stick) * step;
  if (int64_t off = lo % stick; off != 0 && k < hi) {
    int64_t len = std::min(stick - off, hi - k);
    partial_run<WT, MR>(acc, arow, wrow, k, wbase + off * elem, len);
    k += len;
    wbase += step;
  }
  if (stick % kLanes == 0) {
    for (; k + stick <= hi; k += stick, wbase += step)
      for (int64_t i = 0; i < stick; i += kLanes)
        fma_step<WT, MR, true>(acc, arow, wrow, k + i, wbase + i * elem, 0xFFFF);
  }
  for (; k < hi; wbase += step) {
    int64_t len = std::min(stick, hi - k);
    partial_run<WT, MR>(acc, arow, wrow, k, wbase, len);
    k += len;
  }
  alignas(64) float lanes[kLanes];
  for (int r = 0; r < MR; ++r)
    for (int64_t c = 0; c < nc; ++c) {
      _mm512_store_ps(lanes, acc[r][c]);
      j.out[(p * j.m + m0 + r) * j.n + n0 + c] = hsum16(lanes);
    }
}

using BlockFn = void (*)(const Job&, int64_t, int64_t, int64_t);

template <WType WT>
BlockFn pick_rows(int64_t mr) {
  switch (mr) {
    case 1: return block_avx512<WT, 1>;
    case 2: return block_avx512<WT, 2>;
    case 3: return block_avx512<WT, 3>;
    default: return block_avx512<WT, 4>;
  }
}

BlockFn pick(WType wt, int64_t mr) {
  switch (wt) {
    case WType::f16: return pick_rows<WType::f16>(mr);
    case WType::bf16: return pick_rows<WType::bf16>(mr);
    case WType::dl16: return pick_rows<WType::dl16>(mr);
    default: return pick_rows<WType::f32>(mr);
  }
}

bool have_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl");
  return ok;
}
#endif

}  // namespace

// a: fp32 [M, >= K] (row stride lda, unit column stride); w: [N, K / S, S]
// (fp16, bf16, fp32 or DL16 bits as int16; innermost contiguous).  Returns fp32 [parts, M, N]:
// part p sums k in [p * chunk, min(K, (p + 1) * chunk)), as a split of k over
// cores leaves partial sums (parts = 1, chunk >= K: the whole sum).
at::Tensor stick_gemm(const at::Tensor& a, const at::Tensor& w, int64_t k, int64_t chunk,
                      int64_t parts, bool simd) {
  TORCH_CHECK(a.dim() == 2 && a.scalar_type() == at::kFloat && (a.stride(1) == 1 || a.size(1) <= 1),
              "stick_gemm: a must be a 2-D fp32 tensor with unit column stride");
  TORCH_CHECK(w.dim() == 3 && w.stride(2) == 1, "stick_gemm: w must be [N, sticks, stick]");
  TORCH_CHECK(a.size(1) >= k && w.size(1) * w.size(2) >= k && k >= 0,
              "stick_gemm: k exceeds an operand");
  TORCH_CHECK(chunk > 0 && parts > 0 && parts * chunk >= k, "stick_gemm: bad k split");
  WType wt;
  switch (w.scalar_type()) {
    case at::kHalf: wt = WType::f16; break;
    case at::kBFloat16: wt = WType::bf16; break;
    case at::kFloat: wt = WType::f32; break;
    case at::kShort: wt = WType::dl16; break;  // DL16 bits (the card's 16-bit format)
    default: TORCH_CHECK(false, "stick_gemm: w must be fp16, bf16, fp32 or int16 (DL16 bits)");
  }
  int64_t m = a.size(0), n = w.size(0);
  at::Tensor out = at::empty({parts, m, n}, a.options());
  Job j{a.data_ptr<float>(),
        a.stride(0),
        static_cast<const char*>(w.data_ptr()),
        w.stride(0),
        w.stride(1),
        w.size(2),
        static_cast<int64_t>(w.element_size()),
        m,
        n,
        k,
        chunk,
        parts,
        out.data_ptr<float>(),
        wt};
  if (m == 0 || n == 0) return out;
  bool vec = false;
#if defined(__x86_64__)
  vec = simd && have_avx512();
#endif
  int64_t nblocks = (n + kCols - 1) / kCols;
  int64_t mblocks = (m + kRows - 1) / kRows;
  // each output element is one block's: the thread count does not change a bit
  at::parallel_for(0, parts * nblocks, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      int64_t p = b / nblocks, n0 = (b % nblocks) * kCols;
      for (int64_t mb = 0; mb < mblocks; ++mb) {
#if defined(__x86_64__)
        if (vec) {
          pick(j.wt, std::min<int64_t>(kRows, m - mb * kRows))(j, p, mb * kRows, n0);
          continue;
        }
#endif
        block_scalar(j, p, mb * kRows, n0);
      }
    }
  });
  return out;
}

}  // namespace spyre_card
