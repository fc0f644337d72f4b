// Decode attention that reads K/V straight from the paged pool: no gather, no padding, no mask.
//
// One query token per sequence. The pool is the engine's block-major tensor
//
//     kv_cache[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
//
// so key t of sequence b, kv head h, layer l lives at block block_tables[b][t / block_size], row t % block_size.
// Each (sequence, kv head) pair is one task: the query heads that share the kv head (GQA) are scored together,
// a block at a time, with an online softmax (running max and sum, rescaled once per block), in fp32 whatever
// the pool's dtype. Tasks run on torch's intra-op threads (at::parallel_for). A bf16 pool on an AVX512-BF16 CPU
// takes decode_task_fixed where the shape has a compile-time version (registers for the accumulators), else
// decode_task_avx512_bf16; an fp32 pool, or another CPU, the portable decode_task.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace {

using strata::exp_nonpositive;

inline float load(const float* p, int64_t i) { return p[i]; }

inline float load(const at::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline void store(float* p, int64_t i, float v) { p[i] = v; }

inline void store(at::BFloat16* p, int64_t i, float v) { p[i] = at::BFloat16(v); }

// Start the K and V rows of `layer` of a block coming from memory (a block's rows lie anywhere in the pool, so the
// hardware prefetcher cannot guess them): issued for block i+1 while block i is computed.
template <typename T>
inline void prefetch_block(const T* layer_k, const T* layer_v, int64_t offset, int64_t bytes) {
  const char* k = reinterpret_cast<const char*>(layer_k + offset);
  const char* v = reinterpret_cast<const char*>(layer_v + offset);
  for (int64_t line = 0; line < bytes; line += 64) {
    __builtin_prefetch(k + line);
    __builtin_prefetch(v + line);
  }
}

// One block of the online softmax for one query head: `scores` (rows of them) become e^(score - running max) in
// place; the running max and sum, and the head's accumulator `acc` (head_dim), are rescaled to the new max.
inline void softmax_block(float* scores, int64_t rows, bool first, float& running_max, float& running_sum,
                          float* acc, int64_t head_dim) {
  float block_max = first ? -std::numeric_limits<float>::max() : running_max;
  for (int64_t t = 0; t < rows; ++t) block_max = std::max(block_max, scores[t]);
  // the running sum and accumulator are 0 until the first block, so any finite rescale works there
  const float rescale = first ? 0.0f : exp_nonpositive(running_max - block_max);
  running_max = block_max;
  float sum = running_sum * rescale;
  for (int64_t d = 0; d < head_dim; ++d) acc[d] *= rescale;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < rows; ++t) {
    scores[t] = exp_nonpositive(scores[t] - block_max);
    sum += scores[t];
  }
  running_sum = sum;
}

// Query heads [0, heads) of one sequence, `group` of them per kv head: query head g reads kv head g / group.
// Every block's rows for these heads are used while they are in cache, so the pool streams from memory once.
template <typename T>
void decode_task(const T* q, const T* layer_k, const T* layer_v, int64_t block_stride, int64_t token_stride,
                 const int64_t* table, int64_t seq_len, int64_t block_size, int64_t heads, int64_t group,
                 int64_t head_dim, float scale, T* out, float* scratch) {
  // scratch: heads*head_dim query (fp32) + heads*head_dim accumulator + heads*block_size scores
  float* query = scratch;
  float* acc = query + heads * head_dim;
  float* scores = acc + heads * head_dim;
  std::vector<float> running_max(heads, 0.0f);
  std::vector<float> running_sum(heads, 0.0f);
  for (int64_t g = 0; g < heads; ++g) {
    for (int64_t d = 0; d < head_dim; ++d) query[g * head_dim + d] = load(q + g * head_dim, d) * scale;
  }
  std::fill(acc, acc + heads * head_dim, 0.0f);
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  const int64_t block_bytes = block_size * token_stride * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < num_blocks; ++i) {
    const int64_t base = table[i] * block_stride;
    const int64_t rows = std::min(block_size, seq_len - i * block_size);
    if (i + 1 < num_blocks) prefetch_block(layer_k, layer_v, table[i + 1] * block_stride, block_bytes);
    for (int64_t g = 0; g < heads; ++g) {
      const float* qg = query + g * head_dim;
      for (int64_t t = 0; t < rows; ++t) {
        const T* key = layer_k + base + t * token_stride + (g / group) * head_dim;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * load(key, d);
        scores[g * block_size + t] = dot;
      }
      float* ag = acc + g * head_dim;
      float* sg = scores + g * block_size;
      softmax_block(sg, rows, i == 0, running_max[g], running_sum[g], ag, head_dim);
      for (int64_t t = 0; t < rows; ++t) {
        const float p = sg[t];
        const T* value = layer_v + base + t * token_stride + (g / group) * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) ag[d] += p * load(value, d);
      }
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    const float inv = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) store(out + g * head_dim, d, acc[g * head_dim + d] * inv);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// decode_task for a bf16 pool on CPUs with AVX512-BF16 (head_dim a multiple of 32): q.k by VDPBF16PS straight from
// the bf16 query and key rows (each product exact in fp32, pairs summed in fp32, then scaled), one key row loaded
// once for every query head of its kv head; p.v in fp32 as above, each value row converted once for the group and
// the group's accumulators held in registers across the block. The online softmax is the generic one.
inline __m512 bf16x16_to_fp32(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

constexpr int64_t kMaxGroup = 16, kMaxChunks = 8;  // query heads per kv head; head_dim / 32

bool avx512_bf16_fits(int64_t group, int64_t head_dim) {
  return group <= kMaxGroup && head_dim % 32 == 0 && head_dim / 32 <= kMaxChunks;
}

void decode_task_avx512_bf16(const at::BFloat16* q, const at::BFloat16* layer_k, const at::BFloat16* layer_v,
                             int64_t block_stride, int64_t token_stride, const int64_t* table, int64_t seq_len,
                             int64_t block_size, int64_t heads, int64_t group, int64_t head_dim, float scale,
                             at::BFloat16* out, float* scratch) {
  const int64_t chunks = head_dim / 32, kv_heads = heads / group;
  float* acc = scratch;  // heads * head_dim
  float* scores = acc + heads * head_dim;  // heads * block_size
  std::vector<float> running_max(heads, 0.0f);
  std::vector<float> running_sum(heads, 0.0f);
  std::fill(acc, acc + heads * head_dim, 0.0f);
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  const int64_t block_bytes = block_size * token_stride * static_cast<int64_t>(sizeof(at::BFloat16));
  for (int64_t i = 0; i < num_blocks; ++i) {
    const int64_t base = table[i] * block_stride;
    const int64_t rows = std::min(block_size, seq_len - i * block_size);
    if (i + 1 < num_blocks) prefetch_block(layer_k, layer_v, table[i + 1] * block_stride, block_bytes);
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      __m512bh query[kMaxGroup][kMaxChunks];
      for (int64_t j = 0; j < group; ++j) {
        for (int64_t c = 0; c < chunks; ++c) {
          query[j][c] = (__m512bh)_mm512_loadu_si512(q + (kv * group + j) * head_dim + 32 * c);
        }
      }
      for (int64_t t = 0; t < rows; ++t) {
        const at::BFloat16* key = layer_k + base + t * token_stride + kv * head_dim;
        __m512bh key_chunks[kMaxChunks];
        for (int64_t c = 0; c < chunks; ++c) key_chunks[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
        for (int64_t j = 0; j < group; ++j) {
          __m512 dot = _mm512_setzero_ps();
          for (int64_t c = 0; c < chunks; ++c) dot = _mm512_dpbf16_ps(dot, query[j][c], key_chunks[c]);
          scores[(kv * group + j) * block_size + t] = _mm512_reduce_add_ps(dot) * scale;
        }
      }
    }
    for (int64_t g = 0; g < heads; ++g) {
      softmax_block(scores + g * block_size, rows, i == 0, running_max[g], running_sum[g], acc + g * head_dim,
                    head_dim);
    }
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      __m512 sums[kMaxGroup][2 * kMaxChunks];
      for (int64_t j = 0; j < group; ++j) {
        for (int64_t c = 0; c < 2 * chunks; ++c) sums[j][c] = _mm512_loadu_ps(acc + (kv * group + j) * head_dim + 16 * c);
      }
      for (int64_t t = 0; t < rows; ++t) {
        const at::BFloat16* value = layer_v + base + t * token_stride + kv * head_dim;
        __m512 value_chunks[2 * kMaxChunks];
        for (int64_t c = 0; c < 2 * chunks; ++c) value_chunks[c] = bf16x16_to_fp32(value + 16 * c);
        for (int64_t j = 0; j < group; ++j) {
          const __m512 p = _mm512_set1_ps(scores[(kv * group + j) * block_size + t]);
          for (int64_t c = 0; c < 2 * chunks; ++c) sums[j][c] = _mm512_fmadd_ps(p, value_chunks[c], sums[j][c]);
        }
      }
      for (int64_t j = 0; j < group; ++j) {
        for (int64_t c = 0; c < 2 * chunks; ++c) _mm512_storeu_ps(acc + (kv * group + j) * head_dim + 16 * c, sums[j][c]);
      }
    }
  }
  for (int64_t g = 0; g < heads; ++g) {
    const float inv = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;
    for (int64_t d = 0; d < head_dim; ++d) store(out + g * head_dim, d, acc[g * head_dim + d] * inv);
  }
}

// Sixteen vectors of dot-product partials (one per key) to one vector of their sums, lane i the sum of v[i]: pairs
// interleaved and added within 128-bit lanes, then 128-bit lanes exchanged and added (45 instructions in place of
// sixteen horizontal reductions and scalar stores).
inline __m512 sum16(const __m512* v) {
  __m512 pair[8], quad[4];
  for (int i = 0; i < 8; ++i) {  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] of keys 2i, 2i+1
    pair[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial of each of keys 4i..4i+3
    quad[i] = _mm512_add_ps(_mm512_shuffle_ps(pair[2 * i], pair[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm512_shuffle_ps(pair[2 * i], pair[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // 128-bit lanes (0, 2) and (1, 3) of two vectors side by side, added: 0x88 picks lanes 0, 2; 0xDD lanes 1, 3
  const __m512 low = _mm512_add_ps(_mm512_shuffle_f32x4(quad[0], quad[1], 0x88),
                                   _mm512_shuffle_f32x4(quad[0], quad[1], 0xDD));
  const __m512 high = _mm512_add_ps(_mm512_shuffle_f32x4(quad[2], quad[3], 0x88),
                                    _mm512_shuffle_f32x4(quad[2], quad[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(low, high, 0x88), _mm512_shuffle_f32x4(low, high, 0xDD));
}

// decode_task_avx512_bf16 with the shape known at compile time, G query heads per kv head, head_dim 32 * C, and a
// block_size that is a multiple of 16. One kv head at a time: its G queries and G x 2C fp32 accumulators stay in
// registers for the whole sequence (the runtime-shaped loops kept them in memory, a store-to-load chain per key).
// Per 16 keys: q.k by VDPBF16PS (a key row loaded once for the G heads), a head's 16 dot products summed into one
// vector (sum16), the online softmax on that vector (rows past the sequence masked), p.v in fp32 from value rows
// converted once for the G heads. The next block's rows of this kv head are prefetched two blocks ahead (rows
// lie anywhere in the pool). Same arithmetic as decode_task_avx512_bf16 up to the order of fp32 sums, and faster
// (README, "Engine speed on CPU").
template <int G, int C>
void decode_task_fixed(const at::BFloat16* q, const at::BFloat16* layer_k, const at::BFloat16* layer_v,
                       int64_t block_stride, int64_t token_stride, const int64_t* table, int64_t seq_len,
                       int64_t block_size, int64_t kv_heads, float scale, at::BFloat16* out) {
  constexpr int64_t D = 32 * C, kPrefetchDistance = 2;
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t num_blocks = (seq_len + block_size - 1) / block_size;
  for (int64_t kv = 0; kv < kv_heads; ++kv) {
    __m512bh query[G][C];
    __m512 acc[G][2 * C];
    float running_max[G], running_sum[G];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < C; ++c) query[g][c] = (__m512bh)_mm512_loadu_si512(q + (kv * G + g) * D + 32 * c);
      for (int c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_setzero_ps();
      running_max[g] = -std::numeric_limits<float>::infinity();
      running_sum[g] = 0.0f;
    }
    for (int64_t i = 0; i < num_blocks; ++i) {
      const int64_t base = table[i] * block_stride + kv * D;
      if (i + kPrefetchDistance < num_blocks) {
        const int64_t ahead = table[i + kPrefetchDistance] * block_stride + kv * D;
        for (int64_t t = 0; t < block_size; ++t) {
          for (int64_t line = 0; line < D * 2; line += 64) {
            __builtin_prefetch(reinterpret_cast<const char*>(layer_k + ahead + t * token_stride) + line);
            __builtin_prefetch(reinterpret_cast<const char*>(layer_v + ahead + t * token_stride) + line);
          }
        }
      }
      for (int64_t t0 = 0; t0 < block_size; t0 += 16) {
        const int64_t rows = std::min<int64_t>(16, seq_len - i * block_size - t0);
        if (rows <= 0) break;
        // q.k of 16 keys; rows past the sequence are scored from whatever the block holds, then masked
        __m512 dots[G][16];
        for (int t = 0; t < 16; ++t) {
          const at::BFloat16* key = layer_k + base + (t0 + t) * token_stride;
          __m512bh k[C];
          for (int c = 0; c < C; ++c) k[c] = (__m512bh)_mm512_loadu_si512(key + 32 * c);
          for (int g = 0; g < G; ++g) {
            __m512 dot = _mm512_dpbf16_ps(_mm512_setzero_ps(), query[g][0], k[0]);
            for (int c = 1; c < C; ++c) dot = _mm512_dpbf16_ps(dot, query[g][c], k[c]);
            dots[g][t] = dot;
          }
        }
        const __mmask16 valid = _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32(static_cast<int32_t>(rows)));
        alignas(64) float probs[G][16];
        for (int g = 0; g < G; ++g) {
          const __m512 s = _mm512_mask_mov_ps(minus_inf, valid, _mm512_mul_ps(sum16(dots[g]), vscale));
          const float new_max = std::max(running_max[g], _mm512_reduce_max_ps(s));
          const float rescale = exp_nonpositive(running_max[g] - new_max);  // ~0 at the first keys (max -inf)
          running_max[g] = new_max;
          const __m512 p =
              _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(s, _mm512_set1_ps(new_max))));
          running_sum[g] = running_sum[g] * rescale + _mm512_reduce_add_ps(p);
          _mm512_store_ps(probs[g], p);
          const __m512 r = _mm512_set1_ps(rescale);
          for (int c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], r);
        }
        for (int64_t t = 0; t < rows; ++t) {
          const at::BFloat16* value = layer_v + base + (t0 + t) * token_stride;
          __m512 v[2 * C];
          for (int c = 0; c < 2 * C; ++c) v[c] = bf16x16_to_fp32(value + 16 * c);
          for (int g = 0; g < G; ++g) {
            const __m512 p = _mm512_set1_ps(probs[g][t]);
            for (int c = 0; c < 2 * C; ++c) acc[g][c] = _mm512_fmadd_ps(p, v[c], acc[g][c]);
          }
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 inv = _mm512_set1_ps(running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f);
      for (int c = 0; c < 2 * C; ++c) {
        const __m256bh value = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], inv));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (kv * G + g) * D + 16 * c), (__m256i)value);
      }
    }
  }
}

using FixedTask = void (*)(const at::BFloat16*, const at::BFloat16*, const at::BFloat16*, int64_t, int64_t,
                           const int64_t*, int64_t, int64_t, int64_t, float, at::BFloat16*);

template <int C, int... Gs>
FixedTask pick_fixed(int64_t group, std::integer_sequence<int, Gs...>) {
  FixedTask found = nullptr;
  ((found = group == Gs + 1 ? &decode_task_fixed<Gs + 1, C> : found), ...);
  return found;
}

// The compile-time shape for this group, head_dim and block_size: G 1-8, head_dim 64 or 128, block_size a
// multiple of 16; nullptr for any other (decode_task_avx512_bf16 takes those).
FixedTask fixed_task(int64_t group, int64_t head_dim, int64_t block_size) {
  if (block_size % 16 != 0) return nullptr;
  if (head_dim == 64) return pick_fixed<2>(group, std::make_integer_sequence<int, 8>{});
  if (head_dim == 128) return pick_fixed<4>(group, std::make_integer_sequence<int, 8>{});
  return nullptr;
}
#endif

template <typename T>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& kv_cache, int64_t layer,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                           at::Tensor& out) {
  const int64_t batch = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_layers = kv_cache.size(1), block_size = kv_cache.size(3), num_kv_heads = kv_cache.size(4);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t token_stride = num_kv_heads * head_dim;
  const int64_t half = block_size * token_stride;          // K (or V) of one layer of one block
  const int64_t block_stride = num_layers * 2 * half;      // one block, every layer
  const T* pool = kv_cache.data_ptr<T>();
  const T* keys = pool + layer * 2 * half;
  const T* values = keys + half;
  const T* q = query.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t table_width = block_tables.size(1);
  const int64_t q_stride = query.stride(0), o_stride = out.stride(0);
  const float fscale = static_cast<float>(scale);
  // a task is a whole sequence (its K/V rows are contiguous in each block), unless there are fewer sequences
  // than threads: then each kv head of a sequence is a task of its own
  const int64_t splits = batch >= at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t kv_per_task = num_kv_heads / splits;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const FixedTask fixed = fixed_task(group, head_dim, block_size);
#endif
  at::parallel_for(0, batch * splits, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch((2 * head_dim + block_size) * kv_per_task * group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / splits, h = (task % splits) * kv_per_task;
#if defined(__AVX512BF16__) && defined(__AVX512F__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (fixed != nullptr) {
          fixed(q + b * q_stride + h * group * head_dim, keys + h * head_dim, values + h * head_dim, block_stride,
                token_stride, tables + b * table_width, lens[b], block_size, kv_per_task, fscale,
                o + b * o_stride + h * group * head_dim);
          continue;
        }
        if (avx512_bf16_fits(group, head_dim)) {
          decode_task_avx512_bf16(q + b * q_stride + h * group * head_dim, keys + h * head_dim,
                                  values + h * head_dim, block_stride, token_stride, tables + b * table_width,
                                  lens[b], block_size, kv_per_task * group, group, head_dim, fscale,
                                  o + b * o_stride + h * group * head_dim, scratch.data());
          continue;
        }
      }
#endif
      decode_task<T>(q + b * q_stride + h * group * head_dim, keys + h * head_dim, values + h * head_dim,
                     block_stride, token_stride, tables + b * table_width, lens[b], block_size,
                     kv_per_task * group, group, head_dim, fscale, o + b * o_stride + h * group * head_dim,
                     scratch.data());
    }
  });
}

}  // namespace

// query [B, H, D] (rows contiguous), kv_cache as above (contiguous), block_tables [B, W] int64, seq_lens [B]
// int64 (keys each row attends to, <= W * block_size), out [B, H, D] written.
void decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, int64_t layer,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor out) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [B, H, D] with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 6-d pool");
  TORCH_CHECK(kv_cache.size(5) == query.size(2), "head_dim of query and pool differ");
  TORCH_CHECK(query.size(1) % kv_cache.size(4) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "layer out of range");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.numel() == query.size(0), "seq_lens: int64 [B]");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == out.size(2), "out shape");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "query, pool and out must share a dtype");
  if (query.scalar_type() == at::kFloat) {
    decode_attention_impl<float>(query, kv_cache, layer, block_tables, seq_lens, scale, out);
  } else if (query.scalar_type() == at::kBFloat16) {
    decode_attention_impl<at::BFloat16>(query, kv_cache, layer, block_tables, seq_lens, scale, out);
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  }
}
