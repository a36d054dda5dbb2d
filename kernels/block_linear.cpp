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
// P = N / 32 panels of 32 output columns, as for the float32 panels. linear_blocks unpacks a pair of panels
// into a per-thread float32 buffer laid out exactly as packed_linear.cpp's panels and runs the same
// micro-kernel over it, so its output equals linear_packed's on the unpacked weights bit for bit.
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

namespace kvserve {

// packed_linear.cpp: y[:, 0:32 count] = x @ panels (count = 1 or 2 adjacent float32 panels [K, 32]).
void panel_rows(const float* x, int64_t M, int64_t K, const float* panels, int count, float* y, int64_t ldy);

namespace {

constexpr int kPanel = 32;  // output columns per panel, as in packed_linear.cpp

typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint8_t v16b __attribute__((vector_size(16)));
typedef int8_t v16sb __attribute__((vector_size(16)));

constexpr int kBlock = 32;  // weights per block along K (GGUF's QK4_1 and QK8_0)

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

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

// Panel p of a 4-bit matrix as float32 [K, 32] (packed_linear.cpp's panel layout).
void unpack_q4(const uint8_t* q, const float* d, const float* m, int64_t K, int64_t p, float* out) {
  const int64_t num_blocks = K / kBlock;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* db = d + (p * num_blocks + b) * kPanel;
    const float* mb = m + (p * num_blocks + b) * kPanel;
    const v16 d0 = load(db), d1 = load(db + 16), m0 = load(mb), m1 = load(mb + 16);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      const v16i bytes = widen<false>(q + (p * K + k) * 16);
      store(out + k * kPanel, __builtin_convertvector(bytes & 15, v16) * d0 + m0);
      store(out + k * kPanel + 16, __builtin_convertvector(bytes >> 4, v16) * d1 + m1);
    }
  }
}

void unpack_q8(const int8_t* q, const float* d, int64_t K, int64_t p, float* out) {
  const int64_t num_blocks = K / kBlock;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const float* db = d + (p * num_blocks + b) * kPanel;
    const v16 d0 = load(db), d1 = load(db + 16);
    for (int64_t k = b * kBlock; k < (b + 1) * kBlock; ++k) {
      const int8_t* row = q + (p * K + k) * kPanel;
      store(out + k * kPanel, __builtin_convertvector(widen<true>(row), v16) * d0);
      store(out + k * kPanel + 16, __builtin_convertvector(widen<true>(row + 16), v16) * d1);
    }
  }
}

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
  const int64_t num_pairs = (num_panels + 1) / 2;
  at::parallel_for(0, num_pairs, 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<float> buffer;  // two panels, unpacked; kept between calls (no page faults)
    if (buffer.size() < static_cast<size_t>(2 * K * kPanel)) buffer.resize(2 * K * kPanel);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t p = 2 * item;
      const int count = p + 1 < num_panels ? 2 : 1;
      for (int i = 0; i < count; ++i) {
        float* out = buffer.data() + i * K * kPanel;
        if (four)
          unpack_q4(q.data_ptr<uint8_t>(), dp, mp, K, p + i, out);
        else
          unpack_q8(q.data_ptr<int8_t>(), dp, K, p + i, out);
      }
      panel_rows(xp, M, K, buffer.data(), count, yp + p * kPanel, ldy);
    }
  });
  return y;
}

}  // namespace kvserve
