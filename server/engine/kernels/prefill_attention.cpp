// Prefill attention in bf16: one prompt chunk's query rows attend causally to their sequence's keys in the paged
// pool (the cached prefix and the chunk's own rows, which rope_cache has already written there), bf16 in, fp32
// scores and softmax, bf16 out. No gather into a contiguous copy, no mask tensor.
//
// The pool is the engine's block-major tensor (see paged_attention.cpp)
//
//     kv_cache[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]
//
// Two phases, each over torch's intra-op threads:
//
// 1. Pack. The chunk's keys 0..N-1 of each kv head are copied once into pairs of bf16 in one dword ("VNNI"), the
//    B operand of both TDPBF16PS (AMX) and VDPBF16PS (AVX512-BF16):
//      K^T: per 16 keys, [head_dim/2 dword rows][16 keys]: row p holds dims 2p, 2p+1 of each key (a transpose);
//      V:   per 32 keys and 16 dims, [16 key-pair rows][16 dims x 2]: row r interleaves keys 2r and 2r+1.
//    Keys past N are zero (they are masked, and 0 * V must not be NaN).
// 2. Attend. A task is 16 query rows of one head (GQA: its kv head's packed K/V). Per step of up to 128 keys:
//    S = Q K^T in fp32, causally masked in AVX-512 registers, online softmax (running max and sum per row), P
//    rounded to bf16 (as torch's flash attention rounds it), O = O*alpha + P V. Steps past a row block's last
//    position are never computed. Tasks are taken longest first from a shared counter, so the causal triangle
//    spreads evenly over the threads.
//
// The two products run on one of two instruction sets, with the same packing, softmax and rounding:
//   amx          16x16 tiles (TDPBF16PS), where the compiler targets AMX-BF16 and Linux grants the tile state;
//   avx512_bf16  VDPBF16PS on 16-lane registers, 4 query rows x 64 keys (S) or 64 dims (P V) per block of
//                16 accumulators, the A operand a broadcast dword of Q or P (AVX512-BF16 CPUs without AMX, e.g.
//                AMD Zen 4/5).
// Built where the compiler targets AVX512-BF16 (-march=native on such a CPU); elsewhere `prefill_attention`
// raises, `prefill_attention_isas()` is empty, and the engine keeps torch's SDPA.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define STRATA_BF16 1
#include <immintrin.h>

#include "cpu_math.h"
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define STRATA_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif
#endif

namespace {

// keys of one sub-block: one P tile (32 bf16 columns), two score tiles, the unit the K/V are packed in
constexpr int64_t kSub = 32;

// Keys rounded up to whole sub-blocks, and the bytes of one packed copy (K or V, bf16) of that many keys.
inline int64_t padded_keys(int64_t keys) { return (keys + kSub - 1) / kSub * kSub; }
inline int64_t packed_bytes(int64_t keys, int64_t num_kv_heads, int64_t head_dim) {
  return num_kv_heads * padded_keys(keys) * head_dim * 2;
}

#if defined(STRATA_BF16)

constexpr int64_t kRows = 16;  // query rows per task: one tile's rows
constexpr int64_t kStep = 128;  // keys per online-softmax step: up to 4 sub-blocks

#if defined(STRATA_AMX)
// The tile configuration (palette 1): every tile used is 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process AMX's tile state only once it asks (arch_prctl); once granted it holds for every thread.
bool amx_permitted() {
  static const bool granted = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}
#endif

struct Geometry {
  int64_t head_dim, num_heads, num_kv_heads, block_size, token_stride, block_stride;
  int64_t keys, padded_keys;  // N keys attended by the chunk's last row; N rounded up to kSub
};

// Phase 1 for one kv head and one step of 32 keys: K^T dwords and interleaved V rows into the packed buffers.
void pack_step(const at::BFloat16* layer_k, const at::BFloat16* layer_v, const int64_t* table, const Geometry& g,
               int64_t kv_head, int64_t step, uint32_t* packed_k, uint16_t* packed_v) {
  const int64_t dwords = g.head_dim / 2;
  const int64_t first = step * kSub;
  // K^T: two groups of 16 keys, each [dwords][16]
  uint32_t* kt = packed_k + (kv_head * g.padded_keys + first) * dwords;
  for (int64_t j = 0; j < kSub; ++j) {
    const int64_t key = first + j;
    uint32_t* column = kt + (j / 16) * dwords * 16 + (j % 16);
    if (key >= g.keys) {
      for (int64_t p = 0; p < dwords; ++p) column[p * 16] = 0;
      continue;
    }
    const int64_t offset = table[key / g.block_size] * g.block_stride + (key % g.block_size) * g.token_stride;
    const uint32_t* row = reinterpret_cast<const uint32_t*>(layer_k + offset + kv_head * g.head_dim);
    for (int64_t p = 0; p < dwords; ++p) column[p * 16] = row[p];
  }
  // V: [head_dim/16 tiles][16 key pairs][32 bf16]; row r of a tile is (key 2r, key 2r+1) per dim, interleaved
  const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                       6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  uint16_t* vp = packed_v + (kv_head * g.padded_keys + first) * g.head_dim;
  for (int64_t r = 0; r < kSub / 2; ++r) {
    for (int64_t d = 0; d < g.head_dim; d += 32) {
      __m512i rows[2];
      for (int e = 0; e < 2; ++e) {
        const int64_t key = first + 2 * r + e;
        if (key >= g.keys) {
          rows[e] = _mm512_setzero_si512();
          continue;
        }
        const int64_t offset = table[key / g.block_size] * g.block_stride + (key % g.block_size) * g.token_stride;
        rows[e] = _mm512_loadu_si512(layer_v + offset + kv_head * g.head_dim + d);
      }
      // dims d..d+15 go to tile d/16, dims d+16..d+31 to tile d/16 + 1
      _mm512_storeu_si512(vp + ((d / 16) * 16 + r) * 32, _mm512_permutex2var_epi16(rows[0], low, rows[1]));
      _mm512_storeu_si512(vp + ((d / 16 + 1) * 16 + r) * 32, _mm512_permutex2var_epi16(rows[0], high, rows[1]));
    }
  }
}

#if defined(STRATA_AMX)
// S for the 32-key sub-blocks `sub` and (if `two`) sub + 1 of a step: tiles 0, 1 (and 2, 3) of 16 keys each,
// Q in 32-dim slices in tile 4, K^T in tiles 5 and 6; stored into scores[16][kStep] at the sub-block's columns.
inline void score_pair(const uint16_t* q, const uint32_t* kt, int64_t key0, int64_t sub, bool two, int64_t d,
                       float* scores) {
  const int64_t dwords = d / 2;
  const uint32_t* k = kt + (key0 + sub * kSub) * dwords;
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t slice = 0; slice < d / 32; ++slice) {
    _tile_loadd(4, q + slice * 32, d * sizeof(uint16_t));
    _tile_loadd(5, k + slice * 16 * 16, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, k + 16 * dwords + slice * 16 * 16, 64);
    _tile_dpbf16ps(1, 4, 6);
    if (two) {
      _tile_loadd(5, k + kSub * dwords + slice * 16 * 16, 64);
      _tile_dpbf16ps(2, 4, 5);
      _tile_loadd(6, k + kSub * dwords + 16 * dwords + slice * 16 * 16, 64);
      _tile_dpbf16ps(3, 4, 6);
    }
  }
  float* out = scores + sub * kSub;
  _tile_stored(0, out, kStep * sizeof(float));
  _tile_stored(1, out + 16, kStep * sizeof(float));
  if (two) {
    _tile_stored(2, out + kSub, kStep * sizeof(float));
    _tile_stored(3, out + kSub + 16, kStep * sizeof(float));
  }
}

// O[16][d] = O * alpha + P V for one step (AMX): 64 dims (4 tiles: 0-3) at a time; P of a sub-block in tile 4,
// V in tiles 5, 6, 7; the product lands in `pv` and is added to the fp32 accumulator in AVX-512
inline void amx_pv_step(const uint16_t* probs, const uint16_t* vp, int64_t key0, int64_t subs, int64_t d,
                        const float* alpha, float* acc) {
  alignas(64) float pv[16 * 64];
  for (int64_t group = 0; group < d / 64; ++group) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t sub = 0; sub < subs; ++sub) {
      const uint16_t* v = vp + (key0 + sub * kSub) * d + group * 4 * 16 * 32;
      _tile_loadd(4, probs + sub * kSub, kStep * sizeof(uint16_t));
      _tile_loadd(5, v, 64);
      _tile_dpbf16ps(0, 4, 5);
      _tile_loadd(6, v + 16 * 32, 64);
      _tile_dpbf16ps(1, 4, 6);
      _tile_loadd(7, v + 2 * 16 * 32, 64);
      _tile_dpbf16ps(2, 4, 7);
      _tile_loadd(5, v + 3 * 16 * 32, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, pv, 64 * sizeof(float));
    _tile_stored(1, pv + 16, 64 * sizeof(float));
    _tile_stored(2, pv + 32, 64 * sizeof(float));
    _tile_stored(3, pv + 48, 64 * sizeof(float));
    for (int64_t r = 0; r < kRows; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      float* o = acc + r * d + group * 64;
      for (int64_t c = 0; c < 64; c += 16) {
        _mm512_store_ps(o + c, _mm512_fmadd_ps(_mm512_load_ps(o + c), a, _mm512_load_ps(pv + r * 64 + c)));
      }
    }
  }
}
#endif  // STRATA_AMX

// The same two products on AVX512-BF16 registers. VDPBF16PS adds, per fp32 lane, the products of one dword pair
// of bf16: the B operand is a packed row (16 keys' dims 2p, 2p+1 for S; 16 dims of keys 2r, 2r+1 for P V), the
// A operand one query's (or one probability row's) dword broadcast to every lane. A block is 4 rows x 4 vectors,
// 16 independent accumulators, enough to cover the instruction's latency at two per cycle.
inline __m512 dp(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// S[4 rows][16 * NG keys] = Q K^T: q the rows' dwords (stride q_dwords), k the first 16-key group's K^T.
template <int NG>
inline void vec_score_block(const uint32_t* q, int64_t q_dwords, const uint32_t* k, int64_t dwords, float* out) {
  __m512 acc[4][NG];
  for (int r = 0; r < 4; ++r)
    for (int g = 0; g < NG; ++g) acc[r][g] = _mm512_setzero_ps();
  for (int64_t p = 0; p < dwords; ++p) {
    __m512i b[NG];
    for (int g = 0; g < NG; ++g) b[g] = _mm512_load_si512(k + g * dwords * 16 + p * 16);
    for (int r = 0; r < 4; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(q[r * q_dwords + p]));
      for (int g = 0; g < NG; ++g) acc[r][g] = dp(acc[r][g], a, b[g]);
    }
  }
  for (int r = 0; r < 4; ++r)
    for (int g = 0; g < NG; ++g) _mm512_store_ps(out + r * kStep + g * 16, acc[r][g]);
}

// S[16][subs * 32 keys] of one step, into scores[16][kStep] (AVX512-BF16).
inline void vec_score_step(const uint16_t* q, const uint32_t* kt, int64_t key0, int64_t subs, int64_t d,
                           float* scores) {
  const int64_t dwords = d / 2, groups = subs * 2;  // 16-key groups: 2, 4, 6 or 8
  const uint32_t* qd = reinterpret_cast<const uint32_t*>(q);
  for (int64_t r0 = 0; r0 < kRows; r0 += 4) {
    int64_t g0 = 0;
    for (; g0 + 4 <= groups; g0 += 4) {
      vec_score_block<4>(qd + r0 * dwords, dwords, kt + (key0 + g0 * 16) * dwords, dwords,
                         scores + r0 * kStep + g0 * 16);
    }
    if (g0 < groups) {
      vec_score_block<2>(qd + r0 * dwords, dwords, kt + (key0 + g0 * 16) * dwords, dwords,
                         scores + r0 * kStep + g0 * 16);
    }
  }
}

// O[16][d] = O * alpha + P V for one step (AVX512-BF16): per 4 rows and 64 dims, the accumulators start from the
// rescaled O and take every key pair of the step's sub-blocks.
inline void vec_pv_step(const uint16_t* probs, const uint16_t* vp, int64_t key0, int64_t subs, int64_t d,
                        const float* alpha, float* acc) {
  const uint32_t* pd = reinterpret_cast<const uint32_t*>(probs);
  constexpr int64_t kProbDwords = kStep / 2;
  for (int64_t r0 = 0; r0 < kRows; r0 += 4) {
    for (int64_t t0 = 0; t0 < d / 16; t0 += 4) {  // four 16-dim vectors: 64 dims
      __m512 o[4][4];
      for (int r = 0; r < 4; ++r) {
        const __m512 a = _mm512_set1_ps(alpha[r0 + r]);
        for (int t = 0; t < 4; ++t) o[r][t] = _mm512_mul_ps(_mm512_load_ps(acc + (r0 + r) * d + (t0 + t) * 16), a);
      }
      for (int64_t sub = 0; sub < subs; ++sub) {
        const uint16_t* v = vp + (key0 + sub * kSub) * d;
        for (int64_t pair = 0; pair < kSub / 2; ++pair) {
          __m512i b[4];
          for (int t = 0; t < 4; ++t) b[t] = _mm512_load_si512(v + ((t0 + t) * 16 + pair) * 32);
          for (int r = 0; r < 4; ++r) {
            const __m512i a =
                _mm512_set1_epi32(static_cast<int32_t>(pd[(r0 + r) * kProbDwords + sub * (kSub / 2) + pair]));
            for (int t = 0; t < 4; ++t) o[r][t] = dp(o[r][t], a, b[t]);
          }
        }
      }
      for (int r = 0; r < 4; ++r)
        for (int t = 0; t < 4; ++t) _mm512_store_ps(acc + (r0 + r) * d + (t0 + t) * 16, o[r][t]);
    }
  }
}

// Phase 2: one task, query rows [row0, row0 + valid) of head `head`, at positions context_len + row; the products
// on AMX tiles (kAmx) or AVX512-BF16 registers.
template <bool kAmx>
void attend_task(const at::BFloat16* query, int64_t q_stride, const uint32_t* packed_k, const uint16_t* packed_v,
                 const Geometry& g, int64_t context_len, int64_t head, int64_t row0, int64_t valid, float scale,
                 at::BFloat16* out, int64_t o_stride) {
  const int64_t d = g.head_dim;
  const int64_t kv_head = head / (g.num_heads / g.num_kv_heads);
  alignas(64) uint16_t q[kRows * 128];        // the task's query rows, zero past `valid`
  alignas(64) float scores[2][kRows * kStep];  // this step's S and the next one's
  alignas(64) uint16_t probs[kRows * kStep];  // P in bf16: the A operand of P V
  alignas(64) float acc[kRows * 128];         // O, fp32
  float running_max[kRows], running_sum[kRows], alpha[kRows];
  int64_t last_key[kRows];                    // the last key each row may see
  for (int64_t r = 0; r < kRows; ++r) {
    const int64_t row = row0 + std::min(r, valid - 1);
    std::memcpy(q + r * d, query + row * q_stride + head * d, d * sizeof(uint16_t));
    if (r >= valid) std::memset(q + r * d, 0, d * sizeof(uint16_t));
    last_key[r] = context_len + row;
    running_max[r] = -std::numeric_limits<float>::infinity();
    running_sum[r] = 0.0f;
  }
  std::memset(acc, 0, sizeof(float) * kRows * d);
  const uint32_t* kt = packed_k + kv_head * g.padded_keys * (d / 2);
  const uint16_t* vp = packed_v + kv_head * g.padded_keys * d;
  const float scale_log2e = scale * 1.44269504088896341f;
  const __m512 vscale_log2e = _mm512_set1_ps(scale_log2e);
  const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const int64_t last = last_key[kRows - 1];
  // a step's 32-key sub-blocks: up to kStep / kSub, fewer at the diagonal (no fully masked sub-block)
  auto sub_blocks = [&](int64_t key0) { return std::min(kStep / kSub, (last - key0) / kSub + 1); };
  auto score_step = [&](int64_t key0, float* out) {
    const int64_t subs = sub_blocks(key0);
#if defined(STRATA_AMX)
    if constexpr (kAmx) {
      for (int64_t sub = 0; sub < subs; sub += 2) score_pair(q, kt, key0, sub, sub + 1 < subs, d, out);
      return;
    }
#endif
    vec_score_step(q, kt, key0, subs, d, out);
  };
  score_step(0, scores[0]);
  for (int64_t key0 = 0, step = 0; key0 <= last; key0 += kStep, ++step) {
    const int64_t subs = sub_blocks(key0);
    // the next step's S is issued before this step's softmax reads its own: the tile stores have landed by
    // then, and the tile unit works while the vector units do the softmax
    if (key0 + kStep <= last) score_step(key0 + kStep, scores[(step + 1) & 1]);
    // online softmax, a row at a time, in raw score units (the scale is folded into e^x's argument): mask past
    // the row's position, max, P = 2^((s - max) * scale * log2 e) in bf16, sum
    // two passes over the rows, so that one row's chain (max, reduction, e^x of the max's change) overlaps the
    // next rows' independent work instead of stalling on it
    const int64_t vectors = subs * kSub / 16;
    bool crosses[kRows];
    for (int64_t r = 0; r < kRows; ++r) {
      float* row = scores[step & 1] + r * kStep;
      crosses[r] = key0 + vectors * 16 - 1 > last_key[r];
      __m512 vmax = minus_inf;
      if (crosses[r]) {
        const __m512i limit = _mm512_set1_epi32(static_cast<int32_t>(last_key[r] - key0));
        for (int64_t j = 0; j < vectors; ++j) {
          const __mmask16 keep = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(j * 16)), limit);
          const __m512 s = _mm512_mask_mov_ps(minus_inf, keep, _mm512_load_ps(row + j * 16));
          _mm512_store_ps(row + j * 16, s);
          vmax = _mm512_max_ps(vmax, s);
        }
      } else {
        for (int64_t j = 0; j < vectors; ++j) vmax = _mm512_max_ps(vmax, _mm512_load_ps(row + j * 16));
      }
      const float new_max = std::max(running_max[r], _mm512_reduce_max_ps(vmax));
      alpha[r] = strata::exp_nonpositive((running_max[r] - new_max) * scale);  // 0 at the first step (max -inf)
      running_max[r] = new_max;
    }
    for (int64_t r = 0; r < kRows; ++r) {
      const float* row = scores[step & 1] + r * kStep;
      const __m512 offset = _mm512_set1_ps(running_max[r] * scale_log2e);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < vectors; j += 2) {
        const __m512 s0 = _mm512_load_ps(row + j * 16), s1 = _mm512_load_ps(row + j * 16 + 16);
        __m512 p0 = strata::exp2_nonpositive(_mm512_fmsub_ps(s0, vscale_log2e, offset));
        __m512 p1 = strata::exp2_nonpositive(_mm512_fmsub_ps(s1, vscale_log2e, offset));
        if (crosses[r]) {  // a masked score is -inf, its e^x NaN: zeroed so that it adds nothing
          p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, minus_inf, _CMP_NEQ_OQ), p0);
          p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, minus_inf, _CMP_NEQ_OQ), p1);
        }
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        _mm512_store_si512(probs + r * kStep + j * 16, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));  // p0 low half
      }
      running_sum[r] = running_sum[r] * alpha[r] + _mm512_reduce_add_ps(sum);
    }
    // O = O * alpha + P V
#if defined(STRATA_AMX)
    if constexpr (kAmx) {
      amx_pv_step(probs, vp, key0, subs, d, alpha, acc);
      continue;
    }
#endif
    vec_pv_step(probs, vp, key0, subs, d, alpha, acc);
  }
  for (int64_t r = 0; r < valid; ++r) {
    const __m512 inv = _mm512_set1_ps(1.0f / running_sum[r]);
    at::BFloat16* o = out + (row0 + r) * o_stride + head * d;
    for (int64_t c = 0; c < d; c += 16) {
      const __m256bh value = _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(acc + r * d + c), inv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), (__m256i)value);
    }
  }
}

#endif  // STRATA_BF16

}  // namespace

// The instruction sets this build can run the products on, here, best first: "amx" (built for AMX-BF16 and
// Linux granted the tile state), "avx512_bf16" (any AVX512-BF16 build); empty where neither was built.
std::vector<std::string> prefill_attention_isas() {
  std::vector<std::string> isas;
#if defined(STRATA_AMX)
  if (amx_permitted()) isas.emplace_back("amx");
#endif
#if defined(STRATA_BF16)
  isas.emplace_back("avx512_bf16");
#endif
  return isas;
}

bool prefill_attention_available() { return !prefill_attention_isas().empty(); }

// query [T, H, D] bf16 (heads contiguous), kv_cache the bf16 pool (contiguous) holding this chunk's K/V already,
// block_table [nb] int64 covering context_len + T keys, out [T, H, D] bf16 written; workspace uint8 of at least
// prefill_workspace_bytes(...) bytes (the packed K/V, reused between calls); isa one of prefill_attention_isas(),
// or "" for the first of them.
void prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, int64_t layer,
                       const at::Tensor& block_table, int64_t context_len, double scale, at::Tensor out,
                       at::Tensor workspace, const std::string& isa) {
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1 && query.stride(1) == query.size(2),
              "query must be [T, H, D] with contiguous heads");
  TORCH_CHECK(kv_cache.dim() == 6 && kv_cache.is_contiguous(), "kv_cache must be a contiguous 6-d pool");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && kv_cache.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "prefill_attention is bf16 only");
  const int64_t tokens = query.size(0), heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(kv_cache.size(5) == head_dim, "head_dim of query and pool differ");
  TORCH_CHECK(head_dim % 64 == 0 && head_dim <= 128, "prefill_attention needs head_dim 64 or 128");
  TORCH_CHECK(heads % kv_cache.size(4) == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(layer >= 0 && layer < kv_cache.size(1), "layer out of range");
  TORCH_CHECK(context_len >= 0 && tokens >= 1, "need at least one query row and context_len >= 0");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 && block_table.is_contiguous(),
              "block_table: int64 [nb]");
  TORCH_CHECK(block_table.size(0) * kv_cache.size(3) >= context_len + tokens, "block_table too short");
  TORCH_CHECK(out.sizes() == query.sizes() && out.stride(2) == 1 && out.stride(1) == head_dim, "out shape");
  TORCH_CHECK(workspace.scalar_type() == at::kByte && workspace.is_contiguous(), "workspace: uint8");
#if defined(STRATA_BF16)
  const std::vector<std::string> isas = prefill_attention_isas();
  const std::string chosen = isa.empty() ? isas.front() : isa;
  TORCH_CHECK(std::find(isas.begin(), isas.end(), chosen) != isas.end(), "prefill_attention: isa '", chosen,
              "' is not available here (", isas.size(), " available)");
  const bool amx = chosen == "amx";
  const int64_t kv_heads = kv_cache.size(4), block_size = kv_cache.size(3), num_layers = kv_cache.size(1);
  Geometry g;
  g.head_dim = head_dim;
  g.num_heads = heads;
  g.num_kv_heads = kv_heads;
  g.block_size = block_size;
  g.token_stride = kv_heads * head_dim;
  g.block_stride = num_layers * 2 * block_size * g.token_stride;
  g.keys = context_len + tokens;
  g.padded_keys = padded_keys(g.keys);
  const int64_t k_bytes = packed_bytes(g.keys, kv_heads, head_dim);
  TORCH_CHECK(workspace.numel() >= 2 * k_bytes, "workspace too small");
  uint32_t* packed_k = reinterpret_cast<uint32_t*>(workspace.data_ptr<uint8_t>());
  uint16_t* packed_v = reinterpret_cast<uint16_t*>(workspace.data_ptr<uint8_t>() + k_bytes);
  const at::BFloat16* pool = kv_cache.data_ptr<at::BFloat16>();
  const int64_t half = block_size * g.token_stride;
  const at::BFloat16* layer_k = pool + layer * 2 * half;
  const at::BFloat16* layer_v = layer_k + half;
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t steps = g.padded_keys / kSub;
  at::parallel_for(0, kv_heads * steps, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      pack_step(layer_k, layer_v, table, g, item / steps, item % steps, packed_k, packed_v);
    }
  });
  const at::BFloat16* q = query.data_ptr<at::BFloat16>();
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  const int64_t q_stride = query.stride(0), o_stride = out.stride(0);
  const int64_t row_blocks = (tokens + kRows - 1) / kRows, tasks = row_blocks * heads;
  std::atomic<int64_t> next{0};
  const float fscale = static_cast<float>(scale);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
#if defined(STRATA_AMX)
    if (amx) {
      TileConfig config;
      for (int t = 0; t < 8; ++t) {
        config.rows[t] = 16;
        config.colsb[t] = 64;
      }
      _tile_loadconfig(&config);
    }
#endif
    for (int64_t task = next++; task < tasks; task = next++) {
      const int64_t block = row_blocks - 1 - task / heads;  // the longest rows first
      const int64_t row0 = block * kRows;
      const int64_t head = task % heads, valid = std::min(kRows, tokens - row0);
#if defined(STRATA_AMX)
      if (amx) {
        attend_task<true>(q, q_stride, packed_k, packed_v, g, context_len, head, row0, valid, fscale, o, o_stride);
        continue;
      }
#endif
      attend_task<false>(q, q_stride, packed_k, packed_v, g, context_len, head, row0, valid, fscale, o, o_stride);
    }
#if defined(STRATA_AMX)
    if (amx) _tile_release();
#endif
  });
#else
  (void)isa;
  TORCH_CHECK(false, "prefill_attention was not built for AVX512-BF16 on this CPU");
#endif
}

// Bytes of workspace a call needs for `keys` keys (context_len + T).
int64_t prefill_workspace_bytes(int64_t keys, int64_t num_kv_heads, int64_t head_dim) {
  return 2 * packed_bytes(keys, num_kv_heads, head_dim);
}
