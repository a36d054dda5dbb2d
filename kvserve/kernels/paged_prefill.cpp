// Paged attention for prefill chunks on CPU: each chunk's queries attend causally to their sequence's keys,
// read in place from the page pool (no gather into a padded batch, no score matrix, no mask tensor).
//
// The reference backend copies each chunk's pages into a buffer and runs SDPA over it with an additive mask:
// per layer a dozen small torch ops per chunk, and scores for masked keys too. Here, in two passes:
//   1. each page a chunk reads is transposed, per kv head, into a scratch buffer as [head_dim][16 keys], so
//      that one vector holds one dimension of the page's 16 keys;
//   2. a work item is a block of up to 16 adjacent query rows of one chunk and one kv head, with the G query
//      heads that share it: page by page, and for each pair of the block's rows that sees the page while it
//      is in L1, the scores of those 2 x G queries against the page's 16 keys (one vector each, a key per
//      lane), the causal mask, an online-softmax update (running max and sum, earlier pages rescaled, as in
//      paged_decode.cpp) and the weighted sum of the visible values. A page read from memory thus serves 16
//      rows (flash attention's tiling of rows against pages), which keeps a chunk over a long cached context
//      bound by its arithmetic rather than by reading every cached page again for each pair of rows.
// Items are claimed most expensive (latest rows) first by whichever intra-op thread is free (cpu_parallel.h).
// Pages of 16 tokens, head_dim in {16, 32, 64, 128} and up to 8 query heads per kv head; other shapes keep the
// reference path (kvserve/kernels/cpu_paged.py decides).
//
// A pool of 1-byte elements (int8, float8_e4m3fn, float8_e5m2: kvserve/kernels/kv_quant.py): pass 1 writes the keys
// into the scratch as floats times their K scales; pass 2 reads the V rows in place, 16 elements at a time as
// floats (load_row in cpu_vec.h), and multiplies each value's softmax weight by its V scale. attend_rows is a
// template over the element's storage type (float, or uint8_t for the three 1-byte formats); for float32 the
// scale is a constant 1 that compiles away.
//
//   q, out      [num_tokens, num_heads, head_dim]                  float32, contiguous; the step's flat rows
//   kv_cache    [2, num_pages, 16, num_kv_heads, head_dim]          float32, int8 or float8, contiguous (one layer)
//   kv_scales   [2, num_pages, 16, num_kv_heads] float32, or None (float32 pools, and the tensor scheme: every
//               scale 1)
//   tables      [num_chunks, max_pages]                            int64 page ids
//   row_start   [num_chunks]   int64: the chunk's first row in q and out
//   q_lens      [num_chunks]   int64: its rows
//   start_pos   [num_chunks]   int64: the position of its first row (keys 0 .. position are visible to a row)
//   window      int: a sliding window (kvserve/kernels/window.py): a row at position p reads keys p - window < j <= p,
//               and the sinks j < sinks; 0 = every j <= p (sinks 0)
//   q_sink      like q, or None: the rows rotated at their in-cache positions, against which the sink keys are
//               scored (needed when sinks > 0)
//   logits_soft_cap  float: > 0 caps every score s (after the scale, sinks' too) at cap * tanh(s / cap) before the
//               causal mask and the softmax (Gemma 2); 0 = none
// Writes the chunks' rows of out; other rows are left as they are.
//
// With a window a chunk reads its sink pages and the pages from its first row's window on, nothing between
// (a page table's HOLE entries, released pages, are never touched); pass 1 transposes only those, and a block
// takes its sink pages against q_sink (the lanes of sink keys) and then its window's pages against q (the lanes
// after the sinks inside each row's window).
#include <ATen/ATen.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_vec.h"

namespace kvserve {
namespace {

constexpr int kPage = 16;               // keys per page: one vector of scores

struct Chunk {
  int64_t row_start, q_len, start_pos;
  const int64_t* table;
  int64_t num_pages;   // pages up to its last row's
  int64_t first_page;  // the first page of its first row's window after the sinks (0 without a window)
  int64_t sink_pages;  // the sink pages before first_page
  int64_t kt_offset;   // its first page in the transposed-keys buffer
  int64_t kt_pages() const { return sink_pages + num_pages - first_page; }
  // page p's place among its transposed pages: the sink pages, then first_page .. num_pages - 1
  int64_t kt_slot(int64_t p) const { return p < first_page ? p : sink_pages + p - first_page; }
};

struct Item {
  int64_t chunk, row, kv_head;  // rows row .. row + kBlockRows - 1 of the chunk (those it has)
};

// e^x of 16 lanes. With AVX-512: n = round(x / ln 2), r = x - n ln 2 (ln 2 in two parts), e^r by Cephes' expf
// polynomial on [-ln2 / 2, ln2 / 2] (about 1 ulp), times 2^n by vscalefps; x is clamped to [-110, 88.7], so
// masked scores (-1e30) come out as 0. With AVX2, exp8 below on each half. Elsewhere: std::exp per lane
// (vectorised by libmvec under -ffast-math).
#ifdef KVSERVE_V16_PAIR
// e^x of 8 lanes with AVX2, by the same steps (2^n built in the exponent bits, as AVX2 has no vscalefps): x is
// clamped to [-87.3, 88.3] so that 2^n is a normal float, and lanes below -87.3 (masked scores) come out as 0.
inline v8 exp8(v8 x8) {
  const __m256 x = reinterpret_cast<__m256>(x8);
  const __m256 v = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 e = _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
  return reinterpret_cast<v8>(_mm256_and_ps(e, _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ)));
}
#endif

inline v16 exp16(v16 x) {
#ifdef __AVX512F__
  __m512 v = _mm512_min_ps(_mm512_max_ps(reinterpret_cast<__m512>(x), _mm512_set1_ps(-110.f)), _mm512_set1_ps(88.7f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return reinterpret_cast<v16>(_mm512_scalef_ps(p, n));
#elif defined(KVSERVE_V16_PAIR)
  return {exp8(x.lo), exp8(x.hi)};
#else
  alignas(64) float e[16];
  store(e, x);
#pragma omp simd
  for (int i = 0; i < 16; ++i) e[i] = std::exp(e[i]);
  return load(e);
#endif
}

// tanh of 16 lanes: the [13/6] rational minimax approximation Eigen uses for float (generic_fast_tanh_float), on
// x clamped to +-7.905 (where it reaches +-1), within 4e-7 of tanh relative to it everywhere. Not
// 1 - 2 / (e^2x + 1) from exp16: near 0 that loses its digits to the cancellation, and s / cap is near 0 for
// every score small against the cap (Gemma 2's cap is 50), where the error would then be cap * 1e-7.
inline v16 tanh16(v16 x) {
  const v16 c = v16{} + 7.90531110763549805f;
  x = select_lt(x, v16{} - c, v16{} - c, select_lt(c, x, c, x));
  const v16 x2 = x * x;
  v16 p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
  p = p * x2 + -8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  v16 q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  return x * p / q;
}

// cap * tanh(x / cap) of 16 lanes: the soft cap on scores.
inline v16 soft_cap16(v16 x, float cap) { return tanh16(x * (1.f / cap)) * cap; }

// The pool's V rows of one kv head as attend_rows reads them: row t of page `page` at rows[(page * 16 + t) *
// token_stride], its scale at scale[(page * 16 + t) * slot_stride] (KVScales in cpu_vec.h).
template <typename T>
struct ValueRows {
  const T* rows;
  const float* scale;
  int64_t token_stride, slot_stride;
  KVFormat format;
};

// Query rows per work item. Each page of keys and values that an item reads from memory then serves this many
// rows from L1 (the transposed keys and the values of one kv head: 8 KiB for head_dim 64), instead of two rows:
// a chunk over a long cached context read every cached page once per pair of rows, from memory, and its time
// grew with rows x context x bytes rather than with the arithmetic.
constexpr int kBlockRows = 16;

// The running state of 2 rows x G heads between pages: accumulators, running max and sum (online softmax).
template <int NV, int G>
struct PairState {
  v16 acc[2][G][NV];
  float run_max[2][G], run_sum[2][G];
};

// The value vectors that attend_page's weighted sum keeps in registers per (row, head): all NV where the R x
// G x NV accumulators and a value row fit in the register file (AVX-512, for the default model's shape), else
// the largest power of two that does. Each pass over the page's values then updates R x G x NC accumulators
// from NC vectors of each value row; with all of them at once on AVX2 (48 ymm for 2 rows x 3 heads x 64
// dimensions) every FMA spilled an accumulator and reloaded it.
constexpr int value_chunk(int nv, int accumulators_per_vector) {
  int nc = nv;
  while (nc > 1 && (accumulators_per_vector + 1) * nc > kVectorRegs - 1) nc /= 2;
  return nc;
}

// A page's keys [lo, hi) (lanes) that each of R rows reads.
template <int R>
struct Lanes {
  int lo[R], hi[R];
};

// One page for R (1 or 2) rows x G heads of one chunk against one kv head: the scores of the rows' queries qr
// against the page's 16 keys (ktp: the page transposed, one vector per dimension), scaled and soft-capped
// (soft_cap > 0; before the mask, so that masked lanes stay kMinScore), the mask (row r reads lanes [lo, hi)),
// the online-softmax update and the weighted sum of the visible values, into the pair's state.
template <typename T, int NV, int G, int R>
inline void attend_page(PairState<NV, G>& state, const float* const* qr, const float* ktp, const T* vp,
                        const float* vs, const ValueRows<T>& v, const Lanes<R>& lanes, float scale, float soft_cap,
                        v16 lane) {
  constexpr int D = 16 * NV, NC = value_chunk(NV, R * G);
  v16 sc[R][G];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) sc[r][g] = v16{};
  for (int d = 0; d < D; ++d) {
    const v16 k = load(ktp + d * kPage);
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g) sc[r][g] += qr[r][g * D + d] * k;
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) sc[r][g] = sc[r][g] * scale;
  if (soft_cap > 0.f)  // one branch per page: without a cap the loops are as they were
    for (int r = 0; r < R; ++r)
      for (int g = 0; g < G; ++g) sc[r][g] = soft_cap16(sc[r][g], soft_cap);
  alignas(64) float w[R][G][kPage];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const v16 lo = v16{} + static_cast<float>(lanes.lo[r]), hi = v16{} + static_cast<float>(lanes.hi[r]);
    const bool none = lanes.lo[r] >= lanes.hi[r];  // a row of the pair before its window: weights 0
#pragma GCC unroll 16
    for (int g = 0; g < G; ++g) {
      if (none) {
        store(w[r][g], v16{});
        continue;
      }
      const v16 s = select_lt(lane, hi, select_lt(lane, lo, v16{} + kMinScore, sc[r][g]), v16{} + kMinScore);
      const float run_max = state.run_max[r][g];
      const float new_max = std::max(run_max, hmax(s));
      const v16 e = exp16(s - new_max);
      store(w[r][g], e);
      if (new_max != run_max) {  // rescale what earlier pages summed (after the first few, rarely)
        const float correction = std::exp(run_max - new_max);
        state.run_sum[r][g] *= correction;
#pragma GCC unroll 16
        for (int i = 0; i < NV; ++i) state.acc[r][g][i] *= correction;
        state.run_max[r][g] = new_max;
      }
      state.run_sum[r][g] += hsum(e);
    }
  }
  const int t0 = R == 2 ? std::min(lanes.lo[0], lanes.lo[R - 1]) : lanes.lo[0];
  const int t1 = R == 2 ? std::max(lanes.hi[0], lanes.hi[R - 1]) : lanes.hi[0];
  for (int c = 0; c < NV; c += NC) {  // the values' columns, NC vectors at a time
    v16 acc[R][G][NC];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
        for (int i = 0; i < NC; ++i) acc[r][g][i] = state.acc[r][g][c + i];
    for (int t = t0; t < t1; ++t) {
      v16 vrow[NC];
      load_row<NC>(vp + t * v.token_stride + 16 * c, v.format, vrow);
      const float v_scale = row_scale<T>(vs, t, v.slot_stride);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
        for (int g = 0; g < G; ++g) {
          const float weight = w[r][g][t] * v_scale;
#pragma GCC unroll 16
          for (int i = 0; i < NC; ++i) acc[r][g][i] += weight * vrow[i];
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int g = 0; g < G; ++g)
#pragma GCC unroll 16
        for (int i = 0; i < NC; ++i) state.acc[r][g][c + i] = acc[r][g][i];
  }
}

// Where a block's keys are: its chunk's pages transposed for one kv head (kt, page stride kt_stride, in the
// chunk's kt_slot order), its page table, and the window.
struct BlockKeys {
  const float* kt;
  int64_t kt_stride;
  const Chunk* chunk;
  KeyWindow window;
};

// Up to kBlockRows rows of one chunk (the first at position first_pos) x the G query heads of one kv head:
// page by page, each pair of rows that sees the page takes it (attend_page) while it is in L1; first the sink
// pages (their sink keys against q_sink), then the window's pages (the keys after the sinks in each row's
// window, against q). v: the pool's V rows of this kv head.
template <typename T, int NV, int G>
void attend_block(const float* q, const float* q_sink, float* out, int64_t row_stride, const BlockKeys& keys,
                  const ValueRows<T>& v, int64_t first_pos, int rows, int64_t kv_head, float scale,
                  float soft_cap) {
  constexpr int D = 16 * NV;
  PairState<NV, G> state[kBlockRows / 2];
  const int pairs = (rows + 1) / 2;
  for (int pr = 0; pr < pairs; ++pr)
    for (int r = 0; r < 2; ++r)
      for (int g = 0; g < G; ++g) {
        for (int i = 0; i < NV; ++i) state[pr].acc[r][g][i] = v16{};
        state[pr].run_max[r][g] = kMinScore;
        state[pr].run_sum[r][g] = 0.f;
      }
  v16 lane;
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) lane[i] = static_cast<float>(i);
  const KeyWindow& w = keys.window;
  const int64_t last_pos = first_pos + rows - 1, last_page = last_pos / kPage;
  const int64_t sink_end = std::min((w.sinks + kPage - 1) / kPage, last_page + 1);
  // pass 0: the sink pages; pass 1: the window's pages
  for (int pass = w.sinks > 0 ? 0 : 1; pass < 2; ++pass) {
    const float* qp = pass == 0 ? q_sink : q;
    for (int64_t p = pass == 0 ? 0 : w.first_key(first_pos) / kPage; p < (pass == 0 ? sink_end : last_page + 1);
         ++p) {
      const int64_t page = keys.chunk->table[p], base = p * kPage;
      const float* ktp = keys.kt + keys.chunk->kt_slot(p) * keys.kt_stride;
      const T* vp = v.rows + page * kPage * v.token_stride;
      const float* vs = v.scale + page * kPage * v.slot_stride;
      for (int pr = 0; pr < pairs; ++pr) {
        const int64_t pos = first_pos + 2 * pr;
        const int r = 2 * pr + 1 < rows ? 2 : 1;
        if (base > pos + r - 1) continue;  // the page is after this pair's rows
        Lanes<2> lanes;
        for (int i = 0; i < 2; ++i) {  // row i's keys in this page: the sinks it sees, or its window's
          const int64_t end = pos + i + 1, begin = pass == 0 ? 0 : w.first_key(pos + i);
          lanes.lo[i] = static_cast<int>(std::clamp<int64_t>(begin - base, 0, kPage));
          lanes.hi[i] = static_cast<int>(std::clamp<int64_t>((pass == 0 ? std::min(w.sinks, end) : end) - base, 0,
                                                             kPage));
        }
        if (lanes.lo[0] >= lanes.hi[0] && (r == 1 || lanes.lo[1] >= lanes.hi[1])) continue;  // before both windows
        const float* qr[2] = {qp + 2 * pr * row_stride + kv_head * G * D,
                              qp + (2 * pr + 1) * row_stride + kv_head * G * D};
        if (r == 2) {
          attend_page<T, NV, G, 2>(state[pr], qr, ktp, vp, vs, v, lanes, scale, soft_cap, lane);
        } else {
          attend_page<T, NV, G, 1>(state[pr], qr, ktp, vp, vs, v, Lanes<1>{{lanes.lo[0]}, {lanes.hi[0]}}, scale,
                                   soft_cap, lane);
        }
      }
    }
  }
  for (int row = 0; row < rows; ++row) {
    const PairState<NV, G>& st = state[row / 2];
    for (int g = 0; g < G; ++g) {
      const float inv = 1.f / st.run_sum[row % 2][g];
#pragma GCC unroll 16
      for (int i = 0; i < NV; ++i)
        store(out + row * row_stride + (kv_head * G + g) * D + 16 * i, st.acc[row % 2][g][i] * inv);
    }
  }
}

template <typename T>
using BlockFn = void (*)(const float*, const float*, float*, int64_t, const BlockKeys&, const ValueRows<T>&, int64_t,
                         int, int64_t, float, float);

template <typename T, int NV>
BlockFn<T> block_for_group(int64_t group) {
  return by_group<BlockFn<T>>(group, [](auto g) -> BlockFn<T> { return attend_block<T, NV, decltype(g)::value>; });
}

template <typename T>
BlockFn<T> block_kernel(int64_t head_dim, int64_t group) {
  return by_head_dim<BlockFn<T>>(head_dim, [group](auto nv) { return block_for_group<T, decltype(nv)::value>(group); });
}

// Page `page`'s keys as floats times their scales, transposed per kv head: dst[kv_head][d][16 keys].
template <typename T>
void transpose_keys(const T* k_ptr, KVFormat format, const KVScales& scales, int64_t page, int64_t num_kv_heads,
                    int64_t head_dim, float* dst) {
  const int64_t token_stride = num_kv_heads * head_dim;
  const T* src = k_ptr + page * kPage * token_stride;
  for (int64_t h = 0; h < num_kv_heads; ++h) {
    const float* ks = scales.k_at(page * kPage, h);
    for (int t = 0; t < kPage; ++t) {
      const float k_scale = row_scale<T>(ks, t, scales.slot_stride);
      for (int64_t d = 0; d < head_dim; d += 16) {
        const v16 x = load16(src + t * token_stride + h * head_dim + d, format) * k_scale;
#pragma GCC unroll 16
        for (int j = 0; j < 16; ++j) dst[(h * head_dim + d + j) * kPage + t] = x[j];
      }
    }
  }
}

// The step's chunks, as paged_prefill checked them, and where their rows are.
struct Step {
  std::vector<Chunk> chunks;
  int64_t kt_pages;  // pages in the transposed-keys buffer
  int64_t num_heads, head_dim, num_pages, num_kv_heads;
  float scale;
  float soft_cap;  // 0: none
  KeyWindow window;
};

// Pass 1 (every page a chunk reads, transposed) and pass 2 (blocks of rows x kv heads, the latest rows, which
// read the most keys, first) over a pool of element type T. q_sink: q without sinks.
template <typename T>
void prefill_all(const Step& st, const float* q_ptr, const float* q_sink_ptr, const T* k_ptr, KVFormat format,
                 const KVScales& scales, float* out_ptr) {
  const int64_t token_stride = st.num_kv_heads * st.head_dim;
  const int64_t kt_page = st.num_kv_heads * st.head_dim * kPage;  // floats of one transposed page
  std::vector<std::pair<int64_t, int64_t>> pages;  // (chunk, page index)
  pages.reserve(st.kt_pages);
  for (int64_t c = 0; c < static_cast<int64_t>(st.chunks.size()); ++c) {
    const Chunk& ch = st.chunks[c];
    for (int64_t p = 0; p < ch.sink_pages; ++p) pages.emplace_back(c, p);
    for (int64_t p = ch.first_page; p < ch.num_pages; ++p) pages.emplace_back(c, p);
  }
  std::vector<float> kt(st.kt_pages * kt_page);
  parallel_items(st.kt_pages, [&](int64_t i) {
    const auto [c, p] = pages[i];
    const Chunk& ch = st.chunks[c];
    transpose_keys(k_ptr, format, scales, ch.table[p], st.num_kv_heads, st.head_dim,
                   kt.data() + (ch.kt_offset + ch.kt_slot(p)) * kt_page);
  });

  std::vector<Item> items;
  for (int64_t c = 0; c < static_cast<int64_t>(st.chunks.size()); ++c)
    for (int64_t r = 0; r < st.chunks[c].q_len; r += kBlockRows)
      for (int64_t h = 0; h < st.num_kv_heads; ++h) items.push_back({c, r, h});
  const auto rows_of = [&](const Item& it) { return std::min<int64_t>(kBlockRows, st.chunks[it.chunk].q_len - it.row); };
  const auto keys_read = [&](const Item& it) {  // its last row's keys: the sinks and its window, or all
    const int64_t last = st.chunks[it.chunk].start_pos + it.row + rows_of(it) - 1;
    return last + 1 - st.window.first_key(last) + std::min(st.window.sinks, last + 1);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& a, const Item& b) { return keys_read(a) > keys_read(b); });
  const BlockFn<T> kernel = block_kernel<T>(st.head_dim, st.num_heads / st.num_kv_heads);
  const T* v_ptr = k_ptr + st.num_pages * kPage * token_stride;
  const int64_t row_stride = st.num_heads * st.head_dim;
  parallel_items(static_cast<int64_t>(items.size()), [&](int64_t i) {
    const Item& it = items[i];
    const Chunk& ch = st.chunks[it.chunk];
    const int64_t row = ch.row_start + it.row;
    const ValueRows<T> v{v_ptr + it.kv_head * st.head_dim, scales.v_at(0, it.kv_head), token_stride,
                         scales.slot_stride, format};
    const BlockKeys keys{kt.data() + ch.kt_offset * kt_page + it.kv_head * st.head_dim * kPage, kt_page, &ch,
                         st.window};
    kernel(q_ptr + row * row_stride, q_sink_ptr + row * row_stride, out_ptr + row * row_stride, row_stride, keys, v,
           ch.start_pos + it.row, static_cast<int>(rows_of(it)), it.kv_head, st.scale, st.soft_cap);
  });
}

// The chunks of a step, checked against q's rows and the pool's pages, with their places in the scratch.
std::vector<Chunk> step_chunks(const at::Tensor& tables, const at::Tensor& row_start, const at::Tensor& q_lens,
                               const at::Tensor& start_pos, int64_t num_tokens, int64_t num_pages,
                               const KeyWindow& window, int64_t& kt_pages) {
  const int64_t num_chunks = tables.size(0), max_pages = tables.size(1);
  TORCH_CHECK(row_start.numel() == num_chunks && q_lens.numel() == num_chunks && start_pos.numel() == num_chunks,
              "one row_start, q_len and start_pos per chunk");
  const auto rs = row_start.contiguous(), ql = q_lens.contiguous(), sp = start_pos.contiguous();
  const int64_t *rs_ptr = rs.data_ptr<int64_t>(), *ql_ptr = ql.data_ptr<int64_t>(), *sp_ptr = sp.data_ptr<int64_t>();
  std::vector<Chunk> chunks(num_chunks);
  kt_pages = 0;
  for (int64_t c = 0; c < num_chunks; ++c) {
    Chunk& ch = chunks[c];
    ch.row_start = rs_ptr[c];
    ch.q_len = ql_ptr[c];
    ch.start_pos = sp_ptr[c];
    TORCH_CHECK(ch.q_len > 0 && ch.start_pos >= 0 && ch.row_start >= 0 && ch.row_start + ch.q_len <= num_tokens,
                "chunk ", c, ": rows outside q");
    ch.num_pages = (ch.start_pos + ch.q_len - 1) / kPage + 1;
    TORCH_CHECK(ch.num_pages <= max_pages, "chunk ", c, ": its last position is past its page table");
    ch.first_page = std::min(window.first_key(ch.start_pos) / kPage, ch.num_pages - 1);
    ch.sink_pages = std::min((window.sinks + kPage - 1) / kPage, ch.first_page);
    ch.table = tables.data_ptr<int64_t>() + c * max_pages;
    for (int64_t i = 0; i < ch.kt_pages(); ++i) {  // the pages it reads (HOLEs between them are never read)
      const int64_t p = i < ch.sink_pages ? i : ch.first_page + i - ch.sink_pages;
      TORCH_CHECK(ch.table[p] >= 0 && ch.table[p] < num_pages, "chunk ", c, ": page id outside the pool");
    }
    ch.kt_offset = kt_pages;
    kt_pages += ch.kt_pages();
  }
  return chunks;
}

}  // namespace

bool paged_prefill_supports(int64_t head_dim, int64_t num_heads, int64_t num_kv_heads, int64_t page_size) {
  return page_size == kPage && num_kv_heads > 0 && num_heads % num_kv_heads == 0 &&
         block_kernel<float>(head_dim, num_heads / num_kv_heads) != nullptr;
}

at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& kv_cache, const std::optional<at::Tensor>& kv_scales,
                         const at::Tensor& tables, const at::Tensor& row_start, const at::Tensor& q_lens,
                         const at::Tensor& start_pos, double scale, at::Tensor& out, int64_t window, int64_t sinks,
                         const std::optional<at::Tensor>& q_sink, double logits_soft_cap) {
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5 && tables.dim() == 2, "bad ranks");
  TORCH_CHECK(q.scalar_type() == at::kFloat, "q: float32");
  TORCH_CHECK(q.is_contiguous() && kv_cache.is_contiguous() && tables.is_contiguous() && out.is_contiguous() &&
                  out.sizes() == q.sizes() && out.scalar_type() == at::kFloat, "contiguous q and out of one shape");
  TORCH_CHECK(tables.scalar_type() == at::kLong && row_start.scalar_type() == at::kLong &&
                  q_lens.scalar_type() == at::kLong && start_pos.scalar_type() == at::kLong, "int64 metadata");
  Step st{{}, 0, q.size(1), q.size(2), kv_cache.size(1), kv_cache.size(3), static_cast<float>(scale),
          checked_soft_cap(logits_soft_cap), checked_window(window, sinks, q, q_sink)};
  TORCH_CHECK(kv_cache.size(0) == 2 && kv_cache.size(4) == st.head_dim,
              "kv_cache: [2, pages, 16, kv_heads, head_dim]");
  TORCH_CHECK(paged_prefill_supports(st.head_dim, st.num_heads, st.num_kv_heads, kv_cache.size(2)),
              "paged_prefill: pages of 16, head_dim 16/32/64/128 and up to 8 query heads per kv head only");
  st.chunks = step_chunks(tables, row_start, q_lens, start_pos, q.size(0), st.num_pages, st.window, st.kt_pages);
  const KVScales scales = kv_scales_of(kv_cache, kv_scales);
  const KVFormat format = kv_format_of(kv_cache.scalar_type());
  const float* q_sink_ptr = sinks > 0 ? q_sink->data_ptr<float>() : q.data_ptr<float>();
  by_kv_storage(format, [&](auto type) {
    using T = typename decltype(type)::type;
    prefill_all(st, q.data_ptr<float>(), q_sink_ptr, static_cast<const T*>(kv_cache.data_ptr()), format, scales,
                out.data_ptr<float>());
  });
  return out;
}

}  // namespace kvserve
