// IBM's DL16 format, one value at a time (torch_spyre/dl16.py has the
// format and the reference in torch ops; these compute the same bits).
#pragma once

#include <cstdint>
#include <cstring>

namespace spyre_card {

// the DL16 bias is 31, fp32's 127
constexpr int32_t kBiasShift = 127 - 31;
constexpr int32_t kNinf = 0x7FFF;
// largest fp32 magnitude bits that round to a finite DL16 value
constexpr int32_t kNmax32 = ((63 + kBiasShift) << 23) | (510 << 14) | ((1 << 13) - 1);

inline int16_t dl16_encode_one(float v) {
  int32_t b;
  std::memcpy(&b, &v, 4);
  int32_t sign = (b >> 31) & 1;
  int32_t mag = b & 0x7FFFFFFF;
  int32_t e = ((b >> 23) & 0xFF) - kBiasShift;
  int32_t frac = (b & 0x7FFFFF) + (1 << 13);  // + half an ulp of the 9-bit fraction
  if (frac > 0x7FFFFF) {
    e += 1;
    frac = 0;
  }
  int32_t out = (e >= 0 && mag <= kNmax32) ? ((e << 9) | (frac >> 14)) : (e >= 0 ? kNinf : 0);
  return static_cast<int16_t>(out | (sign << 15));
}

inline float dl16_decode_one(int16_t bits) {
  uint32_t u = static_cast<uint32_t>(static_cast<uint16_t>(bits));
  uint32_t sign = (u >> 15) << 31;
  uint32_t mag = u & 0x7FFF;
  uint32_t b;
  if (mag == 0) {
    b = sign;
  } else if (mag == static_cast<uint32_t>(kNinf)) {
    b = sign | 0x7FC00000u;
  } else {
    b = sign | (((mag >> 9) + kBiasShift) << 23) | ((mag & 0x1FF) << 14);
  }
  float v;
  std::memcpy(&v, &b, 4);
  return v;
}

}  // namespace spyre_card
