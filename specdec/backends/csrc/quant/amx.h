// AMX int8 tiles (Intel Sapphire Rapids and later) for the regrouped 32-weight types, two or more input rows.
#pragma once

#include "int8_x16.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <cpuid.h>
#include <sys/syscall.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

constexpr int AMX_ROWS = 16;  // input rows of a tile (its A and C operands' height)

// A block of a regrouped 32-weight type is already an AMX B tile: its eight 64-byte vectors (unpacked from
// nibbles where the type packs them) are eight rows of sixteen weight rows x four consecutive weights. The
// block's int8 inputs of T input rows are the A tile (T rows of 32 bytes), and one `tdpbsud` (signed inputs,
// unsigned weights) leaves C[m][r] = sum of input row m's 32 products with weight row r: the integer sum
// the VNNI kernel builds with eight `vpdpbusd`, exact either way. Every fp32 step after it is the VNNI
// kernel's, per block and in order, so the AMX and VNNI paths give the same bits, and one row (which takes
// the VNNI kernel, as llama.cpp's does) has the bits it has inside any tile of rows.
//
// Built with SPECDEC_AMX_EMULATE (the tests' build), the tile operations are plain loops with the
// instructions' semantics, so that the data flow around them is tested on CPUs without AMX.

#if defined(SPECDEC_AMX_EMULATE)
constexpr bool AMX_EMULATED = true;
#else
constexpr bool AMX_EMULATED = false;
#endif
// A compiler without AMX intrinsics (GCC before 11, clang before 12) builds the loops, and never runs them.
#if !defined(SPECDEC_AMX_EMULATE) && \
    ((defined(__clang__) && __clang_major__ >= 12) || (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define SPECDEC_AMX_INTRINSICS 1
#endif

// Whether tiles may run in this process: the CPU has AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25)
// and Linux granted the process the tile data state (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)).
// Asked once; a refusal is said once on stderr, and the VNNI kernels run. The emulated build always may.
inline bool amx_ready() {
  static const bool ready = [] {
    if (AMX_EMULATED) return true;
#if defined(SPECDEC_AMX_INTRINSICS)
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !((d >> 24) & 1) || !((d >> 25) & 1)) return false;
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
      std::fprintf(stderr, "specdec: this CPU has AMX, but Linux refused the tile state; the int8 products use "
                           "AVX512-VNNI\n");
      return false;
    }
    return true;
#else
    return false;
#endif
  }();
  return ready;
}

// Whether the regrouped products use the tiles: where amx_ready(), unless SPECDEC_AMX=0 is set or use_amx(false)
// (the tests and the bench compare both paths in one process).
inline std::atomic<bool>& amx_switch() {
  static std::atomic<bool> on{[] {
    const char* env = std::getenv("SPECDEC_AMX");
    return amx_ready() && !(env && std::string(env) == "0");
  }()};
  return on;
}
inline bool amx_on() { return amx_switch().load(std::memory_order_relaxed); }

// Switch the tiles on (where amx_ready()) or off; returns whether they were on.
bool use_amx(bool on) { return amx_switch().exchange(on && amx_ready()); }

struct alignas(64) TileConfig {  // the LDTILECFG operand, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The tiles of amx_groups: A (tile 0) sixteen input rows x 32 bytes, B (tiles 1-3) 8 x 64 bytes, C (tiles 4-6)
// sixteen input rows x sixteen int32.
#if defined(SPECDEC_AMX_INTRINSICS)
__attribute__((target("amx-tile"))) inline void configure_tiles() {
  TileConfig config;
  config.colsb[0] = 32, config.rows[0] = AMX_ROWS;
  for (int t = 1; t <= 3; ++t) config.colsb[t] = 64, config.rows[t] = 8;
  for (int t = 4; t <= 6; ++t) config.colsb[t] = 64, config.rows[t] = AMX_ROWS;
  _tile_loadconfig(&config);
}
__attribute__((target("amx-tile"))) inline void zero_sums() {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
}
__attribute__((target("amx-tile"))) inline void load_inputs(const int8_t* a, int64_t stride) { _tile_loadd(0, a, stride); }

// C_g += A x B_g (tdpbsud: signed inputs, unsigned weights), then C_g stored to sums[g] (sixteen rows of 64
// bytes), for the G < 4 groups whose B tiles lie at b[g] (512 bytes each). All loads, then all products, then all
// stores: the tile unit runs them in order, so a product never waits on the one before it.
template <int G>
__attribute__((target("amx-tile,amx-int8"))) inline void tile_products(const uint8_t* const* b, int32_t* sums) {
  _tile_loadd(1, b[0], 64);
  if constexpr (G > 1) _tile_loadd(2, b[1], 64);
  if constexpr (G > 2) _tile_loadd(3, b[2], 64);
  _tile_dpbsud(4, 0, 1);
  if constexpr (G > 1) _tile_dpbsud(5, 0, 2);
  if constexpr (G > 2) _tile_dpbsud(6, 0, 3);
  _tile_stored(4, sums, 64);
  if constexpr (G > 1) _tile_stored(5, sums + 256, 64);
  if constexpr (G > 2) _tile_stored(6, sums + 512, 64);
}
// Multiply-adds of `iterations` rounds of four independent tdpbsud (16 x 16 x 64 each) in registers: the peak.
__attribute__((target("amx-tile,amx-int8"))) inline double amx_peak_macs(int64_t iterations) {
  TileConfig config;
  for (int i = 0; i < 6; ++i) config.colsb[i] = 64, config.rows[i] = 16;
  _tile_loadconfig(&config);
  alignas(64) int8_t ones[16 * 64];
  alignas(64) int32_t sums[16 * 16];
  std::memset(ones, 1, sizeof ones);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, ones, 64);
  _tile_loadd(5, ones, 64);
  for (int64_t it = 0; it < iterations; ++it) {
    _tile_dpbsud(0, 4, 5);
    _tile_dpbsud(1, 4, 5);
    _tile_dpbsud(2, 4, 5);
    _tile_dpbsud(3, 4, 5);
  }
  _tile_stored(0, sums, 64);
  volatile int32_t keep = sums[0];
  (void)keep;
  return 4.0 * 16 * 16 * 64 * static_cast<double>(iterations);
}
#else
inline double amx_peak_macs(int64_t) { return 0.0; }  // never called: peak() asks amx_ready() and !AMX_EMULATED
thread_local int32_t emulated_c[3][16 * 16];  // the C tiles
thread_local const int8_t* emulated_a = nullptr;
thread_local int64_t emulated_stride = 0;
inline void configure_tiles() {}
inline void zero_sums() { std::memset(emulated_c, 0, sizeof emulated_c); }
inline void load_inputs(const int8_t* a, int64_t stride) { emulated_a = a, emulated_stride = stride; }
template <int G>
inline void tile_products(const uint8_t* const* b, int32_t* sums) {
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < AMX_ROWS; ++m)
      for (int r = 0; r < GROUP; ++r) {
        uint32_t sum = static_cast<uint32_t>(emulated_c[g][m * GROUP + r]);  // wraps, as the tiles' sums do
        for (int k = 0; k < 32; ++k)
          sum += static_cast<uint32_t>(int32_t(emulated_a[m * emulated_stride + k]) *
                                       int32_t(b[g][(k / 4) * 64 + 4 * r + k % 4]));
        emulated_c[g][m * GROUP + r] = static_cast<int32_t>(sum);
      }
  std::memcpy(sums, emulated_c, sizeof(int32_t) * G * 256);
}
#endif

// G <= 3 groups of sixteen weight rows times AMX_ROWS input rows (x's rows m0..m0+15), on tiles: out[g][m][r].
// The C tiles are zeroed once and accumulate every block (no tile zeroing between blocks, which stalls the tile
// unit); a block's integer sums are the difference of two stored totals, exact in wrapping int32 arithmetic as
// the tiles' sums are. Then legacy_x16_tile's block_step, block by block: its bits.
template <int64_t type, int G>
void legacy_amx_groups(const uint8_t* group, int64_t group_bytes, const QRows& x, int64_t m0,
                       float (*out)[AMX_ROWS][GROUP]) {
  constexpr int64_t gb = legacy_group_bytes<type>();
  const int64_t B = x.K / 32, width = x.chunks * 64;
  alignas(64) uint8_t weights[2][G][512];
  alignas(64) int32_t sums[3][G][AMX_ROWS][GROUP];  // the totals after block b in sums[b % 3]
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < AMX_ROWS; ++m) {
      _mm512_store_si512(sums[2][g][m], _mm512_setzero_si512());  // the totals before block 0
      _mm512_storeu_ps(out[g][m], _mm512_setzero_ps());
    }
  // block b's fp32 steps, from the totals after blocks b (sums[now]) and b - 1 (sums[before])
  auto finish = [&](int64_t b, int now, int before) {
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = group + g * group_bytes + b * gb;
      const __m512 d = _mm512_cvtph_ps(load32(p));
      const __m512 mn = has_min<type>() ? _mm512_cvtph_ps(load32(p + 32)) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int m = 0; m < AMX_ROWS; ++m) {
        const int64_t blk = (m0 + m) * B + b;
        const __m512i i = _mm512_sub_epi32(_mm512_load_si512(sums[now][g][m]), _mm512_load_si512(sums[before][g][m]));
        _mm512_storeu_ps(out[g][m], block_step<type>(_mm512_loadu_ps(out[g][m]),
                                                     _mm512_add_epi32(offset_term<type>(x, blk), i), d, mn, x, blk));
      }
    }
  };
  configure_tiles();
  zero_sums();
  int previous = 2, before = 2;  // where the totals after blocks b - 1 and b - 2 lie
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* tiles[G];
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = group + g * group_bytes + b * gb;
      fetch_lines(p, gb, AHEAD_BLOCKS * gb);
      const uint8_t* q = p + (has_min<type>() ? 64 : 32);
      tiles[g] = q;  // Q8_0's block is the B tile as it lies
      if constexpr (type != Q8_0) {
        __m512i u[8];
        unpack_legacy<type>(q, u);
        for (int v = 0; v < 8; ++v) _mm512_store_si512(weights[b & 1][g] + 64 * v, u[v]);
        tiles[g] = weights[b & 1][g];
      }
    }
    load_inputs(x.q.data() + m0 * width + 32 * b, width);
    const int now = previous == 2 ? 0 : previous + 1;
    tile_products<G>(tiles, &sums[now][0][0][0]);
    if (b > 0) finish(b - 1, previous, before);  // while the tiles multiply block b
    before = previous, previous = now;
  }
  finish(B - 1, previous, before);
}

// y[:, lo..hi) of one regrouped part of a 32-weight type, its input rows sixteen at a time on tiles (three groups
// of weight rows side by side, sharing each block's input tile) and the rows past the last sixteen on the VNNI
// kernels; false for other types (Q4_K, Q6_K) and for fewer than sixteen input rows, which keep VNNI.
template <int64_t type>
void legacy_amx_outputs(const uint8_t* groups, int64_t group_bytes, int64_t lo, int64_t hi, const QRows& x, float* y,
                        int64_t N) {
  const int64_t full = x.M / AMX_ROWS * AMX_ROWS;
  float out[3][AMX_ROWS][GROUP];
  const int64_t block = std::max<int64_t>(3 * GROUP, WEIGHT_BLOCK / group_bytes / 3 * 3 * GROUP);
  for (int64_t j0 = lo; j0 < hi; j0 += block)
    for (int64_t m0 = 0; m0 < full; m0 += AMX_ROWS)
      for (int64_t j = j0; j < std::min(hi, j0 + block); j += 3 * GROUP) {
        const int G = static_cast<int>(std::min<int64_t>(3, (std::min(hi, j0 + block) - j) / GROUP));
        const uint8_t* g = groups + (j - lo) / GROUP * group_bytes;
        if (G == 3) legacy_amx_groups<type, 3>(g, group_bytes, x, m0, out);
        else if (G == 2) legacy_amx_groups<type, 2>(g, group_bytes, x, m0, out);
        else legacy_amx_groups<type, 1>(g, group_bytes, x, m0, out);
        for (int k = 0; k < G; ++k)
          for (int m = 0; m < AMX_ROWS; ++m) std::memcpy(y + (m0 + m) * N + j + GROUP * k, out[k][m], sizeof out[k][m]);
      }
  if (full < x.M) tiled_outputs<QRows, LegacyTile<type>::template At>(groups, group_bytes, lo, hi, x, y, N, full);
}

// y[:, lo..hi) of one regrouped part on tiles where amx_outputs can take it (a 32-weight type, at least sixteen
// input rows); false otherwise, and the VNNI kernels run.
bool amx_outputs(int64_t type, const uint8_t* groups, int64_t group_bytes, int64_t lo, int64_t hi, const QRows& qx,
                 float* y, int64_t N) {
  if (qx.M < AMX_ROWS) return false;
  switch (regrouped_base(type)) {
    case Q4_0: legacy_amx_outputs<Q4_0>(groups, group_bytes, lo, hi, qx, y, N); return true;
    case Q4_1: legacy_amx_outputs<Q4_1>(groups, group_bytes, lo, hi, qx, y, N); return true;
    case Q5_0: legacy_amx_outputs<Q5_0>(groups, group_bytes, lo, hi, qx, y, N); return true;
    case Q5_1: legacy_amx_outputs<Q5_1>(groups, group_bytes, lo, hi, qx, y, N); return true;
    case Q8_0: legacy_amx_outputs<Q8_0>(groups, group_bytes, lo, hi, qx, y, N); return true;
  }
  return false;
}

}  // namespace
#endif
