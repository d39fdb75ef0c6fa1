// Stick <-> host copies of the simulator: device memory in a stick layout
// converted to host layout in the compute dtype (torch_spyre/layout.py's
// to_host, the executor's operand reads).
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cstring>
#include <vector>

#include "card.h"

namespace spyre_card {

// The executor converts stick-layout device memory to host layout in the
// compute dtype (fp16 -> fp32).  As a strided TensorIterator copy that is
// ~2x slower than a plain cast; this loop moves one stick (a contiguous run
// of both tensors) at a time with the F16C/AVX-512 conversion instructions.
// Values are exactly torch's (fp16 -> fp32 is exact).
__attribute__((target("avx512f"))) static void half_to_float_avx512(const uint16_t* s, float* d,
                                                                    int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(h));
  }
  for (; i < n; ++i) d[i] = c10::detail::fp16_ieee_to_fp32_value(s[i]);
}

__attribute__((target("avx2,f16c"))) static void half_to_float_f16c(const uint16_t* s, float* d,
                                                                   int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) d[i] = c10::detail::fp16_ieee_to_fp32_value(s[i]);
}

static void half_to_float_scalar(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = c10::detail::fp16_ieee_to_fp32_value(s[i]);
}

using RunFn = void (*)(const uint16_t*, float*, int64_t);

static RunFn half_to_float_fn() {
  static RunFn fn = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &half_to_float_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
      return &half_to_float_f16c;
    }
    return &half_to_float_scalar;
  }();
  return fn;
}

// dst.copy_(src) for a contiguous dst and a src whose last dim is contiguous
// (a permuted view of device memory); fp16 -> fp32, or same dtype.
// Returns false (the caller falls back to copy_) for anything else.
bool stick_copy(const at::Tensor& src, at::Tensor& dst) {
  if (src.sizes() != dst.sizes() || !dst.is_contiguous() || src.dim() == 0 ||
      src.stride(-1) != 1 || src.device().type() != c10::DeviceType::CPU ||
      dst.device().type() != c10::DeviceType::CPU) {
    return false;
  }
  auto st = src.scalar_type(), dt = dst.scalar_type();
  RunFn run = nullptr;
  size_t same = 0;
  if (dt == at::kFloat && st == at::kHalf) run = half_to_float_fn();
  else if (dt == st) same = c10::elementSize(st);
  else return false;
  const int64_t inner = src.size(-1);
  const int64_t rows = inner == 0 ? 0 : src.numel() / inner;
  const int64_t nd = src.dim() - 1;
  auto sizes = src.sizes().vec();
  auto strides = src.strides().vec();
  const char* sbase = static_cast<const char*>(src.const_data_ptr());
  char* dbase = static_cast<char*>(dst.data_ptr());
  const int64_t ses = static_cast<int64_t>(c10::elementSize(st));
  const int64_t des = static_cast<int64_t>(c10::elementSize(dt));
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(inner, 1)),
                   [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> idx(nd, 0);
    int64_t rem = r0;
    for (int64_t d = nd - 1; d >= 0; --d) {  // row r0's coordinates
      idx[d] = rem % sizes[d];
      rem /= sizes[d];
    }
    int64_t off = 0;
    for (int64_t d = 0; d < nd; ++d) off += idx[d] * strides[d];
    for (int64_t r = r0; r < r1; ++r) {
      const char* sp = sbase + off * ses;
      char* dp = dbase + r * inner * des;
      if (run) run(reinterpret_cast<const uint16_t*>(sp), reinterpret_cast<float*>(dp), inner);
      else std::memcpy(dp, sp, static_cast<size_t>(inner) * same);
      for (int64_t d = nd - 1; d >= 0; --d) {  // next row: odometer
        off += strides[d];
        if (++idx[d] < sizes[d]) break;
        off -= strides[d] * sizes[d];
        idx[d] = 0;
      }
    }
  });
  return true;
}

}  // namespace spyre_card
