#include "losshead/kernels/dtype_convert.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace losshead::kernels {

uint16_t FloatToFp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t abs = x & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds past 65504
  if (abs < 0x38800000u) {
    // Subnormal half (or zero): shift the implicit-one mantissa into place, rounding to even.
    if (abs < 0x33000000u) return static_cast<uint16_t>(sign);
    const uint32_t exp = abs >> 23;
    const uint32_t mant = (abs & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - exp;  // 14..24
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (half & 1u))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = ((abs - 0x38000000u) >> 13);
  const uint32_t rem = abs & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (half & 1u))) ++half;
  return static_cast<uint16_t>(sign | half);
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0) {
    if (mant == 0) {
      bits = sign;
    } else {
      // Subnormal: value = mant * 2^-24, exact in fp32.
      const float f = static_cast<float>(mant) * 0x1p-24f;
      return sign ? -f : f;
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

void ToFloat(DType dtype, const void* src, float* dst, size_t count) {
  switch (dtype) {
    case DType::kFP32:
      std::memcpy(dst, src, count * sizeof(float));
      return;
    case DType::kBF16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = Bf16ToFloat(s[i]);
      return;
    }
    case DType::kFP16: {
      const auto* s = static_cast<const uint16_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = Fp16ToFloat(s[i]);
      return;
    }
  }
}

void FromFloat(DType dtype, const float* src, void* dst, size_t count) {
  switch (dtype) {
    case DType::kFP32:
      std::memcpy(dst, src, count * sizeof(float));
      return;
    case DType::kBF16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = FloatToBf16(src[i]);
      return;
    }
    case DType::kFP16: {
      auto* d = static_cast<uint16_t*>(dst);
      for (size_t i = 0; i < count; ++i) d[i] = FloatToFp16(src[i]);
      return;
    }
  }
}

namespace {

// True when some element of `s` has all exponent bits of `mask` set (Inf or NaN). The scan runs
// in blocks without an early exit inside a block, so that the compiler vectorises it: a 64 MiB
// micro-batch is checked at memory speed rather than one branch per element.
template <typename T>
bool AnyExponentAllOnes(const T* s, size_t count, T mask) {
  constexpr size_t kBlock = 4096;
  size_t i = 0;
  for (; i + kBlock <= count; i += kBlock) {
    T hit = 0;
    for (size_t j = 0; j < kBlock; ++j) hit |= static_cast<T>((s[i + j] & mask) == mask);
    if (hit != 0) return true;
  }
  T hit = 0;
  for (; i < count; ++i) hit |= static_cast<T>((s[i] & mask) == mask);
  return hit != 0;
}

// The largest of the magnitude bits (sign masked off) of `count` elements. With the sign bit
// clear the values are non-negative in the signed type, whose maximum SSE2 has for 16 bits; and
// for IEEE numbers the order of the magnitude bits is the order of the magnitudes, Inf and NaN
// above every finite one.
template <typename S, typename U>
U MaxMagnitudeBits(const U* s, size_t count, U mask) {
  S best = 0;
  for (size_t i = 0; i < count; ++i) best = std::max(best, static_cast<S>(s[i] & mask));
  return static_cast<U>(best);
}

}  // namespace

float MaxAbs(DType dtype, const void* src, size_t count) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  switch (dtype) {
    case DType::kFP32: {
      const uint32_t bits =
          MaxMagnitudeBits<int32_t>(static_cast<const uint32_t*>(src), count, 0x7fffffffu);
      if (bits >= 0x7f800000u) return kInf;
      float f;
      std::memcpy(&f, &bits, sizeof(f));
      return f;
    }
    case DType::kBF16: {
      const uint16_t bits =
          MaxMagnitudeBits<int16_t>(static_cast<const uint16_t*>(src), count, uint16_t{0x7fff});
      return bits >= 0x7f80u ? kInf : Bf16ToFloat(bits);
    }
    case DType::kFP16: {
      const uint16_t bits =
          MaxMagnitudeBits<int16_t>(static_cast<const uint16_t*>(src), count, uint16_t{0x7fff});
      return bits >= 0x7c00u ? kInf : Fp16ToFloat(bits);
    }
  }
  return kInf;
}

bool HasNonFinite(DType dtype, const void* src, size_t count) {
  switch (dtype) {
    case DType::kFP32:
      return AnyExponentAllOnes(static_cast<const uint32_t*>(src), count, uint32_t{0x7f800000u});
    case DType::kBF16:
      return AnyExponentAllOnes(static_cast<const uint16_t*>(src), count, uint16_t{0x7f80u});
    case DType::kFP16:
      return AnyExponentAllOnes(static_cast<const uint16_t*>(src), count, uint16_t{0x7c00u});
  }
  return false;
}

}  // namespace losshead::kernels
