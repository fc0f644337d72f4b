// The elementwise work of a decoder layer in one pass each, for a CPU forward: RMSNorm (with the residual add
// before it), RoPE with the K/V write into the paged pool, and SiLU(gate) * up.
//
// torch runs each of these as 4-9 ops, every one a pass over memory and a dispatch: at one decode row that is
// ~35 ops per layer of overhead, at 2,048 prefill rows a dozen passes over tensors of several MB. The results
// are those of the torch ops they replace (model.py's torch path, which is transformers' Llama op for op): the
// same operations, rounded to the tensor's dtype at the same points (a bf16 product is rounded to bf16 before it
// is used, as torch's bf16 ops do); only the order of the RMSNorm sum of squares differs (fp32 either way).
//
// Rows run on torch's intra-op threads (at::parallel_for); a one-row decode step stays on the calling thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

namespace {

using strata::exp_nonpositive;

inline float to_float(float v) { return v; }

inline float to_float(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

template <typename T>
inline T from_float(float v);

template <>
inline float from_float<float>(float v) { return v; }

// round to nearest even, as c10::BFloat16 does (NaN kept a quiet NaN); plain integer ops, so loops vectorize
template <>
inline at::BFloat16 from_float<at::BFloat16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits & 0x7fffffffu) > 0x7f800000u ? (bits | 0x00400000u)
                                                               : bits + 0x7fffu + ((bits >> 16) & 1u);
  return at::BFloat16(static_cast<uint16_t>(rounded >> 16), at::BFloat16::from_bits());
}

// a value as the tensor's dtype holds it: the rounding a torch op in that dtype applies to its result
template <typename T>
inline float rounded(float v) { return to_float(from_float<T>(v)); }

constexpr int64_t kLanes = 16;  // independent partial sums, so the sum of squares vectorizes

template <typename T>
void norm_row(const T* x, const T* weight, float eps, int64_t width, T* out) {
  float partial[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= width; i += kLanes) {
    for (int64_t j = 0; j < kLanes; ++j) {
      const float v = to_float(x[i + j]);
      partial[j] += v * v;
    }
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < kLanes; ++j) sum += partial[j];
  for (; i < width; ++i) sum += to_float(x[i]) * to_float(x[i]);
  const float inv = 1.0f / std::sqrt(sum / static_cast<float>(width) + eps);
  for (int64_t k = 0; k < width; ++k) {
    out[k] = from_float<T>(rounded<T>(to_float(x[k]) * inv) * to_float(weight[k]));
  }
}

// rows per task: enough work per thread that a step of a few rows runs without waking the others
inline int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, row_elements)); }

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out) {
  const int64_t rows = x.size(0), width = x.size(1);
  const T* src = x.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  const int64_t in_stride = x.stride(0), out_stride = out.stride(0);
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row<T>(src + r * in_stride, w, static_cast<float>(eps), width, dst + r * out_stride);
    }
  });
}

template <typename T>
void add_rms_norm_impl(at::Tensor& hidden, const at::Tensor& delta, const at::Tensor& weight, double eps,
                       at::Tensor& out) {
  const int64_t rows = hidden.size(0), width = hidden.size(1);
  T* h = hidden.data_ptr<T>();
  const T* d = delta.data_ptr<T>();
  const T* w = weight.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = h + r * width;
      const T* add = d + r * width;
      for (int64_t k = 0; k < width; ++k) row[k] = from_float<T>(to_float(row[k]) + to_float(add[k]));
      norm_row<T>(row, w, static_cast<float>(eps), width, dst + r * width);
    }
  });
}

template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out) {
  const int64_t rows = gate_up.size(0), width = out.size(1);
  const T* src = gate_up.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, rows, grain(2 * width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = src + r * 2 * width;
      const T* up = gate + width;
      T* row = dst + r * width;
      for (int64_t k = 0; k < width; ++k) {
        const float g = to_float(gate[k]);
        const float e = exp_nonpositive(-std::fabs(g));  // e^-|g|: silu(g) = g / (1 + e^-g), split by sign
        const float silu = (g >= 0.0f ? g : g * e) / (1.0f + e);
        row[k] = from_float<T>(rounded<T>(silu) * to_float(up[k]));
      }
    }
  });
}

// x * cos + rotate_half(x) * sin on one head, each product and the sum rounded to T as torch's ops round them
template <typename T>
inline void rope_head(const T* x, const T* cos, const T* sin, int64_t head_dim, T* out) {
  const int64_t half = head_dim / 2;
  for (int64_t d = 0; d < head_dim; ++d) {
    const float rotated = d < half ? -to_float(x[d + half]) : to_float(x[d - half]);
    const float a = rounded<T>(to_float(x[d]) * to_float(cos[d]));
    const float b = rounded<T>(rotated * to_float(sin[d]));
    out[d] = from_float<T>(a + b);
  }
}

template <typename T>
void rope_cache_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
                     int64_t kv_heads, at::Tensor& kv_cache, int64_t layer, const at::Tensor& slot_blocks,
                     const at::Tensor& slot_offsets, at::Tensor& q_out) {
  const int64_t rows = qkv.size(0), head_dim = cos.size(1);
  const int64_t num_layers = kv_cache.size(1), block_size = kv_cache.size(3);
  const int64_t token = kv_heads * head_dim;  // one token's K (or V) row in the pool
  const int64_t half = block_size * token, block_stride = num_layers * 2 * half;
  T* src = qkv.data_ptr<T>();
  T* pool = kv_cache.data_ptr<T>() + layer * 2 * half;
  T* q_dst = q_out.data_ptr<T>();
  const T* c = cos.data_ptr<T>();
  const T* s = sin.data_ptr<T>();
  const int64_t* blocks = slot_blocks.data_ptr<int64_t>();
  const int64_t* offsets = slot_offsets.data_ptr<int64_t>();
  const int64_t row_width = (heads + 2 * kv_heads) * head_dim;
  at::parallel_for(0, rows, grain(row_width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = src + r * row_width;
      const T* row_cos = c + r * head_dim;
      const T* row_sin = s + r * head_dim;
      for (int64_t h = 0; h < heads; ++h) {
        rope_head<T>(row + h * head_dim, row_cos, row_sin, head_dim, q_dst + (r * heads + h) * head_dim);
      }
      T* k = row + heads * head_dim;
      T tmp[512];  // head_dim <= 512 (checked): the rotated head before it replaces the input
      for (int64_t h = 0; h < kv_heads; ++h) {
        rope_head<T>(k + h * head_dim, row_cos, row_sin, head_dim, tmp);
        std::memcpy(k + h * head_dim, tmp, head_dim * sizeof(T));
      }
      T* slot = pool + blocks[r] * block_stride + offsets[r] * token;
      std::memcpy(slot, k, token * sizeof(T));              // K of this token, every kv head
      std::memcpy(slot + half, k + token, token * sizeof(T));  // V
    }
  });
}

bool is_2d_rows(const at::Tensor& t) { return t.dim() == 2 && t.stride(1) == 1; }

#define DISPATCH(tensor, name, ...)                                                   \
  if ((tensor).scalar_type() == at::kFloat) {                                         \
    using scalar = float;                                                             \
    __VA_ARGS__;                                                                      \
  } else if ((tensor).scalar_type() == at::kBFloat16) {                               \
    using scalar = at::BFloat16;                                                      \
    __VA_ARGS__;                                                                      \
  } else {                                                                            \
    TORCH_CHECK(false, name " supports float32 and bfloat16");                        \
  }

}  // namespace

// out = RMSNorm(x) * weight; x [T, H] and out [T, H] with contiguous rows, weight [H], all one dtype.
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out) {
  TORCH_CHECK(is_2d_rows(x) && is_2d_rows(out) && out.sizes() == x.sizes(), "rms_norm: x, out [T, H]");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1), "rms_norm: weight [H]");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type() && out.scalar_type() == x.scalar_type(), "rms_norm: dtype");
  DISPATCH(x, "rms_norm", rms_norm_impl<scalar>(x, weight, eps, out));
}

// hidden += delta (in place), then out = RMSNorm(hidden) * weight; all [T, H] contiguous except weight [H].
void add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight, double eps,
                  at::Tensor out) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && delta.is_contiguous() && out.is_contiguous(),
              "add_rms_norm: contiguous [T, H] tensors");
  TORCH_CHECK(delta.sizes() == hidden.sizes() && out.sizes() == hidden.sizes(), "add_rms_norm: shapes differ");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == hidden.size(1), "add_rms_norm: weight [H]");
  TORCH_CHECK(delta.scalar_type() == hidden.scalar_type() && weight.scalar_type() == hidden.scalar_type() &&
                  out.scalar_type() == hidden.scalar_type(),
              "add_rms_norm: dtype");
  DISPATCH(hidden, "add_rms_norm", add_rms_norm_impl<scalar>(hidden, delta, weight, eps, out));
}

// out = silu(gate) * up where gate_up [T, 2I] is gate then up (contiguous), out [T, I] contiguous.
void silu_mul(const at::Tensor& gate_up, at::Tensor out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && out.is_contiguous(), "silu_mul: contiguous");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == gate_up.size(0) && 2 * out.size(1) == gate_up.size(1),
              "silu_mul: out must be [T, I] for gate_up [T, 2I]");
  TORCH_CHECK(out.scalar_type() == gate_up.scalar_type(), "silu_mul: dtype");
  DISPATCH(gate_up, "silu_mul", silu_mul_impl<scalar>(gate_up, out));
}

// qkv [T, (H + 2*Hkv)*D] contiguous: q heads, k heads, v heads. RoPE (cos, sin [T, D], per row) rotates the q
// heads into q_out [T, H, D] and the k heads in place; row t's K and V go to block slot_blocks[t], row
// slot_offsets[t] of `layer` in kv_cache [blocks, layers, 2, block_size, Hkv, D].
void rope_cache(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                at::Tensor kv_cache, int64_t layer, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                at::Tensor q_out) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous(), "rope_cache: qkv must be contiguous [T, (H+2Hkv)*D]");
  TORCH_CHECK(cos.dim() == 2 && cos.is_contiguous() && sin.is_contiguous() && sin.sizes() == cos.sizes() &&
                  cos.size(0) == qkv.size(0),
              "rope_cache: cos, sin [T, D]");
  const int64_t head_dim = cos.size(1);
  TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 512, "rope_cache: head_dim must be even and <= 512");
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * head_dim, "rope_cache: qkv width");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous() && kv_cache.size(4) == kv_heads &&
                  kv_cache.size(5) == head_dim,
              "rope_cache: kv_cache [blocks, layers, 2, block_size, Hkv, D]");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "rope_cache: layer out of range");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous() &&
                  slot_blocks.numel() == qkv.size(0) && slot_offsets.numel() == qkv.size(0),
              "rope_cache: slot_blocks, slot_offsets int64 [T]");
  TORCH_CHECK(q_out.is_contiguous() && q_out.numel() == qkv.size(0) * heads * head_dim, "rope_cache: q_out");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type() &&
                  kv_cache.scalar_type() == qkv.scalar_type() && q_out.scalar_type() == qkv.scalar_type(),
              "rope_cache: dtype");
  DISPATCH(qkv, "rope_cache",
           rope_cache_impl<scalar>(qkv, cos, sin, heads, kv_heads, kv_cache, layer, slot_blocks, slot_offsets,
                                   q_out));
}
