// Paged attention for decode tokens on CPU: one query per sequence, K/V read in place from the page pool.
//
// The reference backend gathers every sequence's pages into a padded batch and then runs SDPA over it, so a
// decode step moves its K/V three times (read, write the copy, read the copy). Here each sequence walks its
// page table and reads each key and value once, with an online softmax (running max and sum, rescaled per
// page) so no score matrix is materialised. Sequences are claimed, longest first, by whichever intra-op
// thread is free (cpu_parallel.h). Shapes with head_dim in {16, 32, 64, 128}, up to 8 query heads per kv head
// and pages of up to 64 tokens take a kernel specialised at compile time (decode_seq_fast); any other shape
// takes decode_seq_generic.
//
//   q           [num_seqs, num_heads, head_dim]                      float32, contiguous
//   kv_cache    [2, num_pages, page_size, num_kv_heads, head_dim]     float32, contiguous (one layer)
//   tables      [num_seqs, max_pages]                                int64 page ids
//   seq_lens    [num_seqs]                                           int64: keys 0 .. seq_len - 1 are visible
//   returns     [num_seqs, num_heads, head_dim]                      float32
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
};

// Page p of a sequence of n tokens: how many of its tokens are visible, and the first key and value rows of
// the kv head at kv_offset.
struct PageRows {
  int64_t tokens;
  const float* k;
  const float* v;
};

inline PageRows page_rows(const Shape& s, const int64_t* table, int64_t p, int64_t n, const float* k_ptr,
                          const float* v_ptr, int64_t kv_offset) {
  const int64_t page = table[p];
  TORCH_CHECK(page >= 0 && page < s.num_pages, "page id outside the pool");
  const int64_t first = page * s.page_size * s.token_stride + kv_offset;
  return {std::min(s.page_size, n - p * s.page_size), k_ptr + first, v_ptr + first};
}

// One sequence, the fast path: head_dim = 16 * NV, and the G query heads that share a kv head are computed
// together, so each key and value row is loaded once for the group, and the group's queries and accumulators
// stay in registers while the sequence's pages go by. For each kv head, page by page: the G x page_size
// scores, an online-softmax update (running max and sum, earlier pages rescaled), the weighted sum of the
// values; the same rows of the next page are prefetched meanwhile. Walking the pages once for all kv heads
// instead would keep the accumulators in memory between pages, which is slower on a cold pool.
template <int NV, int G>
void decode_seq_fast(const Shape& s, const float* qb, const float* k_ptr, const float* v_ptr,
                     const int64_t* table, int64_t n, float* ob) {
  constexpr int D = 16 * NV;
  for (int64_t kvh = 0; kvh < s.num_kv_heads; ++kvh) {
    v16 q[G][NV], acc[G][NV];
    float run_max[G], run_sum[G];
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
#pragma GCC unroll 16
      for (int i = 0; i < NV; ++i) {
        q[g][i] = load(qb + (kvh * G + g) * D + 16 * i) * s.scale;
        acc[g][i] = v16{};
      }
      run_max[g] = kMinScore;
      run_sum[g] = 0.f;
    }
    const int64_t kv_offset = kvh * D;
    for (int64_t p = 0; p * s.page_size < n; ++p) {
      const auto [tokens, kp, vp] = page_rows(s, table, p, n, k_ptr, v_ptr, kv_offset);
      if ((p + 1) * s.page_size < n) {  // the next page is elsewhere in the pool: fetch this head's rows now
        const int64_t next = table[p + 1];
        if (next >= 0 && next < s.num_pages) {
          const float* nk = k_ptr + next * s.page_size * s.token_stride + kv_offset;
          const float* nv = v_ptr + next * s.page_size * s.token_stride + kv_offset;
          for (int64_t t = 0; t < s.page_size; ++t) {
            for (int i = 0; i < D; i += 16) {
              __builtin_prefetch(nk + t * s.token_stride + i);
              __builtin_prefetch(nv + t * s.token_stride + i);
            }
          }
        }
      }
      float w[G][64];  // scores, then softmax weights (page_size <= 64 on this path)
      for (int64_t t = 0; t < tokens; ++t) {
        v16 krow[NV];
#pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) krow[i] = load(kp + t * s.token_stride + 16 * i);
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) {
          v16 dot = q[g][0] * krow[0];
#pragma GCC unroll 16
          for (int i = 1; i < NV; ++i) dot += q[g][i] * krow[i];
          w[g][t] = hsum(dot);
        }
      }
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) {
        float page_max = kMinScore;
        for (int64_t t = 0; t < tokens; ++t) page_max = std::max(page_max, w[g][t]);
        const float new_max = std::max(run_max[g], page_max);
        float page_sum = 0.f;
        for (int64_t t = 0; t < tokens; ++t) {
          w[g][t] = std::exp(w[g][t] - new_max);
          page_sum += w[g][t];
        }
        const float correction = std::exp(run_max[g] - new_max);  // rescale what earlier pages summed
        run_sum[g] = run_sum[g] * correction + page_sum;
        run_max[g] = new_max;
#pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) acc[g][i] *= correction;
      }
      for (int64_t t = 0; t < tokens; ++t) {
        v16 vrow[NV];
#pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) vrow[i] = load(vp + t * s.token_stride + 16 * i);
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
          for (int i = 0; i < NV; ++i) acc[g][i] += w[g][t] * vrow[i];
      }
    }
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      const float inv = 1.f / run_sum[g];
#pragma GCC unroll 16
      for (int i = 0; i < NV; ++i) store(ob + (kvh * G + g) * D + 16 * i, acc[g][i] * inv);
    }
  }
}

// Any head_dim and group size: one query head at a time, with scalar loops the compiler vectorises.
void decode_seq_generic(const Shape& s, const float* qb, const float* k_ptr, const float* v_ptr,
                        const int64_t* table, int64_t n, float* ob, float* w, float* acc) {
  const int64_t group = s.num_heads / s.num_kv_heads, D = s.head_dim;
  for (int64_t h = 0; h < s.num_heads; ++h) {
    const float* qh = qb + h * D;
    const int64_t kv_offset = (h / group) * D;
    float run_max = kMinScore, run_sum = 0.f;
    std::fill(acc, acc + D, 0.f);
    for (int64_t p = 0; p * s.page_size < n; ++p) {
      const auto [tokens, kp, vp] = page_rows(s, table, p, n, k_ptr, v_ptr, kv_offset);
      float page_max = kMinScore;
      for (int64_t t = 0; t < tokens; ++t) {
        const float* k = kp + t * s.token_stride;
        float dot = 0.f;
        for (int64_t d = 0; d < D; ++d) dot += qh[d] * k[d];
        w[t] = dot * s.scale;
        page_max = std::max(page_max, w[t]);
      }
      const float new_max = std::max(run_max, page_max);
      float page_sum = 0.f;
      for (int64_t t = 0; t < tokens; ++t) {
        w[t] = std::exp(w[t] - new_max);
        page_sum += w[t];
      }
      const float correction = std::exp(run_max - new_max);
      run_sum = run_sum * correction + page_sum;
      run_max = new_max;
      for (int64_t d = 0; d < D; ++d) acc[d] *= correction;
      for (int64_t t = 0; t < tokens; ++t) {
        const float* v = vp + t * s.token_stride;
        for (int64_t d = 0; d < D; ++d) acc[d] += w[t] * v[d];
      }
    }
    for (int64_t d = 0; d < D; ++d) ob[h * D + d] = acc[d] / run_sum;
  }
}

using FastFn = void (*)(const Shape&, const float*, const float*, const float*, const int64_t*, int64_t, float*);

template <int NV>
FastFn fast_for_group(int64_t group) {
  return by_group<FastFn>(group, [](auto g) -> FastFn { return decode_seq_fast<NV, decltype(g)::value>; });
}

// The specialised kernel for this shape, or nullptr (the generic one then runs).
FastFn fast_kernel(int64_t head_dim, int64_t group, int64_t page_size) {
  if (page_size > 64) return nullptr;
  return by_head_dim<FastFn>(head_dim, [group](auto nv) { return fast_for_group<decltype(nv)::value>(group); });
}

}  // namespace

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& tables,
                           const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && tables.dim() == 2 && seq_lens.dim() == 1, "bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables and lengths");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && tables.is_contiguous(), "contiguous inputs only");
  Shape s{q.size(1), q.size(2), kv_cache.size(1), kv_cache.size(2), kv_cache.size(3), tables.size(1), 0,
          static_cast<float>(scale)};
  const int64_t num_seqs = q.size(0);
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == s.head_dim && s.num_heads % s.num_kv_heads == 0,
              "shapes");
  TORCH_CHECK(tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs, "one table and length per sequence");
  s.token_stride = s.num_kv_heads * s.head_dim;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const FastFn fast = fast_kernel(s.head_dim, group, s.page_size);

  auto out = at::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = kv_cache.data_ptr<float>();
  const float* v_ptr = k_ptr + s.num_pages * s.page_size * s.token_stride;
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();

  // Longest sequences first, each claimed by whichever thread is free: the costs differ with the lengths.
  std::vector<int64_t> order(num_seqs);
  for (int64_t b = 0; b < num_seqs; ++b) order[b] = b;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return len_ptr[a] > len_ptr[b]; });
  parallel_items(num_seqs, [&](int64_t i) {
    thread_local std::vector<float> scratch;  // the generic kernel's weights and accumulator
    scratch.resize(s.page_size + s.head_dim);
    const int64_t b = order[i];
    const int64_t n = len_ptr[b];
    TORCH_CHECK(n > 0 && n <= s.max_pages * s.page_size, "seq_len outside its page table");
    const float* qb = q_ptr + b * s.num_heads * s.head_dim;
    float* ob = out_ptr + b * s.num_heads * s.head_dim;
    const int64_t* table = table_ptr + b * s.max_pages;
    if (fast != nullptr) {
      fast(s, qb, k_ptr, v_ptr, table, n, ob);
    } else {
      decode_seq_generic(s, qb, k_ptr, v_ptr, table, n, ob, scratch.data(), scratch.data() + s.page_size);
    }
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
