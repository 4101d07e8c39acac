// Decoding a row of GGML blocks to fp32 in registers, exactly as ggml's dequantize_row_* does.
#pragma once

#include "common.h"

namespace {

// Dequantizes a row of K weights as ggml does (dequantize_row_*: scale times the quantized integer,
// plus the block's minimum where the type has one) and hands them to emit(c, w0, w1) 32 at a time,
// in order: w0 holds weights c..c+15, w1 weights c+16..c+31. Scale times integer is exact in fp32
// for every type here: the fp16 scale's 11 significant bits, a sub-block scale's and the integer's
// come to at most 23 of fp32's 24 (Q6_K: 7 and 5, IQ4_XS: 5 and 7, Q5_K: 6 and 5). So the only
// rounding is the minimum's subtraction (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K), and a fused multiply-add
// gives the same bits as ggml's multiply then subtract. F16 and BF16 widen to fp32 exactly.

// Sub-block j's 6-bit scale and minimum from a Q4_K block's 12 scale bytes (ggml's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* sc, int j, int& scale, int& minimum) {
  if (j < 4) {
    scale = sc[j] & 63;
    minimum = sc[j + 4] & 63;
  } else {
    scale = (sc[j + 4] & 0xF) | ((sc[j - 4] >> 6) << 4);
    minimum = (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
  }
}

// Sub-block i's 6-bit scale of a Q3_K block (12 bytes: low nibbles of scales 0-15 in bytes 0-7, their
// two high bits in bytes 8-11), without ggml's -32.
inline int scale_k3(const uint8_t* sc, int i) {
  return ((sc[i % 8] >> (4 * (i / 8))) & 15) | (((sc[8 + i % 4] >> (2 * (i / 4))) & 3) << 4);
}

// IQ4_NL's and IQ4_XS's 16 levels, indexed by a weight's 4-bit code (ggml's kvalues_iq4nl).
alignas(16) constexpr int8_t IQ4_LEVELS[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                1,    13,   25,  38,  53,  69,  89,  113};

// The levels of 16 codes: the low (shift 0) or high (shift 4) nibbles of q[0..15]. One byte shuffle
// where SSSE3 has it.
template <int shift>
inline ivec iq4_levels(const uint8_t* q) {
#if defined(__SSSE3__)
  const __m128i codes =
      _mm_and_si128(_mm_srli_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)), shift), _mm_set1_epi8(15));
  uint8_t levels[16];
  _mm_storeu_si128(reinterpret_cast<__m128i*>(levels),
                   _mm_shuffle_epi8(_mm_load_si128(reinterpret_cast<const __m128i*>(IQ4_LEVELS)), codes));
  return widen_s8(levels);
#else
  ivec v;
  for (int i = 0; i < L; ++i) v[i] = IQ4_LEVELS[(q[i] >> shift) & 15];
  return v;
#endif
}

// 16 bf16 values as fp32: a bf16 is the upper half of an fp32's bits.
inline vec widen_bf16(const uint8_t* p) {
  typedef uint16_t u16s __attribute__((vector_size(32)));
  typedef uint32_t u32s __attribute__((vector_size(64)));
  u16s h;
  std::memcpy(&h, p, sizeof h);
  const u32s bits = __builtin_convertvector(h, u32s) << 16;
  vec v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}

template <int64_t type, typename Emit>
inline void decode_blocks(const uint8_t* row, int64_t K, Emit&& emit) {
  const Layout lay = layout(type);
  const int64_t blocks = K / lay.block;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* p = row + b * lay.bytes;
    const int64_t c = b * lay.block;
    if constexpr (type == F32) {
      const float* f = reinterpret_cast<const float*>(p);
      emit(c, load(f), load(f + 16));
    } else if constexpr (type == F16) {
      const half* h = reinterpret_cast<const half*>(p);
      emit(c, load(h), load(h + 16));
    } else if constexpr (type == BF16) {
      emit(c, widen_bf16(p), widen_bf16(p + 32));
    } else if constexpr (type == IQ4_NL) {
      const vec d = splat(half_to_float(p));
      emit(c, to_float(iq4_levels<0>(p + 2)) * d, to_float(iq4_levels<4>(p + 2)) * d);
    } else if constexpr (type == Q4_0 || type == Q4_1) {
      const vec d = splat(half_to_float(p)), m = splat(type == Q4_1 ? half_to_float(p + 2) : 0.0f);
      const ivec q = widen_u8(p + (type == Q4_1 ? 4 : 2)), shift = ivec{} + (type == Q4_0 ? 8 : 0);
      emit(c, fma(to_float((q & 15) - shift), d, m), fma(to_float((q >> 4) - shift), d, m));
    } else if constexpr (type == Q5_0 || type == Q5_1) {
      const int head = type == Q5_1 ? 4 : 2;
      const vec d = splat(half_to_float(p)), m = splat(type == Q5_1 ? half_to_float(p + 2) : 0.0f);
      uint32_t qh;
      std::memcpy(&qh, p + head, 4);
      const ivec high = ivec{} + static_cast<int32_t>(qh), shift = ivec{} + (type == Q5_0 ? 16 : 0);
      const ivec q = widen_u8(p + head + 4);
      emit(c, fma(to_float(((q & 15) | (((high >> lanes_from(0)) & 1) << 4)) - shift), d, m),
           fma(to_float(((q >> 4) | (((high >> lanes_from(16)) & 1) << 4)) - shift), d, m));
    } else if constexpr (type == Q8_0) {
      const vec d = splat(half_to_float(p));
      emit(c, to_float(widen_s8(p + 2)) * d, to_float(widen_s8(p + 18)) * d);
    } else if constexpr (type == Q4_K) {
      const float d = half_to_float(p), dmin = half_to_float(p + 2);
      const uint8_t* sc = p + 4;
      const uint8_t* qs = p + 16;
      for (int j = 0; j < 8; ++j) {  // sub-block j: 32 weights, a 6-bit scale and minimum
        int a, e;
        scale_min_k4(sc, j, a, e);
        const vec s = splat(d * static_cast<float>(a)), m = splat(-(dmin * static_cast<float>(e)));
        const uint8_t* q = qs + 32 * (j / 2);  // even sub-blocks take the low nibbles, odd ones the high
        const ivec q0 = widen_u8(q), q1 = widen_u8(q + 16);
        emit(c + 32 * j, fma(to_float(j % 2 ? q0 >> 4 : q0 & 15), s, m), fma(to_float(j % 2 ? q1 >> 4 : q1 & 15), s, m));
      }
    } else if constexpr (type == Q5_K) {  // Q4_K's sub-blocks, and a fifth bit per weight
      const float d = half_to_float(p), dmin = half_to_float(p + 2);
      const uint8_t* sc = p + 4;
      const ivec h0 = widen_u8(p + 16), h1 = widen_u8(p + 32);  // bit j of byte l: weight 32j + l's fifth bit
      const uint8_t* qs = p + 48;
      for (int j = 0; j < 8; ++j) {
        int a, e;
        scale_min_k4(sc, j, a, e);
        const vec s = splat(d * static_cast<float>(a)), m = splat(-(dmin * static_cast<float>(e)));
        const uint8_t* q = qs + 32 * (j / 2);
        const ivec q0 = widen_u8(q), q1 = widen_u8(q + 16);
        const ivec l0 = j % 2 ? q0 >> 4 : q0 & 15, l1 = j % 2 ? q1 >> 4 : q1 & 15;
        emit(c + 32 * j, fma(to_float(l0 | (((h0 >> j) & 1) << 4)), s, m),
             fma(to_float(l1 | (((h1 >> j) & 1) << 4)), s, m));
      }
    } else if constexpr (type == Q2_K) {  // 16 sub-blocks of 16: a 4-bit scale and minimum each
      const uint8_t* sc = p;
      const float d = half_to_float(p + 80), dmin = half_to_float(p + 82);
      for (int half = 0; half < 2; ++half) {  // 128 weights: bits 2j, 2j + 1 of 32 bytes are 32j..32j+31
        const ivec q0 = widen_u8(p + 16 + 32 * half), q1 = widen_u8(p + 32 + 32 * half);
        for (int j = 0; j < 4; ++j) {
          const uint8_t s0 = sc[8 * half + 2 * j], s1 = sc[8 * half + 2 * j + 1];
          emit(c + 128 * half + 32 * j,
               fma(to_float((q0 >> (2 * j)) & 3), splat(d * (s0 & 15)), splat(-(dmin * (s0 >> 4)))),
               fma(to_float((q1 >> (2 * j)) & 3), splat(d * (s1 & 15)), splat(-(dmin * (s1 >> 4)))));
        }
      }
    } else if constexpr (type == Q3_K) {  // Q2_K's layout of low bits, a high bit per weight, 6-bit scales
      const uint8_t* sc = p + 96;
      const float d = half_to_float(p + 108);
      const ivec m0 = widen_u8(p), m1 = widen_u8(p + 16);  // bit b of byte l: weight 32b + l's high bit
      for (int half = 0; half < 2; ++half) {
        const ivec q0 = widen_u8(p + 32 + 32 * half), q1 = widen_u8(p + 48 + 32 * half);
        for (int j = 0; j < 4; ++j) {
          const int bit = 4 * half + j, i = 8 * half + 2 * j;  // i: the sub-block of the first 16
          // ggml's code minus 4 where the high bit is clear: the low bits plus 4 * high bit, minus 4
          const ivec c0 = ((q0 >> (2 * j)) & 3) + (((m0 >> bit) & 1) << 2) - 4;
          const ivec c1 = ((q1 >> (2 * j)) & 3) + (((m1 >> bit) & 1) << 2) - 4;
          emit(c + 32 * bit, to_float(c0) * splat(d * static_cast<float>(scale_k3(sc, i) - 32)),
               to_float(c1) * splat(d * static_cast<float>(scale_k3(sc, i + 1) - 32)));
        }
      }
    } else if constexpr (type == IQ4_XS) {  // IQ4_NL's levels in 8 sub-blocks of 32, a 6-bit scale each
      const float d = half_to_float(p);
      uint16_t high;
      std::memcpy(&high, p + 2, 2);
      for (int j = 0; j < 8; ++j) {
        const int scale = ((p[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
        const vec s = splat(d * static_cast<float>(scale - 32));
        const uint8_t* q = p + 8 + 16 * j;
        emit(c + 32 * j, to_float(iq4_levels<0>(q)) * s, to_float(iq4_levels<4>(q)) * s);
      }
    } else if constexpr (type == Q6_K) {
      const int8_t* sc = reinterpret_cast<const int8_t*>(p + 192);
      const float d = half_to_float(p + 208);
      for (int half = 0; half < 2; ++half) {  // 128 weights: four quarters of 32, each two scales of 16
        const uint8_t* l = p + 64 * half;
        const uint8_t* h = p + 128 + 32 * half;
        const int8_t* s = sc + 8 * half;
        const ivec a0 = widen_u8(l), a1 = widen_u8(l + 16), c0 = widen_u8(l + 32), c1 = widen_u8(l + 48);
        const ivec h0 = widen_u8(h), h1 = widen_u8(h + 16);
        const int64_t o = c + 128 * half;
        emit(o, to_float(((a0 & 15) | ((h0 & 3) << 4)) - 32) * splat(d * s[0]),
             to_float(((a1 & 15) | ((h1 & 3) << 4)) - 32) * splat(d * s[1]));
        emit(o + 32, to_float(((c0 & 15) | (((h0 >> 2) & 3) << 4)) - 32) * splat(d * s[2]),
             to_float(((c1 & 15) | (((h1 >> 2) & 3) << 4)) - 32) * splat(d * s[3]));
        emit(o + 64, to_float(((a0 >> 4) | (((h0 >> 4) & 3) << 4)) - 32) * splat(d * s[4]),
             to_float(((a1 >> 4) | (((h1 >> 4) & 3) << 4)) - 32) * splat(d * s[5]));
        emit(o + 96, to_float(((c0 >> 4) | (((h0 >> 6) & 3) << 4)) - 32) * splat(d * s[6]),
             to_float(((c1 >> 4) | (((h1 >> 6) & 3) << 4)) - 32) * splat(d * s[7]));
      }
    }
  }
}

// Calls f.template operator()<type>() for a run-time GGML type id.
template <typename F>
inline void dispatch(int64_t type, F&& f) {
  switch (type) {
    case F32: return f.template operator()<F32>();
    case F16: return f.template operator()<F16>();
    case BF16: return f.template operator()<BF16>();
    case Q4_0: return f.template operator()<Q4_0>();
    case Q4_1: return f.template operator()<Q4_1>();
    case Q5_0: return f.template operator()<Q5_0>();
    case Q5_1: return f.template operator()<Q5_1>();
    case Q8_0: return f.template operator()<Q8_0>();
    case Q4_K: return f.template operator()<Q4_K>();
    case Q6_K: return f.template operator()<Q6_K>();
    case Q2_K: return f.template operator()<Q2_K>();
    case Q3_K: return f.template operator()<Q3_K>();
    case Q5_K: return f.template operator()<Q5_K>();
    case IQ4_NL: return f.template operator()<IQ4_NL>();
    case IQ4_XS: return f.template operator()<IQ4_XS>();
  }
  TORCH_CHECK(false, "specdec quant: unsupported GGML type ", type);
}

void decode_row(int64_t type, const uint8_t* row, int64_t K, float* w) {
  dispatch(type, [&]<int64_t t>() {
    decode_blocks<t>(row, K, [&](int64_t c, vec w0, vec w1) {
      store(w + c, w0);
      store(w + c + 16, w1);
    });
  });
}

}  // namespace
