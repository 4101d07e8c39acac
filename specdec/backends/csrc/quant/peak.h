// The arithmetic peak of this CPU's product instructions, measured: what a row's marginal cost is held against.
#pragma once

#include "amx.h"
#include "common.h"

#include <chrono>

namespace {

// Multiply-adds per second of all of torch's threads running one instruction back to back in registers
// (twelve independent accumulators, no memory): "int8" vpdpbusd (64 int8 multiply-adds each, AVX512-VNNI;
// with AVX2 alone, vpmaddubsw + vpmaddwd + vpaddd, 32),
// "fp32" 16-lane fused multiply-adds. Each thread runs `iterations` rounds of twelve. "amx": four
// independent AMX tile products (16 x 16 x 64 each), iterations / 64 rounds, where amx_ready().
double peak(const std::string& kind, int64_t iterations) {
  TORCH_CHECK(kind == "int8" || kind == "fp32" || kind == "amx", "quant.peak: kind is 'int8', 'fp32' or 'amx', not ",
              kind);
  const int threads = at::get_num_threads();
  const auto start = std::chrono::steady_clock::now();
#if defined(SPECDEC_VNNI)
  if (kind == "amx") {
    TORCH_CHECK(amx_ready() && !AMX_EMULATED, "quant.peak: no AMX here");
    std::vector<double> macs(threads, 0.0);
    const int64_t rounds = std::max<int64_t>(1, iterations / 64);
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) macs[t] = amx_peak_macs(rounds);
    });
    double total = 0;
    for (double m : macs) total += m;
    return total / std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
#endif
  TORCH_CHECK(kind != "amx", "quant.peak: no AMX in this build");
  std::vector<int64_t> sink(threads, 0);
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
#if defined(SPECDEC_VNNI)
      if (kind == "int8") {
        __m512i a[12];
        for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_epi32(i);
        volatile char three = 3, five = 5;  // values the compiler cannot see, so nothing folds
        const __m512i w = _mm512_set1_epi8(three), x = _mm512_set1_epi8(five);
        for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
          for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
        }
        for (int i = 1; i < 12; ++i) a[0] = _mm512_add_epi32(a[0], a[i]);
        sink[t] = _mm512_reduce_add_epi32(a[0]);
        continue;
      }
#elif defined(SPECDEC_AVX2_INT8)
      if (kind == "int8") {  // vpmaddubsw + vpmaddwd + vpaddd: 32 int8 multiply-adds, as the AVX2 kernels go
        __m256i a[12];
        for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_epi32(i);
        volatile char three = 3, five = 5;
        const __m256i w = _mm256_set1_epi8(three), x = _mm256_set1_epi8(five), ones = _mm256_set1_epi16(1);
        for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
          for (int i = 0; i < 12; ++i) a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
        }
        for (int i = 1; i < 12; ++i) a[0] = _mm256_add_epi32(a[0], a[i]);
        sink[t] = _mm256_extract_epi32(a[0], 0);
        continue;
      }
#endif
      TORCH_CHECK(kind == "fp32", "quant.peak: int8 needs AVX2 or AVX512-VNNI");
      vec a[12];
      for (int i = 0; i < 12; ++i) a[i] = splat(static_cast<float>(i));
      volatile float one = 1.0f, zero = 0.0f;
      const vec w = splat(one), x = splat(zero);
      for (int64_t it = 0; it < iterations; ++it) {
#pragma GCC unroll 12
        for (int i = 0; i < 12; ++i) a[i] = fma(a[i], w, x);
      }
      for (int i = 1; i < 12; ++i) a[0] += a[i];
      sink[t] = static_cast<int64_t>(lane_sum(a[0]));
    }
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  volatile int64_t keep = 0;
  for (int64_t s : sink) keep = keep + s;
#if defined(SPECDEC_VNNI)
  const int int8_macs = 64;
#else
  const int int8_macs = 32;
#endif
  return static_cast<double>(threads) * iterations * 12 * (kind == "int8" ? int8_macs : 16) / seconds;
}

}  // namespace
