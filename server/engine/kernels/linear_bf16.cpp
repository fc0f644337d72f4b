// bf16 linear layers on AVX512-BF16: y[M, N] = x[M, K] W^T (+ bias), fp32 sums, rounded to bf16 once.
//
// The weight [N, K] is packed once, at load, into the B operand of VDPBF16PS: per 16 output columns (a "tile"),
// [K/2 pairs][16 columns] dwords, each the bf16 pair (W[n][2p], W[n][2p+1]); a tile is one contiguous run of K*32
// bytes. A block of R rows x T tiles keeps R*T accumulators in registers: per pair p it loads T tile vectors and
// broadcasts each row's dword of x (x[m][2p], x[m][2p+1]), R*T dot-product instructions. Threads split the columns
// (tile blocks of T=2), each row block reads its tile block's weights from cache, and the first row block of a
// tile block prefetches the next one's weights (a tile block is streamed from memory once, while the last is
// computed: decode batches are bound by streaming the weights). Its timings against oneDNN's packed bf16 GEMM
// are in the README ("Engine speed on CPU").
//
// Built wherever the compiler targets AVX512-BF16 (AMX CPUs have it too, so the kernel is built and tested there);
// elsewhere `bf16_linear_available()` is false and linear.py keeps oneDNN (or F.linear). The engine does not use it
// where AMX is usable (server/engine/builder.py): oneDNN's GEMM runs on AMX tiles there, several times this
// kernel's peak for prefill, and this kernel has not been measured against it.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define STRATA_LINEAR_BF16 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 16;  // output columns per tile: one fp32 vector
constexpr int64_t kTiles = 2;  // tiles per block (T)
constexpr int64_t kRows = 8;   // rows per block (R): 16 accumulators with T = 2

#if defined(STRATA_LINEAR_BF16)

// One block: rows [0, R) of x (dword stride x_stride) times tiles [0, T) of w (each `pairs` x 16 dwords apart),
// into y (row stride y_stride) with the bias's T*16 values (or none). `prefetch`: lines of the next tile block to
// bring in while this one computes, `per_pair` lines each pair (none: nullptr).
template <int R, int T>
inline void block(const uint32_t* x, int64_t x_stride, const uint32_t* w, int64_t pairs, const at::BFloat16* bias,
                  at::BFloat16* y, int64_t y_stride, const char* prefetch, int64_t prefetch_lines) {
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  constexpr int64_t kPerPair = 2;  // lines: a T=2 tile block of K pairs is 2*K/2 lines, two per pair
  for (int64_t p = 0; p < pairs; ++p) {
    if (prefetch != nullptr && p * kPerPair < prefetch_lines) {
      for (int64_t l = 0; l < kPerPair; ++l) __builtin_prefetch(prefetch + (p * kPerPair + l) * 64);
    }
    __m512i b[T];
    for (int t = 0; t < T; ++t) b[t] = _mm512_loadu_si512(w + (t * pairs + p) * kTile);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int32_t>(x[r * x_stride + p]));
      for (int t = 0; t < T; ++t) {
        acc[r][t] = _mm512_dpbf16_ps(acc[r][t], reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b[t]));
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    __m512 add = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + t * kTile));
      add = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int r = 0; r < R; ++r) {
      const __m256bh value = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][t], add));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * y_stride + t * kTile), (__m256i)value);
    }
  }
}

// Rows [0, rows) of one tile block: whole row blocks of kRows, then the rest by 4, 2, 1 (never reading past x).
template <int T>
void tile_block(const uint32_t* x, int64_t x_stride, int64_t rows, const uint32_t* w, int64_t pairs,
                const at::BFloat16* bias, at::BFloat16* y, int64_t y_stride, const char* prefetch,
                int64_t prefetch_lines) {
  int64_t m = 0;
  auto run = [&](auto r_constant) {
    constexpr int R = decltype(r_constant)::value;
    block<R, T>(x + m * x_stride, x_stride, w, pairs, bias, y + m * y_stride, y_stride, m == 0 ? prefetch : nullptr,
                prefetch_lines);
    m += R;
  };
  while (rows - m >= kRows) run(std::integral_constant<int, kRows>{});
  if (rows - m >= 4) run(std::integral_constant<int, 4>{});
  if (rows - m >= 2) run(std::integral_constant<int, 2>{});
  if (rows - m >= 1) run(std::integral_constant<int, 1>{});
}

#endif  // STRATA_LINEAR_BF16

}  // namespace

bool bf16_linear_available() {
#if defined(STRATA_LINEAR_BF16)
  return true;
#else
  return false;
#endif
}

// weight [N, K] bf16 (N a multiple of 16, K even) -> the packed int32 [N/16, K/2, 16] that bf16_linear reads.
at::Tensor pack_bf16_linear(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "weight must be bf16 [N, K]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kTile == 0 && k % 2 == 0, "weight [", n, ", ", k, "]: N must be a multiple of 16, K even");
  const at::Tensor source = weight.contiguous();
  at::Tensor packed = at::empty({n / kTile, k / 2, kTile}, weight.options().dtype(at::kInt));
  const uint16_t* src = reinterpret_cast<const uint16_t*>(source.data_ptr<at::BFloat16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  at::parallel_for(0, n / kTile, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      for (int64_t p = 0; p < k / 2; ++p) {
        for (int64_t j = 0; j < kTile; ++j) {
          const uint16_t* pair = src + (tile * kTile + j) * k + 2 * p;
          dst[(tile * (k / 2) + p) * kTile + j] = uint32_t{pair[0]} | (uint32_t{pair[1]} << 16);
        }
      }
    }
  });
  return packed;
}

// x [M, K] bf16 (rows contiguous), packed from pack_bf16_linear, bias [N] bf16 or None, out [M, N] bf16 (rows
// contiguous) written.
void bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                 at::Tensor out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "x must be bf16 [M, K]");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kInt && packed.is_contiguous() &&
                  packed.size(2) == kTile,
              "packed must come from pack_bf16_linear");
  const int64_t rows = x.size(0), k = x.size(1), n = packed.size(0) * kTile, pairs = packed.size(1);
  TORCH_CHECK(pairs * 2 == k, "x has ", k, " columns, the weight ", pairs * 2);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == rows && out.size(1) == n && out.stride(1) == 1 &&
                  out.scalar_type() == at::kBFloat16,
              "out must be bf16 [M, N]");
  const at::BFloat16* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == n && bias->scalar_type() == at::kBFloat16 &&
                    bias->is_contiguous(),
                "bias must be bf16 [N]");
    b = bias->data_ptr<at::BFloat16>();
  }
  if (rows == 0) return;
  TORCH_CHECK(x.stride(0) % 2 == 0, "x's row stride must be even");
#if defined(STRATA_LINEAR_BF16)
  const uint32_t* xd = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  const int64_t x_stride = x.stride(0) / 2, y_stride = out.stride(0);
  const uint32_t* wd = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  at::BFloat16* yd = out.data_ptr<at::BFloat16>();
  const int64_t tiles = n / kTile, blocks = (tiles + kTiles - 1) / kTiles;
  const int64_t block_lines = kTiles * pairs * kTile * 4 / 64;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t tile = blk * kTiles;
      const uint32_t* w = wd + tile * pairs * kTile;
      const char* next = blk + 1 < end ? reinterpret_cast<const char*>(w + kTiles * pairs * kTile) : nullptr;
      const at::BFloat16* bias_block = b != nullptr ? b + tile * kTile : nullptr;
      if (tiles - tile >= kTiles) {
        tile_block<kTiles>(xd, x_stride, rows, w, pairs, bias_block, yd + tile * kTile, y_stride, next, block_lines);
      } else {  // an odd last tile
        tile_block<1>(xd, x_stride, rows, w, pairs, bias_block, yd + tile * kTile, y_stride, nullptr, 0);
      }
    }
  });
#else
  TORCH_CHECK(false, "bf16_linear was not built for AVX512-BF16 on this CPU");
#endif
}
