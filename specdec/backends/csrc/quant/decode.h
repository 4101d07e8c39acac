// Decoding a row of GGML blocks to fp32 in registers, exactly as ggml's dequantize_row_* does.
#pragma once

#include "common.h"

namespace {

// Dequantizes a row of K weights as ggml does (dequantize_row_*: scale times the quantized integer,
// plus the block's minimum where the type has one) and hands them to emit(c, w0, w1) 32 at a time,
// in order: w0 holds weights c..c+15, w1 weights c+16..c+31. Scale times integer is exact in fp32
// for every type here, so the only rounding is the minimum's addition, and a fused multiply-add
// gives the same bits as ggml's multiply then add.
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
    case Q4_0: return f.template operator()<Q4_0>();
    case Q4_1: return f.template operator()<Q4_1>();
    case Q5_0: return f.template operator()<Q5_0>();
    case Q5_1: return f.template operator()<Q5_1>();
    case Q8_0: return f.template operator()<Q8_0>();
    case Q4_K: return f.template operator()<Q4_K>();
    case Q6_K: return f.template operator()<Q6_K>();
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
