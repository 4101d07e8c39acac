// Attention over a KV cache, one task per (request, key head) where it can, keys visited in cache order.
#pragma once

#include "common.h"

namespace {

// Software prefetch of the cache rows a scan reaches KEYS_AHEAD keys later (keys and values are read in cache
// order, each row once per task; the hardware's stream prefetch alone left the loads waiting on memory once
// several sequences' caches no longer fit the last-level cache). Changes no output's bits.
constexpr int64_t KEYS_AHEAD = 32;
template <typename T>
inline void fetch_rows(const T* rows, int64_t count, int64_t D) {
  const char* p = reinterpret_cast<const char*>(rows);
  for (int64_t o = 0; o < count * D * static_cast<int64_t>(sizeof(T)); o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
}

#if defined(__AVX512F__)
// Lane t of the result: the sum of acc[t]'s 16 lanes, by one fixed tree (halves of 128-bit quarters, then
// quarters, then pairs within a quarter), so a key's score depends on its own products alone.
inline __m512 reduce16(const __m512* acc) {
  __m512 r1[8], r2[4], r3[2];
  for (int p = 0; p < 8; ++p)  // quarters 0-1: key 2p's (q0 + q2, q1 + q3); quarters 2-3: key 2p + 1's
    r1[p] = _mm512_add_ps(_mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0x44),
                          _mm512_shuffle_f32x4(acc[2 * p], acc[2 * p + 1], 0xEE));
  for (int s = 0; s < 4; ++s)  // quarter c: key 4s + c, four partial sums
    r2[s] = _mm512_add_ps(_mm512_shuffle_f32x4(r1[2 * s], r1[2 * s + 1], 0x88),
                          _mm512_shuffle_f32x4(r1[2 * s], r1[2 * s + 1], 0xDD));
  for (int u = 0; u < 2; ++u)  // quarter c: keys 8u + c and 8u + 4 + c, two partial sums each
    r3[u] = _mm512_add_ps(_mm512_unpacklo_ps(r2[2 * u], r2[2 * u + 1]), _mm512_unpackhi_ps(r2[2 * u], r2[2 * u + 1]));
  const __m512 lo = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(r3[0]), _mm512_castps_pd(r3[1])));
  const __m512 hi = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(r3[0]), _mm512_castps_pd(r3[1])));
  // lane 4c + e holds key c + 4e
  return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15),
                               _mm512_add_ps(lo, hi));
}

// score[t] = sc * (q . k_t) for the jn <= 16 keys at k (rows of 16 V values, fp32 or fp16); each dot product
// over its 16-lane chunks in order, then reduce16: the same operations for a key whatever block or query it is in.
template <int V, typename T>
inline void block_scores(const float* q, const T* k, int jn, float sc, float* score) {
  __m512 qv[V], acc[16];
  for (int e = 0; e < V; ++e) qv[e] = _mm512_loadu_ps(q + 16 * e);
  const auto key = [&](int t) {  // key t's 16-lane products, its chunks in order
    __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int e = 0; e < V; ++e) a = _mm512_fmadd_ps(qv[e], (__m512)load(k + t * 16 * V + 16 * e), a);
    return a;
  };
  if (jn == 16) {  // a whole block without a test per key, so that its sums stay in registers
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t) acc[t] = key(t);
  } else {
    for (int t = 0; t < 16; ++t) acc[t] = t < jn ? key(t) : _mm512_setzero_ps();
  }
  _mm512_storeu_ps(score, _mm512_mul_ps(reduce16(acc), _mm512_set1_ps(sc)));
}
#endif

// score[j] = sc * (q . k_j) for keys j < keys (rows of D values at k); score has room for keys + 16.
template <typename T>
inline void scores(const float* q, const T* k, int64_t keys, int64_t D, float sc, float* score) {
#if defined(__AVX512F__)
  if (D == 64 || D == 128) {
    for (int64_t j0 = 0; j0 < keys; j0 += 16) {
      const int jn = static_cast<int>(std::min<int64_t>(16, keys - j0));
      if (D == 64)
        block_scores<4>(q, k + j0 * D, jn, sc, score + j0);
      else
        block_scores<8>(q, k + j0 * D, jn, sc, score + j0);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < keys; ++j) score[j] = dot(q, k + j * D, D) * sc;
}

template <int V, typename T>
inline void weighted_values(const float* p, const int64_t* seen, int64_t count, const T* values, float* acc) {
#if defined(SPECDEC_HALVES)
  __m256 a[2 * V];
  for (int e = 0; e < 2 * V; ++e) a[e] = _mm256_setzero_ps();
  for (int64_t c = 0; c < count; ++c) {
    const T* row = values + seen[c] * (16 * V);
    const __m256 w = _mm256_set1_ps(p[c]);
    for (int e = 0; e < 2 * V; ++e) a[e] = _mm256_fmadd_ps(w, load8(row + 8 * e), a[e]);
  }
  for (int e = 0; e < 2 * V; ++e) _mm256_storeu_ps(acc + 8 * e, a[e]);
#else
  vec a[V] = {};
  for (int64_t c = 0; c < count; ++c) {
    const T* row = values + seen[c] * (16 * V);
    const vec w = splat(p[c]);
    for (int e = 0; e < V; ++e) a[e] = fma(w, load(row + 16 * e), a[e]);
  }
  for (int e = 0; e < V; ++e) store(acc + 16 * e, a[e]);
#endif
}

// One attention over a cache: n new positions of q (row i at q + i * q_stride, H heads of D floats)
// over keys and values (KVH, cap, D) of T (fp32 or fp16) that hold them already at start..start+n-1,
// with mask (n, start+n) or null (causal); writes out (n, H * D).
template <typename T>
struct Attention {
  const float* q;
  int64_t q_stride, n;
  const T *kp, *vp;
  int64_t cap, start;
  const bool* mask;
  float* out;
};

// Position i of attention a, its scores of keys 0..limit-1 (limit = start + n with a mask, start + i + 1
// causally) in score: keeps the visible ones in cache order (score[c] for key seen[c]) and turns them into
// e^(score - max), in place. Returns (their count, their sum). seen may be null causally (key c is seen[c] = c).
// lead, when not null, gets how many keys from the first are all visible (seen[c] = c below it): causally all
// of them; under a token tree's mask the cached prefix, found with memchr, so that only the tree's own keys are
// tested one by one.
template <typename T>
std::pair<int64_t, float> softmax_visible(const Attention<T>& a, int64_t i, float* score, int64_t* seen,
                                          int64_t* lead = nullptr) {
  const int64_t keys = a.start + a.n;
  int64_t count = a.mask ? keys : a.start + i + 1;
  if (a.mask) {
    const bool* row = a.mask + i * keys;
    const void* hidden = std::memchr(row, 0, keys);  // the first key it does not see (bool: one byte, 0 or 1)
    count = hidden ? static_cast<const bool*>(hidden) - row : keys;
    for (int64_t j = 0; j < count; ++j) seen[j] = j;
    if (lead) *lead = count;
    for (int64_t j = count; j < keys; ++j)
      if (row[j]) {
        seen[count] = j;
        score[count++] = score[j];  // count <= j: in place
      }
  } else {
    if (seen)
      for (int64_t j = 0; j < count; ++j) seen[j] = j;
    if (lead) *lead = count;
  }
  vec most = splat(score[0]);  // the maximum, 16 lanes at a time (exact in any order)
  int64_t m = 0;
  for (; m + L <= count; m += L) most = load(score + m) > most ? load(score + m) : most;
  float top = most[0];
  for (int l = 1; l < L; ++l) top = std::max(top, most[l]);
  for (; m < count; ++m) top = std::max(top, score[m]);
  vec total = {};
  int64_t c = 0;
  for (; c + L <= count; c += L) {
    const vec e = vexp(load(score + c) - splat(top));
    store(score + c, e);
    total += e;
  }
  float sum = lane_sum(total);
  if (c < count) {  // the last count - c < 16 in one vector (e^x is lane by lane: sexp's bits), added one by one
    float tail[L];
    store(tail, vexp(load(score + c) - splat(top)));  // score has room for 16 past the keys; unused lanes dropped
    for (int l = 0; c < count; ++c, ++l) {
      score[c] = tail[l];
      sum += score[c];
    }
  }
  return {count, sum};
}

// Position i, head h of attention a, alone; score, seen: room for start + n + 16 values, acc for D.
template <typename T>
void attend_one(const Attention<T>& a, int64_t i, int64_t h, int64_t H, int64_t D, int64_t KVH, float sc, float* score,
                int64_t* seen, float* acc) {
  const int64_t g = h / (H / KVH);
  const T* vg = a.vp + g * a.cap * D;
  scores(a.q + i * a.q_stride + h * D, a.kp + g * a.cap * D, a.mask ? a.start + a.n : a.start + i + 1, D, sc, score);
  const auto [count, sum] = softmax_visible(a, i, score, seen);
  if (D == 64) {
    weighted_values<4>(score, seen, count, vg, acc);
  } else if (D == 128) {
    weighted_values<8>(score, seen, count, vg, acc);
  } else {
    std::fill(acc, acc + D, 0.0f);
    for (int64_t c = 0; c < count; ++c) {
      const T* vr = vg + seen[c] * D;
      int64_t e = 0;
#if defined(SPECDEC_HALVES)
      const __m256 p = _mm256_set1_ps(score[c]);
      for (; e < D / L * L; e += 8) _mm256_storeu_ps(acc + e, _mm256_fmadd_ps(p, load8(vr + e), _mm256_loadu_ps(acc + e)));
#else
      const vec p = splat(score[c]);
      for (; e + L <= D; e += L) store(acc + e, fma(p, load(vr + e), load(acc + e)));
#endif
      for (; e < D; ++e) acc[e] = std::fma(score[c], static_cast<float>(vr[e]), acc[e]);
    }
  }
  float* o = a.out + i * H * D + h * D;
  for (int64_t e = 0; e < D; ++e) o[e] = acc[e] / sum;
}

// A thread's room for one head's rows: scores, visible keys, value sums.
struct Scratch {
  std::vector<float> score, acc;
  std::vector<int64_t> seen, count, lead;
  std::vector<float> sum;
};

#if defined(__AVX512F__)
// Rows t < TN of one head: acc[t] = sum over row t's visible keys c, in cache order, of p[t][c] * the value
// row seen[t][c] (rows of 16 V values; seen[t] null: key c is c, causally): each row's multiply-adds one chain in key
// order, weighted_values' operations, while each value row is read once for the TN rows. lead[t]: row t sees keys
// 0..lead[t]-1, all of them (softmax_visible's lead), so up to the least lead every row takes every key untested.
template <int V, int TN, typename T>
void tile_values(float* const* p, int64_t* const* seen, const int64_t* count, const int64_t* lead, const T* values,
                 float* const* acc) {
  __m512 a[TN][V];
  int64_t cur[TN], end = 0;
  for (int t = 0; t < TN; ++t) {
    for (int e = 0; e < V; ++e) a[t][e] = _mm512_setzero_ps();
    if (count[t]) end = std::max(end, seen[t] ? seen[t][count[t] - 1] + 1 : count[t]);
  }
  const int64_t common = *std::min_element(lead, lead + TN);
  int64_t j = 0;
  for (; j < common; ++j) {
    if (j + KEYS_AHEAD < end) fetch_rows(values + (j + KEYS_AHEAD) * 16 * V, 1, 16 * V);
    __m512 v[V];
    for (int e = 0; e < V; ++e) v[e] = (__m512)load(values + j * 16 * V + 16 * e);
    for (int t = 0; t < TN; ++t) {
      const __m512 w = _mm512_set1_ps(p[t][j]);
      for (int e = 0; e < V; ++e) a[t][e] = _mm512_fmadd_ps(w, v[e], a[t][e]);
    }
  }
  for (int t = 0; t < TN; ++t) cur[t] = common;
  for (; j < end; ++j) {
    if (j + KEYS_AHEAD < end) fetch_rows(values + (j + KEYS_AHEAD) * 16 * V, 1, 16 * V);
    __m512 v[V];
    for (int e = 0; e < V; ++e) v[e] = (__m512)load(values + j * 16 * V + 16 * e);
    for (int t = 0; t < TN; ++t)
      if (cur[t] < count[t] && (!seen[t] || seen[t][cur[t]] == j)) {
        const __m512 w = _mm512_set1_ps(p[t][cur[t]++]);
        for (int e = 0; e < V; ++e) a[t][e] = _mm512_fmadd_ps(w, v[e], a[t][e]);
      }
  }
  for (int t = 0; t < TN; ++t)
    for (int e = 0; e < V; ++e) _mm512_storeu_ps(acc[t] + 16 * e, a[t][e]);
}

// Row i of attention a, head h: its scores (into score[j0..]) of the key block at kb, keys j0.. of the cache, those
// it may see (all with a mask, up to itself causally).
template <int V, typename T, typename K>
inline void row_scores(const Attention<T>& a, int64_t i, int64_t h, const K* kb, int64_t j0, float sc, float* score) {
  const int64_t limit = a.mask ? a.start + a.n : a.start + i + 1;
  if (j0 < limit)
    block_scores<V>(a.q + i * a.q_stride + h * 16 * V, kb, static_cast<int>(std::min<int64_t>(16, limit - j0)), sc,
                    score + j0);
}

// Rows r0..r1-1 of attention a for the query heads h0..h1-1 of H (D = 16 V), all of one key head (grouped-query
// attention's group): the pairs (row, head), row by row, share each key block from L1 (an fp16 block widened once for
// them: the same values, so the same scores), then the value rows in tiles of pairs, so a group's keys and values
// are read once for all its heads. Every pair's operations are attend_one's: the same bits as the row alone, in any
// range of rows and heads.
template <int V, typename T>
void attend_head(const Attention<T>& a, int64_t h0, int64_t h1, int64_t r0, int64_t r1, int64_t H, int64_t KVH,
                 float sc, Scratch& s) {
  constexpr int64_t D = 16 * V;
  constexpr int TILE_ROWS = 24 / V;  // accumulators: TILE_ROWS * V registers
  const int64_t g = h0 / (H / KVH), hn = h1 - h0, n = (r1 - r0) * hn, all = a.start + a.n, stride = all + 16;
  const int64_t keys = a.mask ? all : a.start + r1;  // the keys any of the rows may see
  const T* kg = a.kp + g * a.cap * D;
  const T* vg = a.vp + g * a.cap * D;
  s.score.resize(n * stride);
  s.seen.resize(a.mask ? n * all : 0);
  s.acc.resize(n * D);
  s.count.resize(n);
  s.lead.resize(n);
  s.sum.resize(n);
  float widened[16 * D];
  for (int64_t j0 = 0; j0 < keys; j0 += 16) {  // pair p: row r0 + p / hn, head h0 + p % hn
    if (j0 + KEYS_AHEAD < keys) fetch_rows(kg + (j0 + KEYS_AHEAD) * D, 16, D);
    if constexpr (std::is_same_v<T, float>) {
      for (int64_t p = 0; p < n; ++p)
        row_scores<V>(a, r0 + p / hn, h0 + p % hn, kg + j0 * D, j0, sc, s.score.data() + p * stride);
    } else if (n == 1) {
      row_scores<V>(a, r0, h0, kg + j0 * D, j0, sc, s.score.data());
    } else {
      for (int64_t e = 0; e < std::min<int64_t>(16, keys - j0) * D; e += 16) store(widened + e, load(kg + j0 * D + e));
      for (int64_t p = 0; p < n; ++p)
        row_scores<V>(a, r0 + p / hn, h0 + p % hn, static_cast<const float*>(widened), j0, sc,
                      s.score.data() + p * stride);
    }
  }
  for (int64_t p = 0; p < n; ++p)
    std::tie(s.count[p], s.sum[p]) = softmax_visible(a, r0 + p / hn, s.score.data() + p * stride,
                                                     a.mask ? s.seen.data() + p * all : nullptr, &s.lead[p]);
  using Fn = void (*)(float* const*, int64_t* const*, const int64_t*, const int64_t*, const T*, float* const*);
  static constexpr Fn tiles[7] = {nullptr,
                                  tile_values<V, 1, T>,
                                  tile_values<V, 2, T>,
                                  tile_values<V, std::min(3, TILE_ROWS), T>,
                                  tile_values<V, std::min(4, TILE_ROWS), T>,
                                  tile_values<V, std::min(5, TILE_ROWS), T>,
                                  tile_values<V, std::min(6, TILE_ROWS), T>};
  for (int64_t i0 = 0; i0 < n; i0 += TILE_ROWS) {
    const int tn = static_cast<int>(std::min<int64_t>(TILE_ROWS, n - i0));
    float* p[6];
    int64_t* seen[6];
    float* acc[6];
    for (int t = 0; t < tn; ++t) {
      p[t] = s.score.data() + (i0 + t) * stride;
      seen[t] = a.mask ? s.seen.data() + (i0 + t) * all : nullptr;
      acc[t] = s.acc.data() + (i0 + t) * D;
    }
    tiles[tn](p, seen, s.count.data() + i0, s.lead.data() + i0, vg, acc);
  }
  for (int64_t p = 0; p < n; ++p) {
    float* o = a.out + (r0 + p / hn) * H * D + (h0 + p % hn) * D;
    for (int64_t e = 0; e < D; ++e) o[e] = s.acc[p * D + e] / s.sum[p];
  }
}
#endif

// One task of attend_all: rows r0..r1-1 of part r, query heads h0..h1-1 (of one key head); cost, about the scores
// it computes.
struct AttentionTask {
  size_t r;
  int64_t h0, h1, r0, r1;
  double cost;
};

// The tasks of several attentions: one per (attention, key head), its query heads together, so that a group's keys
// and values are read once for all of them, unless that outweighs half a thread's share (a whole one for a single row,
// whose heads are all that can share them): then the group's heads go in fewer at a time (as many as divide it
// evenly). A task that still outweighs an eighth of a thread's share, a prompt
// chunk's, is cut into runs of rows, rows and heads being independent of one another. A run keeps at least MIN_RUN
// rows: each run widens an fp16 head's keys again, which a verify block's few rows would feel.
constexpr int64_t MIN_RUN = 16;

template <typename T>
std::vector<AttentionTask> attention_tasks(const std::vector<Attention<T>>& parts, int64_t H, int64_t KVH,
                                           int threads) {
  const auto cost = [](const Attention<T>& a, int64_t r0, int64_t r1) {  // keys seen, plus a row's fixed work
    const int64_t rows = r1 - r0;
    const double seen = a.mask ? double(rows) * (a.start + a.n) : double(rows) * a.start + double(r0 + r1 + 1) * rows / 2;
    return seen + 16.0 * rows;
  };
  const int64_t G = H / KVH;  // query heads per key head
  double total = 0;
  for (const Attention<T>& a : parts) total += H * cost(a, 0, a.n);
  const double most = std::max(1.0, total / (8.0 * threads));
  std::vector<AttentionTask> tasks;
  for (size_t r = 0; r < parts.size(); ++r) {
    const Attention<T>& a = parts[r];
    const double head = cost(a, 0, a.n);
    int64_t heads = G;  // query heads a task takes: the most of the group that keep it within its share
    const double share = a.n == 1 ? total / threads : total / (2.0 * threads);
    while (heads > 1 && (G % heads || heads * head > share)) --heads;
    const int64_t pieces =
        std::max<int64_t>(1, std::min<int64_t>(a.n / MIN_RUN, static_cast<int64_t>(std::ceil(heads * head / most))));
    for (int64_t h = 0; h < H; h += heads)
      for (int64_t p = 0; p < pieces; ++p) {
        const int64_t r0 = a.n * p / pieces, r1 = a.n * (p + 1) / pieces;
        tasks.push_back({r, h, h + heads, r0, r1, heads * cost(a, r0, r1)});
      }
  }
  return tasks;
}

// Several attentions (one per request of a batched forward, Vaswani et al. 2017) in one parallel
// region: the tasks of attention_tasks, each thread a run of them of about equal cost (a prompt chunk's
// rows beside many one-row requests would otherwise keep one thread busy while the other waits). With
// AVX-512 and D = 64 or 128 a task's (row, query head) pairs share each key block (attend_head), else they go one
// at a time (attend_one). The visible keys are visited in cache order, so a
// token sees the same keys in the same order however many positions, or other requests, the call has.
template <typename T>
void attend_all(const std::vector<Attention<T>>& parts, int64_t H, int64_t D, int64_t KVH, float sc) {
#if defined(__AVX512F__)
  const bool by_head = D == 64 || D == 128;
#else
  const bool by_head = false;
#endif
  const int threads = std::max(1, at::get_num_threads());
  const std::vector<AttentionTask> tasks = attention_tasks(parts, H, KVH, threads);
  std::vector<double> middle;  // the cost of the tasks before each, and half its own
  double total = 0;
  for (const AttentionTask& t : tasks) {
    middle.push_back(total + t.cost / 2);
    total += t.cost;
  }
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Scratch s;  // by head: sized by attend_head; else one position's room
    const auto at = [&](int64_t share) {  // the first task whose middle lies past share / threads of the cost
      return std::lower_bound(middle.begin(), middle.end(), total * share / threads) - middle.begin();
    };
    for (int64_t i = at(begin); i < at(end); ++i) {
      const AttentionTask& t = tasks[i];
      const Attention<T>& a = parts[t.r];
#if defined(__AVX512F__)
      if (by_head) {
        if (D == 64)
          attend_head<4>(a, t.h0, t.h1, t.r0, t.r1, H, KVH, sc, s);
        else
          attend_head<8>(a, t.h0, t.h1, t.r0, t.r1, H, KVH, sc, s);
        continue;
      }
#endif
      s.score.resize(a.start + a.n + 16);
      s.acc.resize(D);
      s.seen.resize(a.start + a.n);
      for (int64_t h = t.h0; h < t.h1; ++h)
        for (int64_t row = t.r0; row < t.r1; ++row)
          attend_one(a, row, h, H, D, KVH, sc, s.score.data(), s.seen.data(), s.acc.data());
    }
  });
}

const bool* mask_data(const c10::optional<torch::Tensor>& mask, torch::Tensor& holder, int64_t n, int64_t keys) {
  if (!mask.has_value()) return nullptr;
  holder = mask->to(torch::kBool).contiguous();
  TORCH_CHECK(holder.dim() == 2 && holder.size(0) == n && holder.size(1) == keys, "quant: mask must be (n, start + n)");
  return holder.data_ptr<bool>();
}

// f(T{}) with T the element type of a KV cache: float (fp32) or half (fp16); any other dtype is refused.
template <typename F>
void with_cache_type(const torch::Tensor& cache, F&& f) {
  if (cache.scalar_type() == torch::kHalf) return f(half{});
  TORCH_CHECK(cache.scalar_type() == torch::kFloat, "quant: a KV cache must be float32 or float16, not ",
              cache.scalar_type());
  f(float{});
}

// q (n, H, D); k_cache, v_cache (KVH, capacity, D) fp32 or fp16 (one dtype), contiguous, the new keys and values
// already at start..start+n-1; mask (n, start+n) bool or None (causal). Returns (n, H * D).
torch::Tensor attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, int64_t start,
                        c10::optional<torch::Tensor> mask, double scale) {
  q = q.contiguous();
  const int64_t n = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(0), cap = k_cache.size(1);
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && H % KVH == 0 && start + n <= cap &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "quant.attention: bad cache");
  torch::Tensor holder;
  const bool* mp = mask_data(mask, holder, n, start + n);
  auto out = torch::empty({n, H * D}, q.options());
  with_cache_type(k_cache, [&](auto t) {
    using T = decltype(t);
    attend_all<T>({Attention<T>{q.data_ptr<float>(), H * D, n, static_cast<const T*>(k_cache.data_ptr()),
                                static_cast<const T*>(v_cache.data_ptr()), cap, start, mp, out.data_ptr<float>()}},
                  H, D, KVH, static_cast<float>(scale));
  });
  return out;
}

}  // namespace
