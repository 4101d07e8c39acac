// Products with int8 activations over weight rows regrouped sixteen at a time at load (regroup.h), on AVX512-VNNI.
#pragma once

#include "int8_vnni.h"
#include "regroup.h"

#if defined(SPECDEC_VNNI)
namespace {

// sum over v < n of u[v] * (xq[4v..4v+3] broadcast), from init, in `chains` interleaved chains (integer,
// so exact in any order; two hide the latency when few input rows run side by side).
template <int n, int chains>
inline __m512i block_dot(const __m512i* u, const int8_t* xq, __m512i init) {
  if constexpr (chains == 1) {
    for (int v = 0; v < n; ++v) init = _mm512_dpbusd_epi32(init, u[v], _mm512_set1_epi32(load_i32(xq + 4 * v)));
    return init;
  } else {
    __m512i b = _mm512_setzero_si512();
    for (int v = 0; v < n; v += 2) {
      init = _mm512_dpbusd_epi32(init, u[v], _mm512_set1_epi32(load_i32(xq + 4 * v)));
      b = _mm512_dpbusd_epi32(b, u[v + 1], _mm512_set1_epi32(load_i32(xq + 4 * v + 4)));
    }
    return _mm512_add_epi32(init, b);
  }
}

template <int T>
constexpr int chains_for() {
  return T < 4 ? 2 : 1;
}


// A block's weights of sixteen rows (q: the block's bytes after d and m), unpacked: u[v], lane r = row r's
// weights 4v..4v+3 as unsigned bytes.
template <int64_t type>
inline void unpack_legacy(const uint8_t* q, __m512i* u) {
  if constexpr (type == Q8_0) {
    for (int v = 0; v < 8; ++v) u[v] = _mm512_loadu_si512(q + 64 * v);
  } else {
    const __m512i low = _mm512_set1_epi8(15);
    const uint8_t* qs = q + (five_bit<type>() ? 64 : 0);
    for (int g = 0; g < 4; ++g) {
      const __m512i packed = _mm512_loadu_si512(qs + 64 * g);
      u[g] = _mm512_and_si512(packed, low);
      u[g + 4] = _mm512_and_si512(_mm512_srli_epi16(packed, 4), low);
    }
    if constexpr (five_bit<type>()) {
      for (int v = 0; v < 8; ++v) {
        uint64_t high;
        std::memcpy(&high, q + 8 * v, 8);
        u[v] = _mm512_mask_add_epi8(u[v], high, u[v], _mm512_set1_epi8(16));
      }
    }
  }
}

// A 32-block's integer sum starts at -offset * sum(xq) of input row block blk (zero for the types without an offset).
template <int64_t type>
inline __m512i offset_term(const QRows& x, int64_t blk) {
  constexpr int32_t offset = offset_of<type>();
  if constexpr (offset != 0) return _mm512_set1_epi32(x.offset_sum[offset_index(offset)][blk]);
  return _mm512_setzero_si512();
}

// acc after one 32-block of sixteen rows (scales d, minimums mn) for input row block blk, from the block's integer
// sums i, offset included: the fp32 steps of every kernel of these types (VNNI and AMX), so that their bits agree.
template <int64_t type>
inline __m512 block_step(__m512 acc, __m512i i, __m512 d, __m512 mn, const QRows& x, int64_t blk) {
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(i), _mm512_mul_ps(d, _mm512_set1_ps(x.block_scale[blk])), acc);
  if constexpr (has_min<type>()) acc = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.block_scaled_sum[blk]), acc);
  return acc;
}

// One group of sixteen weight rows times T quantized input rows (x's rows m0..m0+T-1): out[m][r].
template <int64_t type, int T>
void legacy_x16_tile(const uint8_t* group, const QRows& x, int64_t m0, float (*out)[GROUP]) {
  constexpr int64_t gb = legacy_group_bytes<type>();
  const int64_t B = x.K / 32, width = x.chunks * 64;
  __m512 acc[T];
  for (int m = 0; m < T; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* p = group + b * gb;
    fetch_lines(p, gb, AHEAD_BLOCKS * gb);
    const __m512 d = _mm512_cvtph_ps(load32(p));
    const __m512 mn = has_min<type>() ? _mm512_cvtph_ps(load32(p + 32)) : _mm512_setzero_ps();
    __m512i u[8];
    unpack_legacy<type>(p + (has_min<type>() ? 64 : 32), u);
#pragma GCC unroll 8
    for (int m = 0; m < T; ++m) {
      const int64_t blk = (m0 + m) * B + b;
      const __m512i i =
          block_dot<8, chains_for<T>()>(u, x.q.data() + (m0 + m) * width + 32 * b, offset_term<type>(x, blk));
      acc[m] = block_step<type>(acc[m], i, d, mn, x, blk);
    }
  }
  for (int m = 0; m < T; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

// ---- Q4_K ---------------------------------------------------------------------------------------
//
// Per super-block and output row: T = sum over sub-blocks j of scale_j * sum_j(u * xq) and Mn = sum_j min_j *
// sum_j(xq) (int32, exact), then acc = fma(float(T), d * dx, acc) and acc = fma(float(Mn), dmin * -dx, acc); acc
// is out, kept in memory (touched once per super-block). The sub-blocks go one after the other (2i the low
// nibbles of chunk i's bytes, 2i + 1 the high ones), each weight vector unpacked once and multiplied into every
// input row (the input row's bytes broadcast): T input rows keep T integer chains (two for one row, to hide
// vpdpbusd's latency) and T totals in registers, so a tile of eight rows goes over the weights once.
template <int T>
void q4k_x16_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[GROUP]) {
  static_assert(T <= X16_TILE, "q4k_x16_tile: at most X16_TILE input rows");
  const int64_t S = x.supers;
  const __m512i low = _mm512_set1_epi8(15);
  constexpr int C = T == 1 ? 2 : 1;
  for (int m = 0; m < T; ++m) _mm512_storeu_ps(out[m], _mm512_setzero_ps());
  for (int64_t sb = 0; sb < S; ++sb) {
    const uint8_t* p = group + sb * Q4_K_GROUP_BYTES;
    __m512i total[T];
    for (int m = 0; m < T; ++m) total[m] = _mm512_setzero_si512();
    for (int i = 0; i < 4; ++i) {
      const uint8_t* q = p + 320 + 512 * i;
      for (int h = 0; h < 2; ++h) {  // sub-block 2i + h: the low (h = 0) or high nibbles
        __m512i sum[C][T];
        for (int c = 0; c < C; ++c)
          for (int m = 0; m < T; ++m) sum[c][m] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int g = 0; g < 8; ++g) {
          constexpr int64_t ahead = AHEAD_SUPERS * Q4_K_GROUP_BYTES;
          if (h == 0) fetch_lines(q + 64 * g, 64, ahead);
          if (i == 0 && h == 1 && g < 5) fetch_lines(p + 64 * g, 64, ahead);  // d, dmin, the scales: 320 bytes
          const __m512i packed = _mm512_loadu_si512(q + 64 * g);
          const __m512i u = _mm512_and_si512(h ? _mm512_srli_epi16(packed, 4) : packed, low);
          const int c = g % C;
#pragma GCC unroll 8
          for (int m = 0; m < T; ++m) {
            const int8_t* xq = x.q.data() + ((m0 + m) * S + sb) * 256 + 64 * i + 32 * h + 4 * g;
            sum[c][m] = _mm512_dpbusd_epi32(sum[c][m], u, _mm512_set1_epi32(load_i32(xq)));
          }
        }
        const __m512i sc = _mm512_cvtepu8_epi32(load16(p + 64 + 32 * i + 16 * h));
        for (int m = 0; m < T; ++m) {
          if constexpr (C == 2) sum[0][m] = _mm512_add_epi32(sum[0][m], sum[1][m]);
          total[m] = _mm512_add_epi32(total[m], _mm512_mullo_epi32(sum[0][m], sc));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(load32(p)), dmin = _mm512_cvtph_ps(load32(p + 32));
    __m512i mins[4];
    for (int i = 0; i < 4; ++i) mins[i] = _mm512_cvtepu8_epi16(load32(p + 192 + 32 * i));
#pragma GCC unroll 8
    for (int m = 0; m < T; ++m) {
      const int64_t r = (m0 + m) * S + sb;
      __m512i mn = _mm512_setzero_si512();
      for (int i = 0; i < 4; ++i) mn = _mm512_dpwssd_epi32(mn, mins[i], _mm512_set1_epi32(x.pair32[4 * r + i]));
      const float dx = x.scale[r];
      __m512 acc = _mm512_loadu_ps(out[m]);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[m]), _mm512_mul_ps(d, _mm512_set1_ps(dx)), acc);
      acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(mn), _mm512_mul_ps(dmin, _mm512_set1_ps(-dx)), acc);
      _mm512_storeu_ps(out[m], acc);
    }
  }
}

// ---- Q6_K ---------------------------------------------------------------------------------------
//
// Per super-block and output row: T = sum over sub-blocks j of scale_j * sum_j((u - 32) * xq) (int32, exact: the
// offset enters as the chain's start, -32 * sum_j(xq)), then acc = fma(float(T), d * dx, acc). Four sub-blocks
// (j, j + 4, j + 8, j + 12) are decoded at a time, their sixteen weight vectors shared by every input row.
template <int T>
void q6k_x16_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[GROUP]) {
  static_assert(T <= X16_TILE, "q6k_x16_tile: at most X16_TILE input rows");
  const int64_t S = x.supers;
  const __m512i low = _mm512_set1_epi8(15), top = _mm512_set1_epi8(0x30);
  __m512 acc[T];
  for (int m = 0; m < T; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < S; ++sb) {
    const uint8_t* p = group + sb * Q6_K_GROUP_BYTES;
    __m512i total[T];
    for (int m = 0; m < T; ++m) total[m] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const uint8_t* run = p + Q6_K_NIBBLES + Q6_K_RUN * j;  // nibble vectors 4j.., 16 + 4j.., high vectors 4j..
      __m512i u[4][4];  // [k: sub-block j + 4k][t: its weights 4t..4t+3]
#pragma GCC unroll 4
      for (int t = 0; t < 4; ++t) {
        const int v = 4 * j + t;
        constexpr int64_t ahead = AHEAD_SUPERS * Q6_K_GROUP_BYTES;
        for (int a = 0; a < 3; ++a) fetch_lines(run + 256 * a + 64 * t, 64, ahead);
        if (v < 5) fetch_lines(p + 64 * v, 64, ahead);  // d and the scales: 288 bytes
        const __m512i n1 = _mm512_loadu_si512(run + 64 * t);
        const __m512i n2 = _mm512_loadu_si512(run + 256 + 64 * t);
        const __m512i h = _mm512_loadu_si512(run + 512 + 64 * t);
        u[0][t] = _mm512_or_si512(_mm512_and_si512(n1, low), _mm512_and_si512(_mm512_slli_epi16(h, 4), top));
        u[1][t] = _mm512_or_si512(_mm512_and_si512(n2, low), _mm512_and_si512(_mm512_slli_epi16(h, 2), top));
        u[2][t] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n1, 4), low), _mm512_and_si512(h, top));
        u[3][t] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(n2, 4), low),
                                  _mm512_and_si512(_mm512_srli_epi16(h, 2), top));
      }
      __m512i sc[4];
      for (int k = 0; k < 4; ++k) sc[k] = _mm512_cvtepi8_epi32(load16(p + 32 + 16 * (j + 4 * k)));
#pragma GCC unroll 4
      for (int m = 0; m < T; ++m) {
        const int64_t r = (m0 + m) * S + sb;
        const int8_t* xq = x.q.data() + 256 * r;
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const int sub = j + 4 * k;
          __m512i sum = _mm512_set1_epi32(-32 * x.sum16[16 * r + sub]);
#pragma GCC unroll 4
          for (int t = 0; t < 4; ++t)
            sum = _mm512_dpbusd_epi32(sum, u[k][t], _mm512_set1_epi32(load_i32(xq + 16 * sub + 4 * t)));
          total[m] = _mm512_add_epi32(total[m], _mm512_mullo_epi32(sum, sc[k]));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(load32(p));
    for (int m = 0; m < T; ++m) {
      const int64_t r = (m0 + m) * S + sb;
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total[m]), _mm512_mul_ps(d, _mm512_set1_ps(x.scale[r])), acc[m]);
    }
  }
  for (int m = 0; m < T; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

}  // namespace
#endif
