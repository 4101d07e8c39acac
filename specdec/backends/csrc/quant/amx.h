// AMX int8 tiles (Intel Sapphire Rapids and later) for the regrouped 32-weight types and Q4_K, sixteen input rows
// at a time.
#pragma once

#include "int8_x16.h"

#if defined(SPECDEC_VNNI)
#include <cpuid.h>
#include <sys/syscall.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

constexpr int AMX_ROWS = 16;  // input rows of a tile (its A and C operands' height); fewer rows keep VNNI

// A block of a regrouped 32-weight type (a sub-block of Q4_K) is already an AMX B tile: its eight 64-byte vectors
// (unpacked from nibbles where the type packs them) are eight rows of sixteen weight rows x four consecutive
// weights. The block's int8 inputs of sixteen input rows are the A tile (rows of 32 bytes), and one `tdpbsud`
// (signed inputs, unsigned weights) leaves C[m][r] = sum of input row m's 32 products with weight row r: the
// integer sum the VNNI kernel builds with eight `vpdpbusd`, exact either way. Every step after it is the VNNI
// kernel's, per block and in order, so the AMX and VNNI paths give the same bits, and a row computed by the VNNI
// kernels (decoding, verify blocks, the rows past the last sixteen) has the bits it has inside a tile.
//
// The tiles pay only for sixteen rows: a block's sums leave the tile for their fp32 scale block by block, and a
// tile store costs about as much as the product (docs/quantized.md has the measurements).
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

// The tiles of amx_steps: A (tile 0) sixteen input rows x 32 bytes, B (tiles 1-3) 8 x 64 bytes, C (tiles 4-6)
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
__attribute__((target("amx-tile"))) inline void load_inputs(const int8_t* a, int64_t stride) {
  _tile_loadd(0, a, stride);
}

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
  if constexpr (G > 1) _tile_stored(5, sums + AMX_ROWS * GROUP, 64);
  if constexpr (G > 2) _tile_stored(6, sums + 2 * AMX_ROWS * GROUP, 64);
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
thread_local int32_t emulated_c[3][AMX_ROWS * GROUP];  // the C tiles
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
  std::memcpy(sums, emulated_c, sizeof(int32_t) * G * AMX_ROWS * GROUP);
}
#endif

// The tile loop every AMX kernel shares, over G <= 3 groups of sixteen weight rows and AMX_ROWS input rows, a
// K-step of 32 weights at a time: prepare(s, buffer, tiles) points tiles[g] at group g's B tile for step s
// (unpacked into buffer[g], 512 bytes, where the weights are packed), the A tile is the 32 int8 inputs of each
// row at inputs(s) (rows `stride` bytes apart), and finish(s, sums) takes step s's integer sums, sums(g, m) a
// vector of sixteen int32 (weight rows of group g, input row m), while the tiles multiply step s + 1. The C
// tiles are zeroed once and accumulate every step (zeroing a tile before each product stalls the tile unit); a
// step's sums are the difference of two stored totals, exact in wrapping int32 arithmetic as the tiles' sums are.
template <int G, typename Prepare, typename Inputs, typename Finish>
void amx_steps(int64_t steps, int64_t stride, Prepare&& prepare, Inputs&& inputs, Finish&& finish) {
  alignas(64) uint8_t weights[2][G][512];
  alignas(64) int32_t sums[3][G][AMX_ROWS][GROUP];  // the totals after a step, three in turn
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < AMX_ROWS; ++m) _mm512_store_si512(sums[2][g][m], _mm512_setzero_si512());  // before step 0
  const auto step_sums = [&sums](int now, int before) {
    return [&sums, now, before](int g, int m) {
      return _mm512_sub_epi32(_mm512_load_si512(sums[now][g][m]), _mm512_load_si512(sums[before][g][m]));
    };
  };
  configure_tiles();
  zero_sums();
  int previous = 2, before = 2;  // where the totals after steps s - 1 and s - 2 lie
  for (int64_t s = 0; s < steps; ++s) {
    const uint8_t* tiles[G];
    prepare(s, weights[s & 1], tiles);
    load_inputs(inputs(s), stride);
    const int now = previous == 2 ? 0 : previous + 1;
    tile_products<G>(tiles, &sums[now][0][0][0]);
    if (s > 0) finish(s - 1, step_sums(previous, before));
    before = previous, previous = now;
  }
  finish(steps - 1, step_sums(previous, before));
}

// G groups of a 32-weight type times x's rows m0..m0+15, on tiles: out[g][m][r]. A step is a block; its fp32
// steps are legacy_x16_tile's block_step, block by block: its bits.
template <int64_t type, int G>
void legacy_amx_groups(const uint8_t* group, int64_t group_bytes, const QRows& x, int64_t m0,
                       float (*out)[AMX_ROWS][GROUP]) {
  constexpr int64_t gb = legacy_group_bytes<type>();
  const int64_t B = x.K / 32, width = x.chunks * 64;
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < AMX_ROWS; ++m) _mm512_storeu_ps(out[g][m], _mm512_setzero_ps());
  const auto prepare = [&](int64_t b, uint8_t (*buffer)[512], const uint8_t** tiles) {
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = group + g * group_bytes + b * gb;
      fetch_lines(p, gb, AHEAD_BLOCKS * gb);
      const uint8_t* q = p + (has_min<type>() ? 64 : 32);
      tiles[g] = q;  // Q8_0's block is the B tile as it lies
      if constexpr (type != Q8_0) {
        __m512i u[8];
        unpack_legacy<type>(q, u);
        for (int v = 0; v < 8; ++v) _mm512_store_si512(buffer[g] + 64 * v, u[v]);
        tiles[g] = buffer[g];
      }
    }
  };
  const auto inputs = [&](int64_t b) { return x.q.data() + m0 * width + 32 * b; };
  const auto finish = [&](int64_t b, auto&& sums) {
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = group + g * group_bytes + b * gb;
      const __m512 d = _mm512_cvtph_ps(load32(p));
      const __m512 mn = has_min<type>() ? _mm512_cvtph_ps(load32(p + 32)) : _mm512_setzero_ps();
#pragma GCC unroll 16
      for (int m = 0; m < AMX_ROWS; ++m) {
        const int64_t blk = (m0 + m) * B + b;
        const __m512i i = _mm512_add_epi32(offset_term<type>(x, blk), sums(g, m));
        _mm512_storeu_ps(out[g][m], block_step<type>(_mm512_loadu_ps(out[g][m]), i, d, mn, x, blk));
      }
    }
  };
  amx_steps<G>(B, width, prepare, inputs, finish);
}

// G groups of Q4_K times x's rows m0..m0+15, on tiles: out[g][m][r]. A step is a sub-block (the low or high
// nibbles of a 512-byte chunk); its sums meet the sub-block's scale in int32 (vpmulld) and the super-block's
// total meets fp32 once, as in q4k_x16_tile: its bits.
template <int G>
void q4k_amx_groups(const uint8_t* group, int64_t group_bytes, const KRows& x, int64_t m0,
                    float (*out)[AMX_ROWS][GROUP]) {
  const int64_t S = x.supers, width = x.K;
  constexpr int64_t ahead = AHEAD_SUPERS * Q4_K_GROUP_BYTES;
  const __m512i low = _mm512_set1_epi8(15);
  alignas(64) int32_t total[G][AMX_ROWS][GROUP];
  for (int g = 0; g < G; ++g)
    for (int m = 0; m < AMX_ROWS; ++m) _mm512_storeu_ps(out[g][m], _mm512_setzero_ps());
  const auto prepare = [&](int64_t s, uint8_t (*buffer)[512], const uint8_t** tiles) {
    const int64_t sb = s / 8, j = s % 8;
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = group + g * group_bytes + sb * Q4_K_GROUP_BYTES;
      const uint8_t* q = p + 320 + 512 * (j / 2);
      if (j == 0) fetch_lines(p, 320, ahead);  // d, dmin, the scales and minimums
      if (j % 2 == 0) fetch_lines(q, 512, ahead);
      for (int v = 0; v < 8; ++v) {
        const __m512i packed = _mm512_loadu_si512(q + 64 * v);
        _mm512_store_si512(buffer[g] + 64 * v, _mm512_and_si512(j % 2 ? _mm512_srli_epi16(packed, 4) : packed, low));
      }
      tiles[g] = buffer[g];
    }
  };
  const auto inputs = [&](int64_t s) { return x.q.data() + m0 * width + 256 * (s / 8) + 32 * (s % 8); };
  const auto finish = [&](int64_t s, auto&& sums) {
    const int64_t sb = s / 8, j = s % 8;
    for (int g = 0; g < G; ++g) {
      const uint8_t* p = group + g * group_bytes + sb * Q4_K_GROUP_BYTES;
      const __m512i sc = _mm512_cvtepu8_epi32(load16(p + 64 + 16 * j));
#pragma GCC unroll 16
      for (int m = 0; m < AMX_ROWS; ++m) {
        const __m512i t = _mm512_mullo_epi32(sums(g, m), sc);
        _mm512_store_si512(total[g][m], j == 0 ? t : _mm512_add_epi32(_mm512_load_si512(total[g][m]), t));
      }
      if (j < 7) continue;
      const __m512 d = _mm512_cvtph_ps(load32(p)), dmin = _mm512_cvtph_ps(load32(p + 32));
      __m512i mins[4];
      for (int i = 0; i < 4; ++i) mins[i] = _mm512_cvtepu8_epi16(load32(p + 192 + 32 * i));
      for (int m = 0; m < AMX_ROWS; ++m) {
        const int64_t r = (m0 + m) * S + sb;
        __m512i mn = _mm512_setzero_si512();
        for (int i = 0; i < 4; ++i) mn = _mm512_dpwssd_epi32(mn, mins[i], _mm512_set1_epi32(x.pair32[4 * r + i]));
        const float dx = x.scale[r];
        __m512 acc = _mm512_loadu_ps(out[g][m]);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(total[g][m])), _mm512_mul_ps(d, _mm512_set1_ps(dx)),
                              acc);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mn), _mm512_mul_ps(dmin, _mm512_set1_ps(-dx)), acc);
        _mm512_storeu_ps(out[g][m], acc);
      }
    }
  };
  amx_steps<G>(8 * S, width, prepare, inputs, finish);
}

template <int64_t type>
struct LegacyAmx {
  template <int G>
  struct At {
    static void run(const uint8_t* g, int64_t gb, const QRows& x, int64_t m0, float (*out)[AMX_ROWS][GROUP]) {
      legacy_amx_groups<type, G>(g, gb, x, m0, out);
    }
  };
};
template <int G>
struct Q4KAmx {
  static void run(const uint8_t* g, int64_t gb, const KRows& x, int64_t m0, float (*out)[AMX_ROWS][GROUP]) {
    q4k_amx_groups<G>(g, gb, x, m0, out);
  }
};

// y[:, lo..hi) of one regrouped part, its input rows sixteen at a time on tiles (Groups<G>: three groups of weight
// rows side by side, sharing each step's input tile) and the rows past the last sixteen on the VNNI kernels (Tile).
template <typename Rows, template <int> class Groups, template <int> class Tile>
void amx_part_outputs(const uint8_t* groups, int64_t group_bytes, int64_t lo, int64_t hi, const Rows& x, float* y,
                      int64_t N) {
  const int64_t full = x.M / AMX_ROWS * AMX_ROWS;
  float out[3][AMX_ROWS][GROUP];
  const int64_t block = std::max<int64_t>(3 * GROUP, WEIGHT_BLOCK / group_bytes / 3 * 3 * GROUP);
  for (int64_t j0 = lo; j0 < hi; j0 += block)
    for (int64_t m0 = 0; m0 < full; m0 += AMX_ROWS)
      for (int64_t j = j0; j < std::min(hi, j0 + block); j += 3 * GROUP) {
        const int G = static_cast<int>(std::min<int64_t>(3, (std::min(hi, j0 + block) - j) / GROUP));
        const uint8_t* g = groups + (j - lo) / GROUP * group_bytes;
        if (G == 3) Groups<3>::run(g, group_bytes, x, m0, out);
        else if (G == 2) Groups<2>::run(g, group_bytes, x, m0, out);
        else Groups<1>::run(g, group_bytes, x, m0, out);
        for (int k = 0; k < G; ++k)
          for (int m = 0; m < AMX_ROWS; ++m) std::memcpy(y + (m0 + m) * N + j + GROUP * k, out[k][m], sizeof out[k][m]);
      }
  if (full < x.M) tiled_outputs<Rows, Tile>(groups, group_bytes, lo, hi, x, y, N, full);
}

// Whether the tiles take a GGML type's regrouped products: the 32-weight types and Q4_K (Q6_K keeps VNNI).
constexpr bool amx_takes(int64_t type) {
  return type == Q4_0 || type == Q4_1 || type == Q5_0 || type == Q5_1 || type == Q8_0 || type == Q4_K;
}

// y[:, lo..hi) of one regrouped part on tiles where they take it (amx_takes, at least sixteen input rows); false
// otherwise, and the VNNI kernels run.
bool amx_outputs(int64_t type, const uint8_t* groups, int64_t group_bytes, int64_t lo, int64_t hi, const QRows& qx,
                 const KRows& kx, float* y, int64_t N) {
  const int64_t base = regrouped_base(type);
  if (!amx_takes(base) || (base == Q4_K ? kx.M : qx.M) < AMX_ROWS) return false;
  dispatch(base, [&]<int64_t t>() {
    if constexpr (t == Q4_K)
      amx_part_outputs<KRows, Q4KAmx, Q4KTile>(groups, group_bytes, lo, hi, kx, y, N);
    else if constexpr (amx_takes(t))
      amx_part_outputs<QRows, LegacyAmx<t>::template At, LegacyTile<t>::template At>(groups, group_bytes, lo, hi, qx,
                                                                                     y, N);
  });
  return true;
}

}  // namespace
#endif
