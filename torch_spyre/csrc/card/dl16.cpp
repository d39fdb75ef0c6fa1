// IBM's DL16 <-> fp32 bit conversions (torch_spyre/dl16.py has the format and
// the reference in torch ops; these loops compute the same bits, ~20x faster:
// a DL16 card converts every operand it reads and writes).
#include "card.h"

#include <ATen/Parallel.h>

#include "dl16.h"

namespace spyre_card {

// DL16 bits (int16) of fp32 `values` (contiguous)
at::Tensor dl16_encode(const at::Tensor& values) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() && values.is_cpu(),
              "dl16_encode: values must be a contiguous fp32 host tensor");
  at::Tensor out = at::empty(values.sizes(), values.options().dtype(at::kShort));
  const float* src = values.data_ptr<float>();
  int16_t* dst = out.data_ptr<int16_t>();
  at::parallel_for(0, values.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] = dl16_encode_one(src[i]);
  });
  return out;
}

// fp32 values of DL16 `bits` (int16, contiguous; NINF -> NaN)
at::Tensor dl16_decode(const at::Tensor& bits) {
  TORCH_CHECK(bits.scalar_type() == at::kShort && bits.is_contiguous() && bits.is_cpu(),
              "dl16_decode: bits must be a contiguous int16 host tensor");
  at::Tensor out = at::empty(bits.sizes(), bits.options().dtype(at::kFloat));
  const int16_t* src = bits.data_ptr<int16_t>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, bits.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) dst[i] = dl16_decode_one(src[i]);
  });
  return out;
}

}  // namespace spyre_card
