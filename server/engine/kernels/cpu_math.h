// Arithmetic shared by the CPU kernels (paged_attention.cpp, fused_ops.cpp).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace strata {

// e^x for x <= 0 (scores minus their running max), relative error under 2e-7: x = n ln2 + r with |r| <= ln2/2,
// e^r by a degree-6 Taylor polynomial, 2^n put in the exponent bits. Plain arithmetic, so the loops that call it
// vectorize (std::exp is a scalar libm call per score, and was most of the kernel's time).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);  // below this e^x is under FLT_MIN: treat as the smallest normal, which sums as 0
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693145751953125f - n * 1.42860682030941723e-6f;  // ln2 split in two for accuracy
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

}  // namespace strata
