// Paged attention for decode tokens on CPU: one query per sequence, K/V read in place from the page pool.
//
// The reference backend gathers every sequence's pages into a padded batch and then runs SDPA over it, so a
// decode step moves its K/V three times (read, write the copy, read the copy). Here each sequence walks its
// page table and reads each key and value once, with an online softmax (running max and sum, rescaled per
// page) so no score matrix is materialised. Sequences are claimed, longest first, by whichever intra-op
// thread is free (cpu_parallel.h). A step of fewer sequences than twice the threads (one long conversation)
// is split instead into (sequence, range of keys) parts whose partial softmax states are merged (flash
// decoding), so that every thread reads K/V. A sequence's pages go by in blocks of kBlockPages, each kv head
// taking the block in turn: the first reads the block's pages whole from memory (prefetched a page ahead), the
// others find them in L2, so every byte crosses from memory once and in long runs, not once per kv head in
// strided rows. Shapes with head_dim in {16, 32, 64, 128}, up to 8 query heads per kv head and pages of up to
// 64 tokens take a kernel specialised at compile time (decode_part); any other shape takes decode_seq_generic.
//
// A pool of 1-byte elements (int8, float8_e4m3fn, float8_e5m2: kvserve/kernels/kv_quant.py) is read in place too, 16
// elements at a time as floats (load_row in cpu_vec.h); a key's score is multiplied by its K scale and a
// value's softmax weight by its V scale, once per row. Both kernels are templates over the element's storage
// type (float, or uint8_t for the three 1-byte formats); for float32 the scale is a constant 1 that compiles
// away.
//
//   q           [num_seqs, num_heads, head_dim]                      float32, contiguous
//   kv_cache    [2, num_pages, page_size, num_kv_heads, head_dim]     float32, int8 or float8, contiguous (one
//                                                                    layer)
//   kv_scales   [2, num_pages, page_size, num_kv_heads] float32, or None (float32 pools, and the tensor scheme:
//                                                                    every scale 1)
//   tables      [num_seqs, max_pages]                                int64 page ids
//   seq_lens    [num_seqs]                                           int64: keys 0 .. seq_len - 1 are visible
//   returns     [num_seqs, num_heads, head_dim]                      float32
//
//   window      int: a sliding window (kvserve/kernels/window.py): the query at position p = seq_len - 1 reads keys
//               p - window < j <= p, and the sinks j < sinks; 0 = every key (sinks 0)
//   q_sink      [num_seqs, num_heads, head_dim] float32, or None: the queries rotated at their in-cache positions,
//               against which the sink keys are scored (needed when sinks > 0)
//   logits_soft_cap  float: > 0 caps every score s (after the scale and the K scale, sinks' too) at
//               cap * tanh(s / cap) before the softmax (Gemma 2); 0 = none
//
// A sequence's keys are at most two spans (seq_spans): its sinks against q_sink, then its window against q. Only
// the pages of those spans are read, so a page table's HOLE entries (pages released by the window) are never
// touched. Without a window the one span is every key, against q.
//
// Query head h attends with kv head h / (num_heads / num_kv_heads), as in HF's repeat_kv.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_vec.h"

namespace kvserve {
namespace {

struct Shape {
  int64_t num_heads, head_dim, num_pages, page_size, num_kv_heads, max_pages, token_stride;
  float scale;
  float soft_cap;  // 0: none
};

// Scores w[0 .. n) capped at cap * tanh(w / cap) (Gemma 2's soft cap), in place. The kernels call it once per
// page on the page's scores, after the scales and before the running max, so that a step without a cap pays
// one branch per page and its score and softmax loops stay as they were.
inline void soft_cap_scores(float* w, int64_t n, float cap) {
  const float inv = 1.f / cap;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) w[i] = cap * std::tanh(w[i] * inv);
}

// One layer's pool as the kernels read it: K and V rows of elements stored as T in `format`, and their scales.
template <typename T>
struct Pool {
  const T* k;
  const T* v;
  KVScales scales;
  KVFormat format;
};

// Page p of a sequence: the first key and value rows of kv head kvh, and their scales (row t's at
// k_scale[t * slot_stride]).
template <typename T>
struct PageRows {
  const T* k;
  const T* v;
  const float* k_scale;
  const float* v_scale;
};

template <typename T>
inline PageRows<T> page_rows(const Shape& s, const Pool<T>& pool, const int64_t* table, int64_t p, int64_t kvh) {
  const int64_t page = table[p];
  TORCH_CHECK(page >= 0 && page < s.num_pages, "page id outside the pool");
  const int64_t first = page * s.page_size * s.token_stride + kvh * s.head_dim, slot = page * s.page_size;
  return {pool.k + first, pool.v + first, pool.scales.k_at(slot, kvh), pool.scales.v_at(slot, kvh)};
}

// Keys [k0, k1) of a sequence, scored against one rotation of its query: q is the sequence's num_heads x
// head_dim queries (q, or q_sink for the sinks).
struct Span {
  const float* q;
  int64_t k0, k1;
};

// The spans the decode of a sequence of n tokens reads (its query at n - 1), into spans; returns their count:
// the sinks [0, min(sinks, n)) against q_sink, then the window's keys after them against q.
inline int seq_spans(const KeyWindow& w, const float* q, const float* q_sink, int64_t n, Span* spans) {
  const int64_t sinks = std::min(w.sinks, n), first = std::max(w.first_key(n - 1), sinks);
  int count = 0;
  if (sinks > 0) spans[count++] = {q_sink, 0, sinks};
  if (first < n) spans[count++] = {q, first, n};
  return count;
}

// Where decode_part keeps and writes its result for a range of a sequence's keys, every kv head: the query
// heads' weighted sums of values (acc, [num_heads][head_dim], which is [num_kv_heads][G][head_dim]) and the
// running max and sum of their online softmax ([num_heads] each). A whole sequence is one part, written as the
// attention output (normalised: acc divided by the softmax sum); a long sequence in a small batch is split into
// several parts (flash decoding), each left unnormalised for decode_split to merge.
struct Part {
  float* acc;
  float* run_max;
  float* run_sum;
  bool normalised;
};

// Pages per block: decode_part takes a block of a span's pages for every kv head in turn, so the first kv head
// reads the block from memory whole (its rows and their neighbours') and the others find it in L2, rather than
// each kv head streaming every page from memory again.
constexpr int64_t kBlockPages = 16;

// One kv head's G query heads over keys [k0, k1) (qs: the sequence's queries, scaled), resuming from and saving
// to its running state in `out`: head_dim = 16 * NV, and the G query heads that share the kv head are computed
// together, so each key and value row is loaded once for the group, and the group's queries and accumulators
// stay in registers while the pages go by. Page by page: the G x page_size scores, an online-softmax update
// (running max and sum, earlier pages rescaled), the weighted sum of the values. fetch_next: prefetch the next
// page of the range whole (every kv head's rows), while this one is computed.
template <typename T, int NV, int G>
inline void decode_pages(const Shape& s, const Pool<T>& pool, const int64_t* table, int64_t kvh, const float* qs,
                         int64_t k0, int64_t k1, const Part& out, bool fetch_next) {
  constexpr int D = 16 * NV, kLine = 64 / sizeof(T);  // elements of a cache line
  const int64_t ss = kQuantised<T> ? pool.scales.slot_stride : 0;  // float32: no scales
  v16 q[G][NV], acc[G][NV];
  float run_max[G], run_sum[G];
  float* acc_out = out.acc + kvh * G * D;
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) {
      q[g][i] = load(qs + (kvh * G + g) * D + 16 * i) * s.scale;
      acc[g][i] = load(acc_out + g * D + 16 * i);
    }
    run_max[g] = out.run_max[kvh * G + g];
    run_sum[g] = out.run_sum[kvh * G + g];
  }
  const int64_t p1 = (k1 + s.page_size - 1) / s.page_size, page_elems = s.page_size * s.token_stride;
  for (int64_t p = k0 / s.page_size; p < p1; ++p) {
    const PageRows<T> rows = page_rows(s, pool, table, p, kvh);
    const int64_t t0 = std::max<int64_t>(k0 - p * s.page_size, 0);
    const int64_t t1 = std::min(s.page_size, k1 - p * s.page_size);
    if (fetch_next && p + 1 < p1) {  // the next page is elsewhere in the pool: fetch it now
      // (here, not in a function of its own: GCC finds that one free of side effects and drops its calls)
      const int64_t next = table[p + 1];
      if (next >= 0 && next < s.num_pages) {
        for (int64_t i = 0; i < page_elems; i += kLine) {
          __builtin_prefetch(pool.k + next * page_elems + i);
          __builtin_prefetch(pool.v + next * page_elems + i);
        }
        for (int64_t i = 0; i < s.page_size * ss; i += 16) {  // the page's scales (none for ss = 0)
          __builtin_prefetch(pool.scales.k_at(next * s.page_size, 0) + i);
          __builtin_prefetch(pool.scales.v_at(next * s.page_size, 0) + i);
        }
      }
    }
    float w[G][64];  // scores, then softmax weights (page_size <= 64 on this path)
    for (int64_t t = t0; t < t1; ++t) {
      v16 krow[NV];
      load_row<NV>(rows.k + t * s.token_stride, pool.format, krow);
      const float k_scale = row_scale<T>(rows.k_scale, t, ss);
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        v16 dot = q[g][0] * krow[0];
#pragma GCC unroll 16
        for (int i = 1; i < NV; ++i) dot += q[g][i] * krow[i];
        w[g][t] = hsum(dot) * k_scale;
      }
    }
    if (s.soft_cap > 0.f)
      for (int g = 0; g < G; ++g) soft_cap_scores(w[g] + t0, t1 - t0, s.soft_cap);
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      float page_max = kMinScore;
      for (int64_t t = t0; t < t1; ++t) page_max = std::max(page_max, w[g][t]);
      const float new_max = std::max(run_max[g], page_max);
      float page_sum = 0.f;
      for (int64_t t = t0; t < t1; ++t) {
        w[g][t] = std::exp(w[g][t] - new_max);
        page_sum += w[g][t];
      }
      const float correction = std::exp(run_max[g] - new_max);  // rescale what earlier pages summed
      run_sum[g] = run_sum[g] * correction + page_sum;
      run_max[g] = new_max;
#pragma GCC unroll 16
      for (int i = 0; i < NV; ++i) acc[g][i] *= correction;
    }
    for (int64_t t = t0; t < t1; ++t) {
      v16 vrow[NV];
      load_row<NV>(rows.v + t * s.token_stride, pool.format, vrow);
      const float v_scale = row_scale<T>(rows.v_scale, t, ss);
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        const float weight = w[g][t] * v_scale;
#pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) acc[g][i] += weight * vrow[i];
      }
    }
  }
#pragma GCC unroll 16
  for (int g = 0; g < G; ++g) {
#pragma GCC unroll 16
    for (int i = 0; i < NV; ++i) store(acc_out + g * D + 16 * i, acc[g][i]);
    out.run_max[kvh * G + g] = run_max[g];
    out.run_sum[kvh * G + g] = run_sum[g];
  }
}

// Every kv head's query heads over the keys of spans[0 .. num_spans) (their softmax shared: a span only changes
// the query its keys are scored against), the fast path: block by block of kBlockPages pages, each kv head in
// turn (decode_pages), the first fetching the block's pages whole.
template <typename T, int NV, int G>
void decode_part(const Shape& s, const Pool<T>& pool, const int64_t* table, const Span* spans, int num_spans,
                 const Part& out) {
  constexpr int D = 16 * NV;
  std::fill(out.acc, out.acc + s.num_heads * D, 0.f);
  std::fill(out.run_max, out.run_max + s.num_heads, kMinScore);
  std::fill(out.run_sum, out.run_sum + s.num_heads, 0.f);
  const int64_t block_keys = kBlockPages * s.page_size;
  for (int sp = 0; sp < num_spans; ++sp) {
    const Span span = spans[sp];
    for (int64_t b0 = span.k0; b0 < span.k1; b0 = (b0 / block_keys + 1) * block_keys) {
      const int64_t b1 = std::min(span.k1, (b0 / block_keys + 1) * block_keys);
      for (int64_t kvh = 0; kvh < s.num_kv_heads; ++kvh)
        decode_pages<T, NV, G>(s, pool, table, kvh, span.q, b0, b1, out, kvh == 0);
    }
  }
  if (!out.normalised) return;
  for (int64_t h = 0; h < s.num_heads; ++h) {
    const float inv = 1.f / out.run_sum[h];
    for (int64_t d = 0; d < D; ++d) out.acc[h * D + d] *= inv;
  }
}

// One sequence, every kv head as one part over its spans, written normalised into ob.
template <typename T, int NV, int G>
void decode_seq_fast(const Shape& s, const Span* spans, int num_spans, const Pool<T>& pool, const int64_t* table,
                     float* ob) {
  thread_local std::vector<float> stats;  // run_max and run_sum
  stats.resize(2 * s.num_heads);
  decode_part<T, NV, G>(s, pool, table, spans, num_spans, {ob, stats.data(), stats.data() + s.num_heads, true});
}

// Any head_dim and group size: one query head at a time, with scalar loops the compiler vectorises (float32;
// the 1-byte formats convert element by element).
template <typename T>
void decode_seq_generic(const Shape& s, const Span* spans, int num_spans, const Pool<T>& pool, const int64_t* table,
                        float* ob, float* w, float* acc) {
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim, ss = pool.scales.slot_stride;
  for (int64_t h = 0; h < s.num_heads; ++h) {
    float run_max = kMinScore, run_sum = 0.f;
    std::fill(acc, acc + D, 0.f);
    for (int sp = 0; sp < num_spans; ++sp) {
      const float* qh = spans[sp].q + h * D;
      for (int64_t p = spans[sp].k0 / s.page_size; p * s.page_size < spans[sp].k1; ++p) {
        const PageRows<T> rows = page_rows(s, pool, table, p, h / group);
        const int64_t t0 = std::max<int64_t>(spans[sp].k0 - p * s.page_size, 0);
        const int64_t t1 = std::min(s.page_size, spans[sp].k1 - p * s.page_size);
        for (int64_t t = t0; t < t1; ++t) {
          const T* k = rows.k + t * s.token_stride;
          float dot = 0.f;
          for (int64_t d = 0; d < D; ++d) dot += qh[d] * element(k, d, pool.format);
          w[t] = dot * s.scale * row_scale<T>(rows.k_scale, t, ss);
        }
        if (s.soft_cap > 0.f) soft_cap_scores(w + t0, t1 - t0, s.soft_cap);
        float page_max = kMinScore;
        for (int64_t t = t0; t < t1; ++t) page_max = std::max(page_max, w[t]);
        const float new_max = std::max(run_max, page_max);
        float page_sum = 0.f;
        for (int64_t t = t0; t < t1; ++t) {
          w[t] = std::exp(w[t] - new_max);
          page_sum += w[t];
        }
        const float correction = std::exp(run_max - new_max);
        run_sum = run_sum * correction + page_sum;
        run_max = new_max;
        for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
        for (int64_t t = t0; t < t1; ++t) {
          const T* v = rows.v + t * s.token_stride;
          const float weight = w[t] * row_scale<T>(rows.v_scale, t, ss);
          for (int64_t d = 0; d < D; ++d) acc[d] += weight * element(v, d, pool.format);
        }
      }
    }
    for (int64_t d = 0; d < D; ++d) ob[h * D + d] = acc[d] / run_sum;
  }
}

template <typename T>
using FastFn = void (*)(const Shape&, const Span*, int, const Pool<T>&, const int64_t*, float*);
template <typename T>
using PartFn = void (*)(const Shape&, const Pool<T>&, const int64_t*, const Span*, int, const Part&);

template <typename T>
struct FastFns {
  FastFn<T> seq = nullptr;
  PartFn<T> part = nullptr;
};

template <typename T, int NV>
FastFns<T> fast_for_group(int64_t group) {
  return by_group<FastFns<T>>(group, [](auto g) -> FastFns<T> {
    return {decode_seq_fast<T, NV, decltype(g)::value>, decode_part<T, NV, decltype(g)::value>};
  });
}

// The specialised kernels for this shape, or nulls (the generic one then runs).
template <typename T>
FastFns<T> fast_kernel(int64_t head_dim, int64_t group, int64_t page_size) {
  if (page_size > 64) return {};
  return by_head_dim<FastFns<T>>(head_dim,
                                 [group](auto nv) { return fast_for_group<T, decltype(nv)::value>(group); });
}

// Pages per part when a step's few sequences are split (flash decoding): at least this many, so that a part's
// reads stay long runs and the merge stays negligible.
constexpr int64_t kMinPartPages = 16;

// The step's queries: q, and q_sink (the sinks' rotation; q itself without sinks), [num_seqs, num_heads,
// head_dim] each, and the keys each reads.
struct Queries {
  const float* q;
  const float* q_sink;
  KeyWindow window;
};

// A step of fewer sequences than twice the threads: items of (sequence, span of keys), so that both threads
// read K/V even for one long sequence, whose parts are merged here. A sequence's window is split into parts:
// enough for four items per thread in all, each of at least kMinPartPages pages; its sinks are one more.
template <typename T>
void decode_split(const Shape& s, const Queries& qs, const Pool<T>& pool, const int64_t* table_ptr,
                  const int64_t* len_ptr, int64_t num_seqs, float* out_ptr, PartFn<T> part) {
  const int64_t H = s.num_heads, D = s.head_dim, threads = at::get_num_threads();
  const int64_t wanted = (4 * threads + num_seqs - 1) / num_seqs;
  struct Item {
    int64_t seq, slot;  // slot: its partial result's index
    Span span;
  };
  std::vector<Item> items;
  std::vector<int64_t> first_slot(num_seqs + 1, 0);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t n = len_ptr[b], offset = b * H * D;
    TORCH_CHECK(n > 0 && n <= s.max_pages * s.page_size, "seq_len outside its page table");
    Span spans[2];
    const int num_spans = seq_spans(qs.window, qs.q + offset, qs.q_sink + offset, n, spans);
    first_slot[b + 1] = first_slot[b];
    for (int i = 0; i < num_spans; ++i) {  // each span in parts (the sinks, a few keys, stay whole)
      const Span sp = spans[i];
      const int64_t p0 = sp.k0 / s.page_size, pages = (sp.k1 + s.page_size - 1) / s.page_size - p0;
      const int64_t parts = std::clamp<int64_t>(std::min(wanted, pages / kMinPartPages), 1, pages);
      for (int64_t j = 0; j < parts; ++j)
        items.push_back({b, first_slot[b + 1]++, {sp.q, std::max(sp.k0, (p0 + pages * j / parts) * s.page_size),
                                                  std::min(sp.k1, (p0 + pages * (j + 1) / parts) * s.page_size)}});
    }
  }
  const int64_t num_parts = first_slot.back();
  std::vector<float> acc(num_parts * H * D), run_max(num_parts * H), run_sum(num_parts * H);
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.span.k1 - a.span.k0 > b.span.k1 - b.span.k0;
  });
  parallel_items(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& it = items[i];
    part(s, pool, table_ptr + it.seq * s.max_pages, &it.span, 1,
         {acc.data() + it.slot * H * D, run_max.data() + it.slot * H, run_sum.data() + it.slot * H, false});
  });
  // merge: each query head's parts rescaled to their common max, then normalised
  for (int64_t b = 0; b < num_seqs; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      float m = kMinScore;
      for (int64_t slot = first_slot[b]; slot < first_slot[b + 1]; ++slot) m = std::max(m, run_max[slot * H + h]);
      float* o = out_ptr + (b * H + h) * D;
      std::fill(o, o + D, 0.f);
      float sum = 0.f;
      for (int64_t slot = first_slot[b]; slot < first_slot[b + 1]; ++slot) {
        const float c = std::exp(run_max[slot * H + h] - m);
        sum += run_sum[slot * H + h] * c;
        const float* a = acc.data() + (slot * H + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] += a[d] * c;
      }
      const float inv = 1.f / sum;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  }
}

// Every sequence of the step, longest first, each claimed by whichever thread is free: the costs differ with
// the lengths. Fewer sequences than twice the threads: decode_split.
template <typename T>
void decode_all(const Shape& s, const Queries& qs, const Pool<T>& pool, const int64_t* table_ptr,
                const int64_t* len_ptr, int64_t num_seqs, float* out_ptr) {
  const FastFns<T> fns = fast_kernel<T>(s.head_dim, s.num_heads / s.num_kv_heads, s.page_size);
  const FastFn<T> fast = fns.seq;
  if (fns.part != nullptr && num_seqs < 2 * at::get_num_threads()) {
    decode_split(s, qs, pool, table_ptr, len_ptr, num_seqs, out_ptr, fns.part);
    return;
  }
  std::vector<int64_t> order(num_seqs);
  for (int64_t b = 0; b < num_seqs; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len_ptr[a] > len_ptr[b]; });
  parallel_items(num_seqs, [&](int64_t i) {
    thread_local std::vector<float> scratch;  // the generic kernel's weights and accumulator
    scratch.resize(s.page_size + s.head_dim);
    const int64_t b = order[i];
    const int64_t n = len_ptr[b], offset = b * s.num_heads * s.head_dim;
    TORCH_CHECK(n > 0 && n <= s.max_pages * s.page_size, "seq_len outside its page table");
    Span spans[2];
    const int num_spans = seq_spans(qs.window, qs.q + offset, qs.q_sink + offset, n, spans);
    float* ob = out_ptr + offset;
    const int64_t* table = table_ptr + b * s.max_pages;
    if (fast != nullptr) {
      fast(s, spans, num_spans, pool, table, ob);
    } else {
      decode_seq_generic(s, spans, num_spans, pool, table, ob, scratch.data(), scratch.data() + s.page_size);
    }
  });
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const std::optional<at::Tensor>& kv_scales,
                        const at::Tensor& tables, const at::Tensor& seq_lens, double scale, int64_t window,
                        int64_t sinks, const std::optional<at::Tensor>& q_sink, double logits_soft_cap) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && tables.dim() == 2 && seq_lens.dim() == 1, "bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q: float32");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables and lengths");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && tables.is_contiguous(), "contiguous inputs only");
  Shape s{q.size(1), q.size(2), kv_cache.size(1), kv_cache.size(2), kv_cache.size(3), tables.size(1), 0,
          static_cast<float>(scale), checked_soft_cap(logits_soft_cap)};
  const int64_t num_seqs = q.size(0);
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == s.head_dim && s.num_heads % s.num_kv_heads == 0,
              "shapes");
  TORCH_CHECK(tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs, "one table and length per sequence");
  const KeyWindow key_window = checked_window(window, sinks, q, q_sink);
  s.token_stride = s.num_kv_heads * s.head_dim;
  const KVScales scales = kv_scales_of(kv_cache, kv_scales);
  auto out = at::empty_like(q);
  const KVFormat format = kv_format_of(kv_cache.scalar_type());
  const Queries qs{q.data_ptr<float>(), sinks > 0 ? q_sink->data_ptr<float>() : q.data_ptr<float>(), key_window};
  by_kv_storage(format, [&](auto type) {
    using T = typename decltype(type)::type;
    const T* k_ptr = static_cast<const T*>(kv_cache.data_ptr());
    const Pool<T> pool{k_ptr, k_ptr + s.num_pages * s.page_size * s.token_stride, scales, format};
    decode_all(s, qs, pool, tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), num_seqs,
               out.data_ptr<float>());
  });
  return out;
}

// How many intra-op threads one at::parallel_for over ``num_tasks`` tasks ran on (1 when the extension was
// built without OpenMP: then parallel_for runs inline). For the test that guards the build flags.
int64_t parallel_threads(int64_t num_tasks) {
  std::vector<int> used(at::get_num_threads(), 0);
  at::parallel_for(0, num_tasks, 1, [&](int64_t, int64_t) { used[at::get_thread_num()] = 1; });
  return std::count(used.begin(), used.end(), 1);
}

}  // namespace kvserve
