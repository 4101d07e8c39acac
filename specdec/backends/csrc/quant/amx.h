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

// Tiles of this thread for blocks of T input rows: C (tile 0) T x 16 int32, A (tile 1) T x 32 bytes, B (tile 2)
// 8 x 64 bytes.
#if defined(SPECDEC_AMX_INTRINSICS)
__attribute__((target("amx-tile"))) inline void configure_tiles(int T) {
  TileConfig config;
  config.colsb[0] = 64, config.rows[0] = static_cast<uint8_t>(T);
  config.colsb[1] = 32, config.rows[1] = static_cast<uint8_t>(T);
  config.colsb[2] = 64, config.rows[2] = 8;
  _tile_loadconfig(&config);
}

// c[m][r] = sum over k < 32 of a[m * stride + k] (int8) * b[(k / 4) * 64 + 4 r + k % 4] (uint8), m < T.
__attribute__((target("amx-tile,amx-int8"))) inline void tile_block(const int8_t* a, int64_t stride, const uint8_t* b,
                                                                     int32_t* c) {
  _tile_zero(0);
  _tile_loadd(1, a, stride);
  _tile_loadd(2, b, 64);
  _tile_dpbsud(0, 1, 2);
  _tile_stored(0, c, 64);
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
thread_local int emulated_rows = 0;
inline void configure_tiles(int T) { emulated_rows = T; }
inline void tile_block(const int8_t* a, int64_t stride, const uint8_t* b, int32_t* c) {
  for (int m = 0; m < emulated_rows; ++m)
    for (int r = 0; r < GROUP; ++r) {
      int32_t sum = 0;
      for (int k = 0; k < 32; ++k) sum += int32_t(a[m * stride + k]) * int32_t(b[(k / 4) * 64 + 4 * r + k % 4]);
      c[m * GROUP + r] = sum;
    }
}
#endif

// One group of sixteen weight rows times T >= 2 quantized input rows, on tiles: legacy_x16_tile's integer sums,
// then its block_step, so its bits.
template <int64_t type, int T>
void legacy_amx_tile(const uint8_t* group, const QRows& x, int64_t m0, float (*out)[GROUP]) {
  static_assert(T >= 2 && T <= 16, "legacy_amx_tile: 2 to 16 input rows");
  constexpr int64_t gb = legacy_group_bytes<type>();
  const int64_t B = x.K / 32, width = x.chunks * 64;
  alignas(64) uint8_t weights[512];
  alignas(64) int32_t sums[T][GROUP];
  __m512 acc[T];
  for (int m = 0; m < T; ++m) acc[m] = _mm512_setzero_ps();
  configure_tiles(T);
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* p = group + b * gb;
    fetch_lines(p, gb, AHEAD_BLOCKS * gb);
    const __m512 d = _mm512_cvtph_ps(load32(p));
    const __m512 mn = has_min<type>() ? _mm512_cvtph_ps(load32(p + 32)) : _mm512_setzero_ps();
    const uint8_t* q = p + (has_min<type>() ? 64 : 32);
    const uint8_t* tile = q;  // Q8_0's block is the B tile as it lies
    if constexpr (type != Q8_0) {
      __m512i u[8];
      unpack_legacy<type>(q, u);
      for (int v = 0; v < 8; ++v) _mm512_store_si512(weights + 64 * v, u[v]);
      tile = weights;
    }
    tile_block(x.q.data() + m0 * width + 32 * b, width, tile, &sums[0][0]);
    for (int m = 0; m < T; ++m) {
      const int64_t blk = (m0 + m) * B + b;
      acc[m] = block_step<type>(acc[m], _mm512_add_epi32(offset_term<type>(x, blk), _mm512_load_si512(sums[m])), d,
                                mn, x, blk);
    }
  }
  for (int m = 0; m < T; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

template <int64_t type>
struct LegacyAmxTile {
  template <int T>
  struct At {
    static void run(const uint8_t* g, const QRows& x, int64_t m0, float (*out)[GROUP]) {
      if constexpr (T == 1)
        legacy_x16_tile<type, 1>(g, x, m0, out);
      else
        legacy_amx_tile<type, T>(g, x, m0, out);
    }
  };
};

// y[:, lo..hi) of one regrouped part of a 32-weight type on tiles (a lone input row on VNNI); false for other types
// (Q4_K), which keep the VNNI kernels.
bool amx_outputs(int64_t type, const uint8_t* groups, int64_t group_bytes, int64_t lo, int64_t hi, const QRows& qx,
                 float* y, int64_t N) {
  switch (regrouped_base(type)) {
    case Q4_0: tiled_outputs<QRows, LegacyAmxTile<Q4_0>::At>(groups, group_bytes, lo, hi, qx, y, N); return true;
    case Q4_1: tiled_outputs<QRows, LegacyAmxTile<Q4_1>::At>(groups, group_bytes, lo, hi, qx, y, N); return true;
    case Q5_0: tiled_outputs<QRows, LegacyAmxTile<Q5_0>::At>(groups, group_bytes, lo, hi, qx, y, N); return true;
    case Q5_1: tiled_outputs<QRows, LegacyAmxTile<Q5_1>::At>(groups, group_bytes, lo, hi, qx, y, N); return true;
    case Q8_0: tiled_outputs<QRows, LegacyAmxTile<Q8_0>::At>(groups, group_bytes, lo, hi, qx, y, N); return true;
  }
  return false;
}

}  // namespace
#endif
