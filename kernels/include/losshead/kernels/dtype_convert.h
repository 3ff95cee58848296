// Host-side conversions between the wire/storage dtypes and fp32.
#ifndef LOSSHEAD_KERNELS_DTYPE_CONVERT_H_
#define LOSSHEAD_KERNELS_DTYPE_CONVERT_H_

#include <cstdint>
#include <cstring>

#include "losshead/kernels/problem.h"

namespace losshead::kernels {

// bf16 is the top half of an fp32; rounding to nearest-even, NaN kept quiet.
inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline float Bf16ToFloat(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// IEEE binary16, round to nearest-even, overflow to infinity.
uint16_t FloatToFp16(float f);
float Fp16ToFloat(uint16_t h);

// Converts `count` elements of `dtype` at `src` to fp32.
void ToFloat(DType dtype, const void* src, float* dst, size_t count);
// Converts `count` fp32 values to `dtype` at `dst`.
void FromFloat(DType dtype, const float* src, void* dst, size_t count);
// True if any of `count` elements of `dtype` at `src` is NaN or infinite.
bool HasNonFinite(DType dtype, const void* src, size_t count);
// The largest |x| of `count` elements of `dtype` at `src` (0 for none), as fp32; +Inf when one is
// NaN or infinite. One pass at memory speed (integer maxima of the magnitude bits): the receiver
// takes it of every micro-batch's hidden states, which bound what the micro-batch computes
// (step_bound.h).
float MaxAbs(DType dtype, const void* src, size_t count);

}  // namespace losshead::kernels

#endif  // LOSSHEAD_KERNELS_DTYPE_CONVERT_H_
