// Products with fp32 activations: each weight row decoded in registers, fp32 fused multiply-adds.
#pragma once

#include "decode.h"

namespace {

// ---- products ------------------------------------------------------------------------------
//
// Every output y[m, j] = w_j . x_m is summed the same way: over the row's 32-weight chunks in order,
// the first 16 lanes of each chunk into one accumulator and the next 16 into a second (two
// independent chains), then one lane reduction of their sum. The order depends on K alone. Input
// rows go in tiles of up to TILE, each tile dequantizing the weight row again in registers: the
// same values, the same operations, whatever the tile or the column block.

constexpr int TILE = 8;

// Continues the accumulators of one output for T input rows (acc: even, odd per row) over columns
// [k0, k0 + kn) of its weight row, kn a multiple of the type's block.
template <int64_t type, int T>
void rows_partial(const uint8_t* row, int64_t k0, int64_t kn, int64_t K, const float* x, vec* acc) {
  const Layout lay = layout(type);
  vec even[T], odd[T];
  for (int m = 0; m < T; ++m) {
    even[m] = acc[2 * m];
    odd[m] = acc[2 * m + 1];
  }
  decode_blocks<type>(row + k0 / lay.block * lay.bytes, kn, [&](int64_t c, vec w0, vec w1) {
    for (int m = 0; m < T; ++m) {
      even[m] = fma(w0, load(x + m * K + k0 + c), even[m]);
      odd[m] = fma(w1, load(x + m * K + k0 + c + 16), odd[m]);
    }
  });
  for (int m = 0; m < T; ++m) {
    acc[2 * m] = even[m];
    acc[2 * m + 1] = odd[m];
  }
}

// Several input rows whose columns do not fit in L1 (a tile of 8 rows of 1536 floats is 48 KB) are
// multiplied KB columns at a time, for JB weight rows, their accumulators kept in memory between
// passes: the same operations per output, in the same order, as one pass over the whole row.
constexpr int64_t KB = 512;
constexpr int64_t JB = 8;

// y[:, j] for j in [lo, hi) of one part: rows (hi - lo, row_bytes) of type `type`; x (M, K); y (M, N).
template <int64_t type>
void part_outputs(const uint8_t* rows, int64_t row_bytes, int64_t lo, int64_t hi, int64_t K, const float* x,
                  int64_t M, float* y, int64_t N) {
  using Fn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const float*, vec*);
  static constexpr Fn tiles[TILE + 1] = {nullptr,
                                         rows_partial<type, 1>,
                                         rows_partial<type, 2>,
                                         rows_partial<type, 3>,
                                         rows_partial<type, 4>,
                                         rows_partial<type, 5>,
                                         rows_partial<type, 6>,
                                         rows_partial<type, 7>,
                                         rows_partial<type, 8>};
  if (M == 1 || K <= KB) {
    vec acc[2 * TILE];
    for (int64_t j = lo; j < hi; ++j)
      for (int64_t m0 = 0; m0 < M; m0 += TILE) {
        const int t = static_cast<int>(std::min<int64_t>(TILE, M - m0));
        std::fill(acc, acc + 2 * t, vec{});
        tiles[t](rows + (j - lo) * row_bytes, 0, K, K, x + m0 * K, acc);
        for (int m = 0; m < t; ++m) y[(m0 + m) * N + j] = lane_sum(acc[2 * m] + acc[2 * m + 1]);
      }
    return;
  }
  std::vector<vec> acc(JB * M * 2);  // per (weight row, input row): even, odd
  for (int64_t j0 = lo; j0 < hi; j0 += JB) {
    const int64_t jn = std::min(JB, hi - j0);
    std::fill(acc.begin(), acc.end(), vec{});
    for (int64_t k0 = 0; k0 < K; k0 += KB)
      for (int64_t m0 = 0; m0 < M; m0 += TILE) {
        const int t = static_cast<int>(std::min<int64_t>(TILE, M - m0));
        for (int64_t j = j0; j < j0 + jn; ++j)
          tiles[t](rows + (j - lo) * row_bytes, k0, std::min(KB, K - k0), K, x + m0 * K,
                   acc.data() + ((j - j0) * M + m0) * 2);
      }
    for (int64_t j = j0; j < j0 + jn; ++j)
      for (int64_t m = 0; m < M; ++m) {
        const vec* a = acc.data() + ((j - j0) * M + m) * 2;
        y[m * N + j] = lane_sum(a[0] + a[1]);
      }
  }
}

}  // namespace
