// Products with int8 activations, a weight row at a time: the scheme, the input rows' int8 rounding and the
// loops every instruction set shares; int8_vnni.h (AVX512-VNNI) and int8_avx2.h (AVX2) implement the kernels.
#pragma once

#include "decode.h"
#include "fp32.h"  // TILE, the input rows of a row-at-a-time tile

#include <array>
#include <utility>

#if defined(SPECDEC_INT8)
namespace {

// ---- products with int8 activations ---------------------------------------------------------
//
// The faster path, as llama.cpp multiplies its blocks: each input row is quantized to int8 per
// 32-element block (scale = max|x| / 127, values rounded to nearest even), and a weight block's
// integers are multiplied with those by vpdpbusd (u8 x s8, four products summed per 32-bit lane,
// exactly). The weights are decoded per 64 columns (a "chunk": two 32-blocks, or a quarter of a
// 256-super-block) into unsigned bytes u, with w = scale * (u - offset) + min, fp32 scales per
// lane and, for the types with a minimum, fp32 minimums per lane. Per chunk and input row, in
// 16 lanes:
//   I    = sum(u * xq) - offset * sum(xq)                  (int32, exact)
//   acc  = acc + float(I) * (weight scale * input scale)   (one rounding for the product, one for the fma)
//   macc = macc + min * (input scale * sum(xq))            (Q4_1, Q5_1)
// over the chunks in order; then one lane reduction of acc + macc. Every step depends only on the
// output's own weight row and input row, in an order fixed by K: batch-invariant as the fp32 path is.
// The AVX2 kernels (no VNNI) compute the same 32-bit integers with vpmaddubsw and vpmaddwd, and the
// same fp32 steps lane by lane in two 8-lane halves, so they give the bits of the VNNI row-at-a-time
// kernels (tests/test_isa.py).

// Bytes ahead of the weight block being decoded that are prefetched: the weights are streamed once
// per forward, and a thread's rows are contiguous.
constexpr int64_t PREFETCH = 1024;
// Many input rows (prefill) go over the weights a block of rows at a time (about this many bytes,
// to stay in L2) for each tile of input rows, so the input rows are not streamed again per weight
// row. The order of the tiles changes no output's operations.
constexpr int64_t WEIGHT_BLOCK = 128 * 1024;

// Input rows quantized to int8, padded to whole chunks of 64 columns. The per-lane fields serve the
// row-at-a-time kernels only, and are filled only when a product has such a part (quantize_rows' lanes).
struct QRows {
  int64_t M = 0, K = 0, chunks = 0;
  std::vector<int8_t> q;      // (M, chunks * 64)
  std::vector<float> scale;   // (M, chunks * 16): lanes 0-7 the scale of block 2c, lanes 8-15 that of block 2c + 1
  std::vector<int32_t> sum4;  // (M, chunks * 16): per lane, the sum of its four int8 values
  std::vector<float> sum4f;   // (M, chunks * 16): the lane's scale times sum4
  std::vector<float> block_scale;  // (M, K / 32): the scale of each 32-block
  std::vector<int32_t> block_sum;  // (M, K / 32): the sum of its int8 values
  std::vector<float> block_scaled_sum;  // (M, K / 32): block_scale * float(block_sum), a minimum's factor
  std::vector<int32_t> offset_sum[3];   // (M, K / 32) each: -offset * block_sum for the offsets 8, 16, 128

  // The regrouped kernels' fields of block blk (row * K / 32 + block): its scale d and the sum of its int8 values.
  void set_block(int64_t blk, float d, int32_t sum) {
    block_scale[blk] = d;
    block_sum[blk] = sum;
    block_scaled_sum[blk] = d * static_cast<float>(sum);
    offset_sum[0][blk] = -8 * sum;
    offset_sum[1][blk] = -16 * sum;
    offset_sum[2][blk] = -128 * sum;
  }

  // For `rows` input rows of `columns`: q zeroed (its padding stays 0), and with per_lane the lane fields.
  void reset(int64_t rows, int64_t columns, bool per_lane) {
    M = rows;
    K = columns;
    chunks = (K + 63) / 64;
    q.assign(M * chunks * 64, 0);
    if (per_lane) {
      scale.assign(M * chunks * 16, 0.0f);
      sum4.assign(M * chunks * 16, 0);
      sum4f.assign(M * chunks * 16, 0.0f);
    }
  }
};

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

template <int64_t type>
constexpr int32_t offset_of() {
  return type == Q4_0 ? 8 : type == Q5_0 ? 16 : type == Q8_0 ? 128 : 0;
}
template <int64_t type>
constexpr bool has_min() {
  return type == Q4_1 || type == Q5_1;
}

// Q4_K and Q6_K, as llama.cpp's Q8_K: an input row is quantized per 256 columns (one scale per
// super-block) and everything inside a super-block is integer, exact: per chunk of 64 columns,
// vpmaddubsw multiplies u with xq and adds pairs (16 bits, no overflow for these types), and
// vpdpwssd multiplies those pair sums by the lanes' sub-block scales and adds them to 32-bit lanes:
// lane l of a chunk gets scale * sum of its four products. Q6_K's offset (32 * scale * sum of xq
// per 16 columns) is subtracted in the same integers; Q4_K's minimums (6-bit minimum * sum of xq
// per 16 columns) are a second integer sum. Then per super-block, in order: acc = acc + float(S) *
// (d * input scale), macc = macc + float(minimums) * (-dmin * input scale) for Q4_K; one lane
// reduction of acc + macc at the end.
struct KRows {  // input rows quantized per 256 columns
  int64_t M = 0, K = 0, supers = 0;
  std::vector<int8_t> q;       // (M, K)
  std::vector<float> scale;    // (M, supers)
  std::vector<int32_t> sum16;  // (M, supers * 16): sums of the int8 values of each 16 columns
  std::vector<int32_t> pair32;  // (M, supers * 4): the sums of columns 64i..+31 and 64i+32..+63 as 16-bit
                                // halves (the regrouped Q4_K kernels' minimums)
  std::vector<int32_t> offset16;  // (M, supers * 16), AVX2 builds: per 16 columns c.., 32 * the sum over t < 4 of
                                  // xq[c + 4t] + xq[c + 4t + 1] (low half) and of xq[c + 4t + 2] + xq[c + 4t + 3] (high)

  // pair32 of super-block r (row * supers + super-block) from its sum16 (|each 32-column sum| <= 32 * 127: 16 bits).
  void set_pairs(int64_t r) {
    const int32_t* s = sum16.data() + 16 * r;
    for (int i = 0; i < 4; ++i)
      pair32[4 * r + i] = static_cast<int32_t>((static_cast<uint32_t>(s[4 * i] + s[4 * i + 1]) & 0xFFFF) |
                                               (static_cast<uint32_t>(s[4 * i + 2] + s[4 * i + 3]) << 16));
  }

  void resize(int64_t rows, int64_t columns) {  // for `rows` input rows of `columns`: every field but pair32
    M = rows;
    K = columns;
    supers = K / 256;
    q.resize(M * K);
    scale.resize(M * supers);
    sum16.resize(M * supers * 16);
  }
};

// Declared here, defined once per instruction set (int8_vnni.h, int8_avx2.h). quantize_rows: x (M, K)
// fp32 -> r, per 32 columns (per_lane: also the fields of the row-at-a-time kernels); quantize_rows_k: per
// 256. q8_tile / k_tile: one weight row of `type` times T quantized input rows (m0..m0+T-1): out[m] for each;
// bias: -offset * sum4 per lane, or null for the types without an offset.
void quantize_rows(const float* x, int64_t M, int64_t K, QRows& r, bool per_lane);
void quantize_rows_k(const float* x, int64_t M, int64_t K, KRows& r);
template <int64_t type, int T>
void q8_tile(const uint8_t* row, const QRows& x, int64_t m0, const int32_t* bias, float* out);
template <int64_t type, int T>
void k_tile(const uint8_t* row, const KRows& x, int64_t m0, float* out);
// The same kernels in 8-lane halves (int8_halves.h): every type's in AVX2 builds, some types' in every build.
template <int64_t type, int T>
void q8_halves(const uint8_t* row, const QRows& x, int64_t m0, const int32_t* bias, float* out);
template <int64_t type, int T>
void k_halves(const uint8_t* row, const KRows& x, int64_t m0, float* out);

// y[:, j] for j in [lo, hi) of one part, a weight row at a time: tile(row, m0, t, out) computes one
// row's outputs for input rows m0..m0+t-1. A thread goes over a block of weight rows (about
// WEIGHT_BLOCK bytes) for each tile of input rows, so many input rows are not streamed again per
// weight row; the order changes no output's operations.
template <typename Tile>
void row_outputs(Tile&& tile, const uint8_t* rows, int64_t row_bytes, int64_t lo, int64_t hi, int64_t M, float* y,
                 int64_t N) {
  float out[TILE];
  const int64_t block = std::max<int64_t>(1, WEIGHT_BLOCK / row_bytes);
  for (int64_t j0 = lo; j0 < hi; j0 += block)
    for (int64_t m0 = 0; m0 < M; m0 += TILE) {
      const int t = static_cast<int>(std::min<int64_t>(TILE, M - m0));
      for (int64_t j = j0; j < std::min(hi, j0 + block); ++j) {
        tile(rows + (j - lo) * row_bytes, m0, t, out);
        for (int m = 0; m < t; ++m) y[(m0 + m) * N + j] = out[m];
      }
    }
}

// The kernel of each tile height t = 1..TILE (entry 0 unused): kernel(std::integral_constant<int, t>).
template <typename Fn, typename Kernel>
constexpr std::array<Fn, TILE + 1> tiles_of(Kernel kernel) {
  return [&]<std::size_t... t>(std::index_sequence<t...>) {
    return std::array<Fn, TILE + 1>{nullptr, kernel(std::integral_constant<int, t + 1>{})...};
  }(std::make_index_sequence<TILE>{});
}

// y[:, lo..hi) of one part of a 32-weight type (k: of a 256-weight type), a tile of input rows at a time, on
// this build's kernels (q8_tile, k_tile) or, with halves, on int8_halves.h's (q8_halves, k_halves).
template <int64_t type, bool halves = false>
void part_outputs_q8(const uint8_t* rows, int64_t row_bytes, int64_t lo, int64_t hi, const QRows& x,
                     const int32_t* bias, float* y, int64_t N) {
  using Fn = void (*)(const uint8_t*, const QRows&, int64_t, const int32_t*, float*);
  static constexpr auto tiles = tiles_of<Fn>([](auto t) -> Fn {
    if constexpr (halves) return q8_halves<type, t()>;
    else return q8_tile<type, t()>;
  });
  row_outputs([&](const uint8_t* row, int64_t m0, int t, float* out) { tiles[t](row, x, m0, bias, out); }, rows,
              row_bytes, lo, hi, x.M, y, N);
}

template <int64_t type, bool halves = false>
void part_outputs_k(const uint8_t* rows, int64_t row_bytes, int64_t lo, int64_t hi, const KRows& x, float* y,
                    int64_t N) {
  using Fn = void (*)(const uint8_t*, const KRows&, int64_t, float*);
  static constexpr auto tiles = tiles_of<Fn>([](auto t) -> Fn {
    if constexpr (halves) return k_halves<type, t()>;
    else return k_tile<type, t()>;
  });
  row_outputs([&](const uint8_t* row, int64_t m0, int t, float* out) { tiles[t](row, x, m0, out); }, rows, row_bytes,
              lo, hi, x.M, y, N);
}

}  // namespace
#endif
