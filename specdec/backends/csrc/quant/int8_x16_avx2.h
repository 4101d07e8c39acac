// Products with int8 activations over weight rows regrouped sixteen at a time at load (regroup.h), on AVX2
// without VNNI: the 32-weight types, Q4_K and Q6_K, and (here only) IQ4_NL and IQ4_XS. A group's 64-byte vectors are
// two 32-byte halves of eight rows each (lanes 0-7: rows 8h..8h+7); each half goes through a block on its own. For
// the K-quants, whose kernels go over a whole super-block one half after the other, AVX2 builds lay each half's
// bytes out together, in the order the kernel reads them, so the weights stream from memory in one pass.
// vpdpbusd's four products per 32-bit lane become vpmaddubsw (16-bit pairs) then vpmaddwd (with ones, or with the
// sub-block's scale in both halves of each lane): the same integers, and every fp32 step is regroup.h's, lane by
// lane, so the bits are the VNNI build's (tests/test_isa.py).
//
// No 16-bit sum saturates: unsigned weights of up to 4 bits against |xq| <= 127 give pairs up to 2 * 15 * 127, and
// eight such vpmaddubsw results add up to 30480 < 2^15 before one vpmaddwd; 5-bit weights (Q5_0, Q5_1) go four at
// a time; Q8_0's and the IQ4 types' signed weights go as |w| times xq with w's sign (pairs up to 2 * 128 * 127),
// each product widened at once.
#pragma once

#include "int8_avx2.h"
#include "regroup.h"

#if defined(SPECDEC_AVX2_INT8)
namespace {

inline __m256i bcast4(const int8_t* xq) { return _mm256_set1_epi32(load_i32(xq)); }  // xq[0..3] in every lane
inline __m256i pairs8(__m256i v) {  // 32-bit lanes of small integers -> (v, v) as 16-bit halves
  return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}
template <int T>
inline void store_halves(const __m256 (&acc)[T][2], float (*out)[GROUP]) {  // each input row's 16 outputs
  for (int m = 0; m < T; ++m) {
    _mm256_storeu_ps(out[m], acc[m][0]);
    _mm256_storeu_ps(out[m] + 8, acc[m][1]);
  }
}
inline __m256 halves_fp16(const uint8_t* p) {  // eight fp16 values -> fp32
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// I = sum(w * xq) over one 32-block of half h of a group (q: the block's bytes after d and m), eight rows: xq the
// input row's 32 int8 values, init its offset term.
template <int64_t type>
inline __m256i legacy_sums8(const uint8_t* q, int h, const int8_t* xq, __m256i init) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (type == IQ4_NL) {  // the levels of the codes: signed, as Q8_0's
    const __m256i levels = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)));
    for (int g = 0; g < 4; ++g) {
      const __m256i packed = load32(q + 64 * g + 32 * h);
      for (int c = 0; c < 2; ++c) {  // low nibbles weights 4g.., high nibbles 16 + 4g..
        const __m256i codes = _mm256_and_si256(c ? _mm256_srli_epi16(packed, 4) : packed, _mm256_set1_epi8(15));
        const __m256i w = _mm256_shuffle_epi8(levels, codes);
        const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(bcast4(xq + 4 * (g + 4 * c)), w));
        init = _mm256_add_epi32(init, _mm256_madd_epi16(p, ones));
      }
    }
    return init;
  } else if constexpr (type == Q8_0) {
    for (int v = 0; v < 8; ++v) {
      const __m256i w = load32(q + 64 * v + 32 * h);
      const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(bcast4(xq + 4 * v), w));
      init = _mm256_add_epi32(init, _mm256_madd_epi16(p, ones));
    }
    return init;
  } else {
    const __m256i low = _mm256_set1_epi8(15);
    const uint8_t* qs = q + (five_bit<type>() ? 64 : 0);
    __m256i u[8];
    for (int g = 0; g < 4; ++g) {
      const __m256i packed = load32(qs + 64 * g + 32 * h);
      u[g] = _mm256_and_si256(packed, low);
      u[g + 4] = _mm256_and_si256(_mm256_srli_epi16(packed, 4), low);
    }
    if constexpr (five_bit<type>()) {  // bit v of the plane's byte: weight 4v + i's fifth bit, as 16
      const __m256i plane = load32(q + 32 * h), sixteen = _mm256_set1_epi8(16);
      u[0] = _mm256_or_si256(u[0], _mm256_and_si256(_mm256_slli_epi16(plane, 4), sixteen));
      u[1] = _mm256_or_si256(u[1], _mm256_and_si256(_mm256_slli_epi16(plane, 3), sixteen));
      u[2] = _mm256_or_si256(u[2], _mm256_and_si256(_mm256_slli_epi16(plane, 2), sixteen));
      u[3] = _mm256_or_si256(u[3], _mm256_and_si256(_mm256_slli_epi16(plane, 1), sixteen));
      u[4] = _mm256_or_si256(u[4], _mm256_and_si256(plane, sixteen));
      u[5] = _mm256_or_si256(u[5], _mm256_and_si256(_mm256_srli_epi16(plane, 1), sixteen));
      u[6] = _mm256_or_si256(u[6], _mm256_and_si256(_mm256_srli_epi16(plane, 2), sixteen));
      u[7] = _mm256_or_si256(u[7], _mm256_and_si256(_mm256_srli_epi16(plane, 3), sixteen));
    }
    constexpr int run = five_bit<type>() ? 4 : 8;  // vpmaddubsw results summed in 16 bits
    for (int v0 = 0; v0 < 8; v0 += run) {
      __m256i s = _mm256_maddubs_epi16(u[v0], bcast4(xq + 4 * v0));
      for (int v = v0 + 1; v < v0 + run; ++v) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[v], bcast4(xq + 4 * v)));
      init = _mm256_add_epi32(init, _mm256_madd_epi16(s, ones));
    }
    return init;
  }
}

template <int64_t type, int T>
void legacy_x16_tile(const uint8_t* group, const QRows& x, int64_t m0, float (*out)[GROUP]) {
  constexpr int64_t gb = legacy_group_bytes<type>();
  constexpr int head = has_min<type>() ? 64 : 32;
  const int64_t B = x.K / 32, width = x.chunks * 64;
  __m256 acc[T][2];
  for (int m = 0; m < T; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t b = 0; b < B; ++b) {
    const uint8_t* p = group + b * gb;
    fetch_lines(p, gb, AHEAD_BLOCKS * gb);
    for (int h = 0; h < 2; ++h) {
      const __m256 d = halves_fp16(p + 16 * h);
      const __m256 mn = has_min<type>() ? halves_fp16(p + 32 + 16 * h) : _mm256_setzero_ps();
      for (int m = 0; m < T; ++m) {
        const int64_t blk = (m0 + m) * B + b;
        constexpr int32_t offset = type == Q8_0 ? 0 : offset_of<type>();  // Q8_0: w itself, signed
        const __m256i init =
            offset ? _mm256_set1_epi32(x.offset_sum[offset_index(offset)][blk]) : _mm256_setzero_si256();
        const __m256i i = legacy_sums8<type>(p + head, h, x.q.data() + (m0 + m) * width + 32 * b, init);
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(d, _mm256_set1_ps(x.block_scale[blk])), acc[m][h]);
        if constexpr (has_min<type>()) acc[m][h] = _mm256_fmadd_ps(mn, _mm256_set1_ps(x.block_scaled_sum[blk]), acc[m][h]);
      }
    }
  }
  store_halves<T>(acc, out);
}

// Q4_K: per super-block and half, sub-block j's 32 weights of eight rows are eight vectors of packed nibbles
// (chunk j / 2's, low or high nibbles); their vpmaddubsw results add up in 16 bits, and one vpmaddwd with the rows'
// scales gives scale_j * sum_j(u * xq) per row. The minimums: vpmaddwd of the rows' (min 2i, min 2i + 1) pairs with
// the input's two 32-column sums (KRows::pair32).
template <int T>
void q4k_x16_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[GROUP]) {
  const int64_t S = x.supers;
  const __m256i low = _mm256_set1_epi8(15);
  __m256 acc[T][2];
  for (int m = 0; m < T; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < S; ++sb) {
    const uint8_t* p = group + sb * Q4_K_GROUP_BYTES;
    constexpr int64_t ahead = AHEAD_SUPERS * Q4_K_GROUP_BYTES;  // lines fetched as the first half reads its own
    fetch_lines(p, 320, ahead);  // d, dmin, the scales and minimums
    for (int h = 0; h < 2; ++h) {
      __m256i total[T], mn[T];
      for (int m = 0; m < T; ++m) total[m] = mn[m] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {  // sub-block j: chunk j / 2, low (j even) or high nibbles
        const uint8_t* run = p + Q4_K_NIBBLES + 1024 * h + 256 * (j / 2);  // the half's eight vectors of chunk j / 2
        if (j % 2 == 0) fetch_lines(run, 256, ahead);
        __m256i u[8];
        for (int g = 0; g < 8; ++g) {
          const __m256i packed = load32(run + 32 * g);
          u[g] = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(packed, 4) : packed, low);
        }
        const __m256i scale = pairs8(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 64 + 16 * j + 8 * h))));
        for (int m = 0; m < T; ++m) {
          const int8_t* xq = x.q.data() + ((m0 + m) * S + sb) * 256 + 32 * j;
          __m256i s = _mm256_maddubs_epi16(u[0], bcast4(xq));
          for (int g = 1; g < 8; ++g) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[g], bcast4(xq + 4 * g)));
          total[m] = _mm256_add_epi32(total[m], _mm256_madd_epi16(s, scale));
        }
      }
      const __m256 d = halves_fp16(p + 16 * h), dmin = halves_fp16(p + 32 + 16 * h);
      for (int m = 0; m < T; ++m) {
        const int64_t r = (m0 + m) * S + sb;
        for (int i = 0; i < 4; ++i) {
          const __m256i mins = _mm256_cvtepu8_epi16(load16(p + 192 + 32 * i + 16 * h));
          mn[m] = _mm256_add_epi32(mn[m], _mm256_madd_epi16(mins, _mm256_set1_epi32(x.pair32[4 * r + i])));
        }
        const float dx = x.scale[r];
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[m]), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc[m][h]);
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(mn[m]), _mm256_mul_ps(dmin, _mm256_set1_ps(-dx)), acc[m][h]);
      }
    }
  }
  store_halves<T>(acc, out);
}

// Q6_K (regroup.h's layout, VNNI's): per super-block and half, sub-block j's 16 weights of eight rows are four vectors
// of unsigned u (weights 4t..4t+3). Each 16-bit lane of their four vpmaddubsw results minus 32 times its input
// columns' sum (KRows::offset16) is sum((u - 32) * xq) over eight products, |.| <= 8 * 32 * 127 < 2^15: exact
// however the 16-bit additions wrap on the way (no vpmaddubsw pair saturates: 2 * 63 * 127). One vpmaddwd with the
// rows' scales then gives scale_j * sum_j((u - 32) * xq) per row, and T adds up VNNI's integers.
template <int T>
void q6k_x16_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[GROUP]) {
  const int64_t S = x.supers;
  const __m256i low = _mm256_set1_epi8(15), top = _mm256_set1_epi8(0x30);
  __m256 acc[T][2];
  for (int m = 0; m < T; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < S; ++sb) {
    const uint8_t* p = group + sb * Q6_K_GROUP_BYTES;
    constexpr int64_t ahead = AHEAD_SUPERS * Q6_K_GROUP_BYTES;
    fetch_lines(p, Q6_K_NIBBLES, ahead);  // d and the scales
    for (int h = 0; h < 2; ++h) {
      __m256i total[T];
      for (int m = 0; m < T; ++m) total[m] = _mm256_setzero_si256();
      // sub-block 4k + j: weights 64k + 16j.., the low (k < 2) or high nibbles of vectors 4j + t (+ 16 for odd k)
      const auto sub_block = [&](auto k, int j) {
        const uint8_t* run = p + Q6_K_NIBBLES + Q6_K_HALF * h + Q6_K_RUN * j;
        if (k == 0) fetch_lines(run, Q6_K_RUN, ahead);
        __m256i u[4];
        for (int t = 0; t < 4; ++t) {
          const __m256i nib = load32(run + 128 * (k % 2) + 32 * t), high = load32(run + 256 + 32 * t);
          __m256i lo4, hi2;
          if constexpr (k < 2) lo4 = _mm256_and_si256(nib, low);
          else lo4 = _mm256_and_si256(_mm256_srli_epi16(nib, 4), low);
          if constexpr (k == 0) hi2 = _mm256_slli_epi16(high, 4);
          else if constexpr (k == 1) hi2 = _mm256_slli_epi16(high, 2);
          else if constexpr (k == 2) hi2 = high;
          else hi2 = _mm256_srli_epi16(high, 2);
          u[t] = _mm256_or_si256(lo4, _mm256_and_si256(hi2, top));
        }
        const int sub = 4 * k + j;
        const __m256i scale = pairs8(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32 + 16 * sub + 8 * h))));
        for (int m = 0; m < T; ++m) {
          const int64_t r = (m0 + m) * S + sb;
          const int8_t* xq = x.q.data() + 256 * r + 16 * sub;
          __m256i s = _mm256_sub_epi16(_mm256_maddubs_epi16(u[0], bcast4(xq)), _mm256_set1_epi32(x.offset16[16 * r + sub]));
          for (int t = 1; t < 4; ++t) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(u[t], bcast4(xq + 4 * t)));
          total[m] = _mm256_add_epi32(total[m], _mm256_madd_epi16(s, scale));
        }
      };
      for (int j = 0; j < 4; ++j) {
        sub_block(std::integral_constant<int, 0>{}, j);
        sub_block(std::integral_constant<int, 1>{}, j);
        sub_block(std::integral_constant<int, 2>{}, j);
        sub_block(std::integral_constant<int, 3>{}, j);
      }
      const __m256 d = halves_fp16(p + 16 * h);
      for (int m = 0; m < T; ++m) {
        const int64_t r = (m0 + m) * S + sb;
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[m]), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[r])), acc[m][h]);
      }
    }
  }
  store_halves<T>(acc, out);
}

// IQ4_XS: per super-block and half, sub-block j's codes of eight rows become their signed levels (vpshufb), multiplied
// as |level| times xq with the level's sign; each vpmaddubsw result (pairs up to 2 * 127 * 127) goes straight into
// vpmaddwd with the rows' sub-block scales (|scale - 32| <= 32).
template <int T>
void iq4xs_x16_tile(const uint8_t* group, const KRows& x, int64_t m0, float (*out)[GROUP]) {
  const int64_t S = x.supers;
  const __m256i low = _mm256_set1_epi8(15);
  const __m256i levels = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)));
  __m256 acc[T][2];
  for (int m = 0; m < T; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < S; ++sb) {
    const uint8_t* p = group + sb * IQ4_XS_GROUP_BYTES;
    constexpr int64_t ahead = AHEAD_SUPERS * IQ4_XS_GROUP_BYTES;  // lines fetched as the first half reads its own
    fetch_lines(p, 160, ahead);  // d and the scales
    for (int h = 0; h < 2; ++h) {
      __m256i total[T];
      for (int m = 0; m < T; ++m) total[m] = _mm256_setzero_si256();
      for (int j = 0; j < 8; ++j) {
        __m256i w[8];  // weights 4v..4v+3 of sub-block j: v = g (low nibbles), g + 4 (high)
        const uint8_t* run = p + 160 + 1024 * h + 128 * j;  // the half's four vectors of sub-block j
        fetch_lines(run, 128, ahead);
        for (int g = 0; g < 4; ++g) {
          const __m256i packed = load32(run + 32 * g);
          w[g] = _mm256_shuffle_epi8(levels, _mm256_and_si256(packed, low));
          w[g + 4] = _mm256_shuffle_epi8(levels, _mm256_and_si256(_mm256_srli_epi16(packed, 4), low));
        }
        const __m256i scale = pairs8(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 32 + 16 * j + 8 * h))));
        for (int m = 0; m < T; ++m) {
          const int8_t* xq = x.q.data() + ((m0 + m) * S + sb) * 256 + 32 * j;
          for (int v = 0; v < 8; ++v) {
            const __m256i pr = _mm256_maddubs_epi16(_mm256_sign_epi8(w[v], w[v]), _mm256_sign_epi8(bcast4(xq + 4 * v), w[v]));
            total[m] = _mm256_add_epi32(total[m], _mm256_madd_epi16(pr, scale));
          }
        }
      }
      const __m256 d = halves_fp16(p + 16 * h);
      for (int m = 0; m < T; ++m) {
        const int64_t r = (m0 + m) * S + sb;
        acc[m][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(total[m]), _mm256_mul_ps(d, _mm256_set1_ps(x.scale[r])), acc[m][h]);
      }
    }
  }
  store_halves<T>(acc, out);
}

}  // namespace
#endif
