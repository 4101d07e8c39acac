// Products with int8 activations in 8-lane halves (AVX2 instructions), a weight row at a time: the
// kernels of AVX2 builds (int8_avx2.h's q8_tile and k_tile), and those of IQ4_NL, Q5_K and IQ4_XS in
// every int8 build, VNNI's included (the same code, so the same bits there). The scheme is int8.h's;
// per 32 columns (one 32-block, or half of a K-quant chunk: lanes 8h..8h+7 of a 16-lane step)
// vpmaddubsw then vpmaddwd with 1 or the sub-block's scale. No 16-bit pair saturates:
//   unsigned weights of up to 6 bits (Q4_0 ... Q6_K, Q5_K: Q4_K's with a fifth bit above each nibble):
//   pairs up to 2 * 63 * 127;
//   signed weights (Q8_0, and the 16 levels of IQ4_NL and IQ4_XS) as |w| times x with w's sign, no
//   offset: pairs up to 2 * 128 * 127 < 2^15; IQ4_XS's sub-block scale is its 6-bit value minus 32.
// Everything inside a block or super-block is integer (exact); then acc = fma(float(S), d * dx, acc)
// and, for the types with minimums, macc = fma(float(Mn), -dmin * dx, macc) (Q4_1, Q5_1: the minimum
// times the lane's input scale * sum), in order; one lane reduction of acc + macc.
#pragma once

#include "int8.h"

#if defined(SPECDEC_INT8)
namespace {

// 32 unsigned bytes u times 32 int8 x, four products summed per 32-bit lane, pairs weighted by the
// 16-bit pairs of `scale`: vpdpbusd (scale 1) or vpmaddubsw then vpdpwssd (a sub-block's scale).
inline __m256i dot4(__m256i u, __m256i x, __m256i scale) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), scale);
}

inline int32_t total(__m256i v) {  // the sum of 8 int32 lanes (exact in any order)
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1))));
}

// 32 bits -> 32 bytes, byte i 16 where bit i is set, else 0 (the fifth bit of Q5_0 and Q5_1).
inline __m256i fifth_bits(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(  // byte i: byte i / 8 of bits
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ULL));  // byte i: bit i % 8
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(16));
}

// The 32-weight types whose weights are signed bytes: multiplied as |w| times x with w's sign, no offset.
template <int64_t type>
constexpr bool signed_weights() {
  return type == Q8_0 || type == IQ4_NL;
}

// A 32-block's weights as 32 bytes, in order: unsigned u for the 4- and 5-bit types, Q8_0's signed values as
// they are, IQ4_NL's levels (signed) of its codes.
template <int64_t type>
inline __m256i block_bytes(const uint8_t* block) {
  if constexpr (type == Q8_0) {
    return load32(block + 2);
  } else if constexpr (type == IQ4_NL) {
    const __m128i q = load16(block + 2);  // low nibbles codes 0-15, high nibbles 16-31
    const __m256i codes = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS))), codes);
  } else {
    constexpr int head = has_min<type>() ? 4 : 2;
    constexpr int qs = (type == Q5_0 || type == Q5_1) ? head + 4 : head;
    const __m128i q = load16(block + qs);  // low nibbles weights 0-15, high nibbles 16-31
    const __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
    if constexpr (type == Q5_0 || type == Q5_1) return _mm256_or_si256(u, fifth_bits(load_u32(block + head)));
    return u;
  }
}

template <int64_t type, int T>
void q8_halves(const uint8_t* row, const QRows& x, int64_t m0, const int32_t* bias, float* out) {
  const int64_t C = x.chunks, bytes = layout(type).bytes;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[T][2], macc[T][2];
  for (int m = 0; m < T; ++m) acc[m][0] = acc[m][1] = macc[m][0] = macc[m][1] = _mm256_setzero_ps();
  // block b is lanes 8h..8h+7 of chunk b / 2, h = b % 2: the halves as constants, so acc stays in registers
  const auto block_step = [&](int64_t b, auto h) {
    const uint8_t* block = row + b * bytes;
    _mm_prefetch(reinterpret_cast<const char*>(block) + PREFETCH, _MM_HINT_T0);
    const __m256 d = _mm256_set1_ps(half_to_float(block));
    const __m256i w = block_bytes<type>(block);
    const __m256i u = signed_weights<type>() ? _mm256_sign_epi8(w, w) : w;  // |w| (Q8_0's -128 reads as 128 unsigned)
    for (int m = 0; m < T; ++m) {
      const int64_t lane = 16 * C * (m0 + m) + 8 * b;  // this block's 8 lanes in the input row (chunk b / 2, half h)
      __m256i xq = load32(reinterpret_cast<const uint8_t*>(x.q.data()) + 4 * lane);
      if constexpr (signed_weights<type>()) xq = _mm256_sign_epi8(xq, w);
      __m256i i = dot4(u, xq, ones);
      if constexpr (offset_of<type>() != 0 && !signed_weights<type>())
        i = _mm256_add_epi32(i, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias + lane)));
      acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, _mm256_loadu_ps(x.scale.data() + lane)), acc[m][h]);
      if constexpr (has_min<type>())
        macc[m][h] = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(block + 2)), _mm256_loadu_ps(x.sum4f.data() + lane),
                                     macc[m][h]);
    }
  };
  const int64_t blocks = x.K / 32;
  for (int64_t b = 0; b + 1 < blocks; b += 2) {
    block_step(b, std::integral_constant<int, 0>{});
    block_step(b + 1, std::integral_constant<int, 1>{});
  }
  if (blocks % 2) block_step(blocks - 1, std::integral_constant<int, 0>{});
  for (int m = 0; m < T; ++m) {
    if constexpr (has_min<type>())
      out[m] = lane_sum(_mm256_add_ps(acc[m][0], macc[m][0]), _mm256_add_ps(acc[m][1], macc[m][1]));
    else
      out[m] = lane_sum(acc[m][0], acc[m][1]);
  }
}

// One super-block decoded for k_halves: eight halves of chunks (chunk c's first 32 columns at 2c, the next
// 32 at 2c + 1; sub-block j of Q4_K, Q5_K and IQ4_XS at j) as unsigned bytes u (IQ4_XS: |w|, its signs in
// sign), with their 32-bit lanes' sub-block scales as 16-bit pairs; per 16 columns g (lanes 0-7: g < 8),
// the integer that multiplies the sum of xq there (Q4_K, Q5_K: the 6-bit minimum of sub-block g / 2;
// Q6_K: -32 * scale, the offset); d, and for Q4_K and Q5_K -dmin.
struct Super8 {
  __m256i u[8], sign[8], scale[8], mins[2];
  float d, dmin;
};

// Q4_K's and Q5_K's 6-bit scales and minimums of sub-blocks 0-7 from their 12 bytes at k (get_scale_min_k4;
// 16 bytes are read): bytes 0-7 the scales, 8-15 the minimums. Sub-block j < 4 has scale k[j] & 63 and minimum
// k[j + 4] & 63; j >= 4 the low nibble (scale) or high nibble (minimum) of k[j + 4] with the top two bits of
// k[j - 4] (scale) or k[j] (minimum) above it. As 32-bit words w0 w1 w2, four sub-blocks a lane.
inline __m128i scales_mins_k4(const uint8_t* k) {
  const __m128i w = _mm_loadu_si128(reinterpret_cast<const __m128i*>(k));
  const __m128i low = _mm_and_si128(_mm_srlv_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(2, 2, 1, 0)), _mm_setr_epi32(0, 0, 0, 4)),
                                    _mm_setr_epi32(0x3f3f3f3f, 0x3f3f3f3f, 0x0f0f0f0f, 0x0f0f0f0f));
  const __m128i high = _mm_slli_epi32(
      _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(w, _MM_SHUFFLE(1, 0, 1, 0)), 6), _mm_setr_epi32(0, 0, 0x03030303, 0x03030303)),
      4);
  return _mm_shuffle_epi32(_mm_or_si128(low, high), _MM_SHUFFLE(3, 1, 2, 0));  // scales 0-3, 4-7, minimums 0-3, 4-7
}

template <int64_t type>
inline void decode_super(const uint8_t* p, Super8& s) {
  const __m256i low = _mm256_set1_epi8(15);
  if constexpr (type == Q4_K || type == Q5_K) {
    s.d = half_to_float(p);
    s.dmin = -half_to_float(p + 2);
    const __m128i sm = scales_mins_k4(p + 4);
    const uint8_t* qs = p + (type == Q5_K ? 48 : 16);
    for (int c = 0; c < 4; ++c) {  // chunk c: sub-block 2c (low nibbles), 2c + 1 (high nibbles)
      const __m256i q = load32(qs + 32 * c);
      s.u[2 * c] = _mm256_and_si256(q, low);
      s.u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
    }
    if constexpr (type == Q5_K) {  // bit j of byte l of qh: weight 32j + l's fifth bit
      const __m256i qh = load32(p + 16), one = _mm256_set1_epi8(1);
      for (int j = 0; j < 8; ++j)
        s.u[j] = _mm256_or_si256(s.u[j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, j), one), 4));
    }
    const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  // 16-bit scales 0-7, twice
    for (int j = 0; j < 8; ++j)  // scale j in every 16-bit lane: bytes 2j, 2j + 1 of each 128-bit half
      s.scale[j] = _mm256_shuffle_epi8(scales, _mm256_set1_epi16(static_cast<int16_t>(0x0100 + 0x0202 * j)));
    const __m128i twice = _mm_unpackhi_epi8(sm, sm);  // the minimums, each twice: one per 16 columns
    s.mins[0] = _mm256_cvtepu8_epi32(twice);
    s.mins[1] = _mm256_cvtepu8_epi32(_mm_srli_si128(twice, 8));
  } else if constexpr (type == IQ4_XS) {
    s.d = half_to_float(p);
    s.dmin = 0.0f;
    uint16_t high;
    std::memcpy(&high, p + 2, 2);
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)));
    for (int j = 0; j < 8; ++j) {  // sub-block j: 16 bytes, low nibbles its weights 0-15, high nibbles 16-31
      const __m128i q = load16(p + 8 + 16 * j);
      const __m256i w = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), low));
      s.u[j] = _mm256_sign_epi8(w, w);
      s.sign[j] = w;
      const int scale = ((p[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
      s.scale[j] = _mm256_set1_epi16(static_cast<int16_t>(scale - 32));
    }
    s.mins[0] = s.mins[1] = _mm256_setzero_si256();
  } else {
    static_assert(type == Q6_K);
    s.d = half_to_float(p + 208);
    s.dmin = 0.0f;
    const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);  // one scale per 16 columns
    const __m256i three = _mm256_set1_epi8(3);
    for (int half = 0; half < 2; ++half) {  // 128 columns: ql 64 bytes, qh 32
      const __m256i l0 = load32(p + 64 * half), l1 = load32(p + 64 * half + 32), h = load32(p + 128 + 32 * half);
      const auto six = [&](__m256i l, int shift_l, int shift_h) {  // 4 bits of l, 2 of h above them
        return _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, shift_l), low),
                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, shift_h), three), 4));
      };
      s.u[4 * half] = six(l0, 0, 0);      // columns 128 half + 0..31
      s.u[4 * half + 1] = six(l1, 0, 2);  // + 32..63
      s.u[4 * half + 2] = six(l0, 4, 4);  // + 64..95
      s.u[4 * half + 3] = six(l1, 4, 6);  // + 96..127
    }
    const __m128i sc16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc));
    const __m256i scales[2] = {_mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(sc16)),  // 16-bit scales 0-7, twice
                               _mm256_broadcastsi128_si256(_mm_cvtepi8_epi16(_mm_srli_si128(sc16, 8)))};  // 8-15
    for (int i = 0; i < 8; ++i) {  // 32 columns: lanes 0-3 the scale of their first 16 (2i), lanes 4-7 the next
      const int a = 2 * (2 * i % 8);  // the byte of scale 2i in its half
      s.scale[i] = _mm256_shuffle_epi8(scales[i / 4], _mm256_setr_epi8(a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1,
                                                                       a, a + 1, a, a + 1, a + 2, a + 3, a + 2, a + 3, a + 2, a + 3,
                                                                       a + 2, a + 3, a + 2, a + 3, a + 2, a + 3, a + 2, a + 3, a + 2,
                                                                       a + 3));
    }
    for (int i = 0; i < 2; ++i)  // -32 * scale, as -(scale << 5)
      s.mins[i] = _mm256_sub_epi32(_mm256_setzero_si256(),
                                   _mm256_slli_epi32(_mm256_cvtepi8_epi32(_mm_srli_si128(sc16, 8 * i)), 5));
  }
}

template <int64_t type, int T>
void k_halves(const uint8_t* row, const KRows& x, int64_t m0, float* out) {
  const int64_t S = x.supers;
  __m256 acc[T][2], macc[T][2];
  for (int m = 0; m < T; ++m) acc[m][0] = acc[m][1] = macc[m][0] = macc[m][1] = _mm256_setzero_ps();
  Super8 s;
  for (int64_t sb = 0; sb < S; ++sb) {
    const uint8_t* p = row + sb * layout(type).bytes;
    for (int line = 0; line < 3; ++line) _mm_prefetch(reinterpret_cast<const char*>(p) + PREFETCH + 64 * line, _MM_HINT_T0);
    decode_super<type>(p, s);
    for (int m = 0; m < T; ++m) {
      const int64_t r = (m0 + m) * S + sb;
      const uint8_t* xq = reinterpret_cast<const uint8_t*>(x.q.data() + 256 * r);
      const float dx = x.scale[r];
      for (int h = 0; h < 2; ++h) {  // lanes 8h..8h+7 of every chunk (integers: exact in any order)
        const auto part = [&](int c) {  // chunk c's half h: 32 columns
          __m256i xv = load32(xq + 64 * c + 32 * h);
          if constexpr (type == IQ4_XS) xv = _mm256_sign_epi8(xv, s.sign[2 * c + h]);
          return dot4(s.u[2 * c + h], xv, s.scale[2 * c + h]);
        };
        __m256i t = part(0);
        for (int c = 1; c < 4; ++c) t = _mm256_add_epi32(t, part(c));
        const auto offsets = [&]() {  // per 16 columns: sum of xq times the minimum or the offset
          const __m256i sum16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.sum16.data() + 16 * r + 8 * h));
          return _mm256_mullo_epi32(sum16, s.mins[h]);
        };
        if constexpr (type == Q6_K) t = _mm256_add_epi32(t, offsets());
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(t), _mm256_set1_ps(s.d * dx), acc[m][h]);
        if constexpr (type == Q4_K || type == Q5_K)
          macc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(offsets()), _mm256_set1_ps(s.dmin * dx), macc[m][h]);
      }
    }
  }
  for (int m = 0; m < T; ++m) {
    out[m] = lane_sum(_mm256_add_ps(acc[m][0], macc[m][0]), _mm256_add_ps(acc[m][1], macc[m][1]));
  }
}

}  // namespace
#endif
