// y = x @ w.T for a w whose float32 values are exactly 4-bit or 8-bit blocks: the CPU backend's linear layers
// for weights that came from a quantised GGUF (SmolLM2's projections are Q4_1, its embedding Q8_0).
//
// The float32 weights that HF (and kvserve) compute with are then, per block of 32 along K,
//
//   Q4_1:  w = d * q + m    q in [0, 15],     d, m float16 values
//   Q8_0:  w = d * q        q in [-127, 127], d a float16 value
//
// and d * q is exact in float32 (at most 11 + 8 significant bits), so these blocks hold the same floats in 6
// (4-bit) or 10 (8-bit) bits a weight instead of 32. A decode step reads every weight once and is bound by that
// read: this is the same product with 5x fewer bytes. pack_blocks finds d, q (and m) and keeps them only when
// every weight comes back bit for bit; otherwise the matrix stays float32 panels (packed_linear.cpp).
//
//   q (4 bits)  [P, K, 16] uint8    byte j of row k: column j in the low nibble, column j + 16 in the high one
//   q (8 bits)  [P, K, 32] int8
//   d, m        [P, K / 32, 32]     float32 (m: 4 bits only), for panel p, block b, column j
//
// P = N / 32 panels of 32 output columns, as for the float32 panels. For up to 32 rows of x (a decode step),
// linear_blocks unpacks each row of weights in registers and feeds it straight to the FMAs of up to 8 rows of
// x at a time; for more, it unpacks a pair of panels into a per-thread float32 buffer laid out exactly as
// packed_linear.cpp's panels and runs that file's micro-kernel over it, up to 96 rows a work item. Items (a
// panel, or a pair over a chunk of rows) are claimed by whichever intra-op thread is free (cpu_parallel.h).
// Both paths do the same FMAs in the same order as linear_packed on the unpacked weights, so the output is the
// same bit for bit.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include <atomic>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_parallel.h"
#include "cpu_vec.h"

namespace kvserve {
namespace {

typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v16sb __attribute__((vector_size(16)));

constexpr int kBlock = 32;  // weights per block along K (GGUF's QK4_1 and QK8_0)

// 16 bytes widened to 16 int32 lanes: one vpmovzxbd / vpmovsxbd with AVX-512 (GCC's __builtin_convertvector
// goes byte by byte here, and took longer than the product it feeds), else the portable conversion.
template <bool kSigned>
inline v16i widen(const void* p) {
#ifdef __AVX512F__
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return reinterpret_cast<v16i>(kSigned ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
  typedef typename std::conditional<kSigned, v16sb, v16b>::type Bytes;
  Bytes b;
  std::memcpy(&b, p, sizeof(b));
  return __builtin_convertvector(b, v16i);
#endif
}

// 16 bytes as floats: their low and high nibbles (4 bits), or their signed values (8 bits). With AVX2 (the
// v16 pair of cpu_vec.h) in intrinsics, two 8-lane halves at a time.
#ifdef KVSERVE_V16_PAIR
inline void nibbles(const uint8_t* p, v16& low, v16& high) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256i b0 = _mm256_cvtepu8_epi32(b), b1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(b, b));
  const __m256i mask = _mm256_set1_epi32(15);
  low = join8(_mm256_cvtepi32_ps(_mm256_and_si256(b0, mask)), _mm256_cvtepi32_ps(_mm256_and_si256(b1, mask)));
  high = join8(_mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)));
}

inline v16 signed_bytes(const int8_t* p) { return load16_int8(reinterpret_cast<const uint8_t*>(p)); }
#else
inline void nibbles(const uint8_t* p, v16& low, v16& high) {
  const v16i bytes = widen<false>(p);
  low = __builtin_convertvector(bytes & 15, v16);
  high = __builtin_convertvector(bytes >> 4, v16);
}

inline v16 signed_bytes(const int8_t* p) { return __builtin_convertvector(widen<true>(p), v16); }
#endif

inline float half_round(float x) { return static_cast<float>(c10::Half(x)); }
inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// One block's d, m and q, or false when no 4-bit (d, m, q) gives back every value bit for bit.
bool fit_q4(const float* v, int64_t stride, float& d, float& m, uint8_t* q) {
  float lo = v[0], hi = v[0];
  for (int i = 1; i < kBlock; ++i) {
    lo = std::min(lo, v[i * stride]);
    hi = std::max(hi, v[i * stride]);
  }
  m = half_round(lo);
  d = half_round((hi - m) / 15.0f);
  for (int i = 0; i < kBlock; ++i) {
    const float x = v[i * stride];
    const float r = d == 0.0f ? 0.0f : std::nearbyint((x - m) / d);
    if (!(r >= 0.0f && r <= 15.0f) || !same_bits(r * d + m, x)) return false;
    q[i] = static_cast<uint8_t>(r);
  }
  return true;
}

bool fit_q8(const float* v, int64_t stride, float& d, int8_t* q) {
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::max(amax, std::fabs(v[i * stride]));
  d = half_round(amax / 127.0f);
  for (int i = 0; i < kBlock; ++i) {
    const float x = v[i * stride];
    const float r = d == 0.0f ? 0.0f : std::nearbyint(x / d);
    if (!(r >= -127.0f && r <= 127.0f) || !same_bits(r * d, x)) return false;
    q[i] = static_cast<int8_t>(r);
  }
  return true;
}

// The scales of block b of panel p (two vectors each; m for 4 bits only).
template <bool kFour>
inline void block_scales(const float* d, const float* m, int64_t num_blocks, int64_t p, int64_t b, v16* dv,
                         v16* mv) {
  const int64_t at = (p * num_blocks + b) * kPanel;
  dv[0] = load(d + at);
  dv[1] = load(d + at + 16);
  if constexpr (kFour) {
    mv[0] = load(m + at);
    mv[1] = load(m + at + 16);
  }
}

// The 32 weights of row k of panel p (two vectors), from their block's scales: d * q + m, or d * q.
template <bool kFour>
inline void weights_row(const void* q, int64_t K, int64_t p, int64_t k, const v16* dv, const v16* mv, v16* w) {
  if constexpr (kFour) {
    v16 low, high;
    nibbles(static_cast<const uint8_t*>(q) + (p * K + k) * 16, low, high);
    w[0] = low * dv[0] + mv[0];
    w[1] = high * dv[1] + mv[1];
  } else {
    const int8_t* row = static_cast<const int8_t*>(q) + (p * K + k) * kPanel;
    w[0] = signed_bytes(row) * dv[0];
    w[1] = signed_bytes(row + 16) * dv[1];
  }
}

// Panel p as float32 [K, 32] (packed_linear.cpp's panel layout).
template <bool kFour>
void unpack(const void* q, const float* d, const float* m, int64_t K, int64_t p, float* out) {
  const int64_t num_blocks = K / kBlock;
  for (int64_t b = 0; b < num_blocks; ++b) {
    v16 dv[2], mv[2], w[2];
    block_scales<kFour>(d, m, num_blocks, p, b, dv, mv);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      weights_row<kFour>(q, K, p, k, dv, mv, w);
      store(out + k * kPanel, w[0]);
      store(out + k * kPanel + 16, w[1]);
    }
  }
}

// y[0:R, 0:32] = x[0:R, :] @ panel p, each row of weights unpacked in registers: for the few rows of a decode
// step, where writing the unpacked panel to a buffer and reading it back costs more than the product. The
// same weights and the same FMAs in the same order as micro_kernel over unpack's panel: the same floats.
template <int R, bool kFour>
void fused_kernel(const float* x, int64_t ldx, const void* q, const float* d, const float* m, int64_t K,
                  int64_t p, float* y, int64_t ldy) {
  v16 acc[R][2];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = v16{};
  const int64_t num_blocks = K / kBlock;
  for (int64_t b = 0; b < num_blocks; ++b) {
    v16 dv[2], mv[2];
    block_scales<kFour>(d, m, num_blocks, p, b, dv, mv);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      v16 w[2];
      weights_row<kFour>(q, K, p, k, dv, mv, w);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const float xv = x[r * ldx + k];
        acc[r][0] += xv * w[0];
        acc[r][1] += xv * w[1];
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    store(y + r * ldy, acc[r][0]);
    store(y + r * ldy + 16, acc[r][1]);
  }
}

using FusedKernel = void (*)(const float*, int64_t, const void*, const float*, const float*, int64_t, int64_t,
                             float*, int64_t);
// Rows per pass: 8 with AVX-512 (16 accumulators, 2 weight vectors, 4 scale vectors in 32 registers); 3 where
// 8 registers hold 16 floats (6 accumulators, and the unpacking's vectors; 2 and 4 measured slower).
constexpr int kFusedRows = kVectorRegs >= 32 ? 8 : 3;
// Up to this many rows of x, passes of 8 rows unpack the weights in registers (each pass unpacks them again);
// beyond, through the buffer, once: unpacking again per pass stops paying for the skipped buffer as the rows
// grow. Passes of 12 rows (24 accumulators) spill and lose to 8.
constexpr int kFusedMaxRows = 32;
template <bool kFour>
constexpr FusedKernel kFused[8 + 1] = {
    nullptr, fused_kernel<1, kFour>, fused_kernel<2, kFour>, fused_kernel<3, kFour>, fused_kernel<4, kFour>,
    fused_kernel<5, kFour>, fused_kernel<6, kFour>, fused_kernel<7, kFour>, fused_kernel<8, kFour>};

}  // namespace

std::vector<at::Tensor> pack_blocks(const at::Tensor& w, int64_t bits) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w: a float32 matrix [N, K]");
  TORCH_CHECK(bits == 4 || bits == 8, "bits: 4 or 8, got ", bits);
  const int64_t N = w.size(0), K = w.size(1);
  if (N % kPanel || K % kBlock) return {};
  const auto wc = w.contiguous();
  const float* wp = wc.data_ptr<float>();
  const int64_t P = N / kPanel, num_blocks = K / kBlock;
  auto fopts = w.options();
  auto q = at::zeros({P, K, bits == 4 ? 16 : kPanel}, fopts.dtype(bits == 4 ? at::kByte : at::kChar));
  auto d = at::empty({P, num_blocks, kPanel}, fopts);
  auto m = bits == 4 ? at::empty({P, num_blocks, kPanel}, fopts) : at::empty({0}, fopts);
  std::atomic<bool> exact{true};
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    uint8_t q4[kBlock];
    int8_t q8[kBlock];
    for (int64_t p = begin; p < end && exact.load(std::memory_order_relaxed); ++p) {
      for (int64_t j = 0; j < kPanel; ++j) {
        const float* col = wp + (p * kPanel + j) * K;  // row n = 32 p + j of w
        for (int64_t b = 0; b < num_blocks; ++b) {
          float& db = d.data_ptr<float>()[(p * num_blocks + b) * kPanel + j];
          if (bits == 4) {
            float& mb = m.data_ptr<float>()[(p * num_blocks + b) * kPanel + j];
            if (!fit_q4(col + b * kBlock, 1, db, mb, q4)) {
              exact = false;
              return;
            }
            uint8_t* dst = q.data_ptr<uint8_t>() + (p * K + b * kBlock) * 16 + j % 16;
            const int shift = j < 16 ? 0 : 4;
            for (int i = 0; i < kBlock; ++i) dst[i * 16] |= static_cast<uint8_t>(q4[i] << shift);
          } else {
            if (!fit_q8(col + b * kBlock, 1, db, q8)) {
              exact = false;
              return;
            }
            int8_t* dst = q.data_ptr<int8_t>() + (p * K + b * kBlock) * kPanel + j;
            for (int i = 0; i < kBlock; ++i) dst[i * kPanel] = q8[i];
          }
        }
      }
    }
  });
  if (!exact) return {};
  return {q, d, m};
}

at::Tensor linear_blocks(const at::Tensor& x, const at::Tensor& q, const at::Tensor& d, const at::Tensor& m) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  const bool four = q.scalar_type() == at::kByte;
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(2) == (four ? 16 : kPanel) &&
                  (four || q.scalar_type() == at::kChar), "q: contiguous [P, K, 16] uint8 or [P, K, 32] int8");
  const int64_t M = x.size(0), K = x.size(1), num_panels = q.size(0);
  TORCH_CHECK(q.size(1) == K && K % kBlock == 0, "x has ", K, " columns, q ", q.size(1), " rows");
  TORCH_CHECK(d.is_contiguous() && d.numel() == num_panels * K && (!four || (m.is_contiguous() && m.numel() == d.numel())),
              "d (and m): contiguous float32 [P, K / 32, 32]");
  auto y = at::empty({M, num_panels * kPanel}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* mp = four ? m.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t ldy = num_panels * kPanel;
  const void* qp = q.data_ptr();
  const FusedKernel* kernels = four ? kFused<true> : kFused<false>;
  if (M <= kFusedMaxRows) {  // items: single panels, every row of x
    parallel_items(num_panels, [&](int64_t p) {
      for (int64_t r = 0; r < M; r += kFusedRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kFusedRows, M - r));
        kernels[rows](xp + r * K, K, qp, dp, mp, K, p, yp + r * ldy + p * kPanel, ldy);
      }
    });
    return y;
  }
  // items: a pair of panels over a chunk of rows, pair-major. A thread unpacks a pair into its buffer once per
  // call (the next chunk it claims is often the same pair's).
  const int64_t num_pairs = (num_panels + 1) / 2;
  const int64_t num_chunks = (M + kRowChunk - 1) / kRowChunk;
  static std::atomic<uint64_t> calls{0};
  const uint64_t call = ++calls;
  parallel_items(num_pairs * num_chunks, [&](int64_t item) {
    thread_local std::vector<float> buffer;  // two panels, unpacked; kept between calls (no page faults)
    thread_local uint64_t buffer_call = 0;
    thread_local int64_t buffer_pair = -1;
    const int64_t pair = item / num_chunks, r0 = (item % num_chunks) * kRowChunk, p = 2 * pair;
    const int count = p + 1 < num_panels ? 2 : 1;
    if (buffer_call != call || buffer_pair != pair) {
      if (buffer.size() < static_cast<size_t>(2 * K * kPanel)) buffer.resize(2 * K * kPanel);
      for (int i = 0; i < count; ++i) {
        if (four) unpack<true>(qp, dp, mp, K, p + i, buffer.data() + i * K * kPanel);
        else unpack<false>(qp, dp, mp, K, p + i, buffer.data() + i * K * kPanel);
      }
      buffer_call = call;
      buffer_pair = pair;
    }
    panel_rows(xp + r0 * K, std::min(kRowChunk, M - r0), K, buffer.data(), count, yp + r0 * ldy + p * kPanel, ldy);
  });
  return y;
}

}  // namespace kvserve
