// Paged attention for decode tokens on CPU: one query per sequence, K/V read in place from the page pool.
//
// The reference backend gathers every sequence's pages into a padded batch and then runs SDPA over it, so a
// decode step moves its K/V three times (read, write the copy, read the copy). Here each sequence walks its
// page table and reads each key and value once, with an online softmax (running max and sum, rescaled per
// page) so no score matrix is materialised. Sequences are spread over the intra-op threads.
//
//   q           [num_seqs, num_heads, head_dim]                      float32, contiguous
//   kv_cache    [2, num_pages, page_size, num_kv_heads, head_dim]     float32, contiguous (one layer)
//   tables      [num_seqs, max_pages]                                int64 page ids
//   seq_lens    [num_seqs]                                           int64: keys 0 .. seq_len - 1 are visible
//   returns     [num_seqs, num_heads, head_dim]                      float32
//
// Query head h attends with kv head h / (num_heads / num_kv_heads), as in HF's repeat_kv.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr float kMinScore = -1e30f;  // a finite "minus infinity": the build uses -ffast-math

torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& kv_cache, const torch::Tensor& tables,
                           const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && tables.dim() == 2 && seq_lens.dim() == 1, "bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_cache.scalar_type() == at::kFloat, "float32 only");
  TORCH_CHECK(tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong, "int64 tables and lengths");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && tables.is_contiguous(), "contiguous inputs only");
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_pages = kv_cache.size(1), page_size = kv_cache.size(2), num_kv_heads = kv_cache.size(3);
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == head_dim && num_heads % num_kv_heads == 0, "shapes");
  TORCH_CHECK(tables.size(0) == num_seqs && seq_lens.size(0) == num_seqs, "one table and length per sequence");
  const int64_t group = num_heads / num_kv_heads, max_pages = tables.size(1);
  const int64_t token_stride = num_kv_heads * head_dim;
  const float fscale = static_cast<float>(scale);

  auto out = torch::empty_like(q);
  const float* q_ptr = q.data_ptr<float>();
  const float* k_ptr = kv_cache.data_ptr<float>();
  const float* v_ptr = k_ptr + num_pages * page_size * token_stride;
  const int64_t* table_ptr = tables.data_ptr<int64_t>();
  const int64_t* len_ptr = seq_lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();

  at::parallel_for(0, num_seqs, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(num_heads * head_dim), run_max(num_heads), run_sum(num_heads);
    std::vector<float> weights(page_size);
    for (int64_t b = begin; b < end; ++b) {
      const int64_t n = len_ptr[b];
      TORCH_CHECK(n > 0 && n <= max_pages * page_size, "seq_len outside its page table");
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(run_max.begin(), run_max.end(), kMinScore);
      std::fill(run_sum.begin(), run_sum.end(), 0.f);
      const float* qb = q_ptr + b * num_heads * head_dim;
      for (int64_t p = 0; p * page_size < n; ++p) {
        const int64_t page = table_ptr[b * max_pages + p];
        TORCH_CHECK(page >= 0 && page < num_pages, "page id outside the pool");
        const int64_t tokens = std::min(page_size, n - p * page_size);
        const float* kp = k_ptr + page * page_size * token_stride;
        const float* vp = v_ptr + page * page_size * token_stride;
        // The next page is elsewhere in the pool: fetch it while this one is computed, a slice per head, so
        // that the misses stay in flight without flooding the line-fill buffers.
        const char* next_k = nullptr;
        const char* next_v = nullptr;
        if ((p + 1) * page_size < n) {
          const int64_t next = table_ptr[b * max_pages + p + 1];
          if (next >= 0 && next < num_pages) {
            next_k = reinterpret_cast<const char*>(k_ptr + next * page_size * token_stride);
            next_v = reinterpret_cast<const char*>(v_ptr + next * page_size * token_stride);
          }
        }
        const int64_t page_bytes = page_size * token_stride * static_cast<int64_t>(sizeof(float));
        const int64_t slice = (page_bytes / num_heads + 63) / 64 * 64;
        for (int64_t h = 0; h < num_heads; ++h) {
          if (next_k != nullptr) {
            for (int64_t off = h * slice; off < std::min((h + 1) * slice, page_bytes); off += 64) {
              __builtin_prefetch(next_k + off);
              __builtin_prefetch(next_v + off);
            }
          }
          const float* qh = qb + h * head_dim;
          const int64_t kv_offset = (h / group) * head_dim;
          float* w = weights.data();
          float page_max = kMinScore;
          for (int64_t t = 0; t < tokens; ++t) {  // this page's scores
            const float* k = kp + t * token_stride + kv_offset;
            float dot = 0.f;
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * k[d];
            w[t] = dot * fscale;
            page_max = std::max(page_max, w[t]);
          }
          const float new_max = std::max(run_max[h], page_max);
          float page_sum = 0.f;
          for (int64_t t = 0; t < tokens; ++t) {  // contiguous: the compiler vectorises the exp
            w[t] = std::exp(w[t] - new_max);
            page_sum += w[t];
          }
          const float correction = std::exp(run_max[h] - new_max);  // rescale what earlier pages summed
          run_sum[h] = run_sum[h] * correction + page_sum;
          run_max[h] = new_max;
          float* a = acc.data() + h * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
          for (int64_t t = 0; t < tokens; ++t) {
            const float* v = vp + t * token_stride + kv_offset;
            for (int64_t d = 0; d < head_dim; ++d) a[d] += w[t] * v[d];
          }
        }
      }
      float* ob = out_ptr + b * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.f / run_sum[h];
        for (int64_t d = 0; d < head_dim; ++d) ob[h * head_dim + d] = acc[h * head_dim + d] * inv;
      }
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged decode attention, K/V read in place (CPU, float32)");
}
