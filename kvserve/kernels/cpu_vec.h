// What the cpu backend's C++ files share: 16-float vectors, their loads and stores at any float's alignment,
// lane reductions, the float32 panel layout of the packed linear layers, and the element types of the KV pool
// with their loads as 16 floats (kvserve/kernels/cpu_paged.py keys its build cache on this file's text too, since
// torch's JIT build watches only the .cpp sources).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <type_traits>
#include <utility>

namespace kvserve {

// The query heads that share a kv head (a GQA group) are a template parameter of the attention kernels, so that
// a group's queries and accumulators stay in registers. by_group(group, make) is make(std::integral_constant<
// int, G>) for the runtime group size G in [1, kMaxGroup], and a null Fn outside it (the caller falls back).
constexpr int kMaxGroup = 8;

template <typename Fn, typename Make, int... G>
Fn by_group_of(int64_t group, Make make, std::integer_sequence<int, G...>) {
  const Fn table[] = {make(std::integral_constant<int, G + 1>{})...};
  return group >= 1 && group <= kMaxGroup ? table[group - 1] : Fn{};
}

template <typename Fn, typename Make>
Fn by_group(int64_t group, Make make) {
  return by_group_of<Fn>(group, make, std::make_integer_sequence<int, kMaxGroup>{});
}

// by_head_dim(head_dim, make): make(std::integral_constant<int, NV>) for the head sizes the kernels specialise
// (NV 16-float vectors a head: 16, 32, 64, 128), a null Fn for any other.
template <typename Fn, typename Make>
Fn by_head_dim(int64_t head_dim, Make make) {
  switch (head_dim) {
    case 16: return make(std::integral_constant<int, 1>{});
    case 32: return make(std::integral_constant<int, 2>{});
    case 64: return make(std::integral_constant<int, 4>{});
    case 128: return make(std::integral_constant<int, 8>{});
    default: return Fn{};
  }
}

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// 16 floats, the kernels' vector. With AVX-512 (and on targets other than x86), GCC's generic 64-byte vector:
// one zmm register. With AVX2 it is two 8-float vectors in a struct: GCC has no machine mode for a 64-byte
// vector there and keeps one in memory, every operation and every broadcast going through the stack (an
// order of magnitude slower), while a struct of two ymm halves stays in registers. Both are written alike:
// v16{} is zero, + - * between vectors and with a float, / between vectors, +=, *=, x[i], and select_lt for a
// lane-wise a < b ? x : y.
#if defined(__AVX2__) && defined(__F16C__) && !defined(__AVX512F__)
#define KVSERVE_V16_PAIR 1
typedef float v8u __attribute__((vector_size(32), aligned(4), may_alias));

struct v16 {
  v8 lo, hi;
  float operator[](int i) const { return i < 8 ? lo[i] : hi[i - 8]; }
  float& operator[](int i) { return reinterpret_cast<float*>(this)[i]; }
  v16& operator+=(v16 b) {
    lo += b.lo;
    hi += b.hi;
    return *this;
  }
  v16& operator*=(float s) {
    lo *= s;
    hi *= s;
    return *this;
  }
};

inline v16 operator+(v16 a, v16 b) { return {a.lo + b.lo, a.hi + b.hi}; }
inline v16 operator-(v16 a, v16 b) { return {a.lo - b.lo, a.hi - b.hi}; }
inline v16 operator*(v16 a, v16 b) { return {a.lo * b.lo, a.hi * b.hi}; }
inline v16 operator/(v16 a, v16 b) { return {a.lo / b.lo, a.hi / b.hi}; }
inline v16 operator+(v16 a, float s) { return {a.lo + s, a.hi + s}; }
inline v16 operator-(v16 a, float s) { return {a.lo - s, a.hi - s}; }
inline v16 operator*(v16 a, float s) { return {a.lo * s, a.hi * s}; }
inline v16 operator*(float s, v16 a) { return {s * a.lo, s * a.hi}; }
inline v16 select_lt(v16 a, v16 b, v16 x, v16 y) { return {a.lo < b.lo ? x.lo : y.lo, a.hi < b.hi ? x.hi : y.hi}; }

inline v16 load(const float* p) {
  return {*reinterpret_cast<const v8u*>(p), *reinterpret_cast<const v8u*>(p + 8)};
}
inline void store(float* p, v16 v) {
  *reinterpret_cast<v8u*>(p) = v.lo;
  *reinterpret_cast<v8u*>(p + 8) = v.hi;
}
#else
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }
inline v16 select_lt(v16 a, v16 b, v16 x, v16 y) { return a < b ? x : y; }
#endif

constexpr int kPanel = 32;  // output columns per packed weight panel: two vectors

// How many 16-float vectors the register file holds, which sizes the kernels' register tiles: 32 with AVX-512
// (one zmm each); 8 with AVX2 (16 ymm, two a vector) and NEON (32 q registers, four a vector). A tile sized
// for AVX-512 spills most of its accumulators to the stack elsewhere, and runs many times slower.
#ifdef __AVX512F__
constexpr int kVectorRegs = 32;
#else
constexpr int kVectorRegs = 8;
#endif

// Rows of x per work item of the panel GEMMs (packed_linear.cpp, block_linear.cpp): a multiple of panel_rows'
// 6-row tile; a 512-token prefill chunk makes 6 items per pair of panels, so the two threads end together.
constexpr int64_t kRowChunk = 96;

// A reduction of a vector's 16 lanes as a tree of halves: four dependent steps, not fifteen.
template <typename Op>
inline float reduce16(v16 x, Op op) {
  v8 lo, hi;
  __builtin_memcpy(&lo, &x, sizeof(lo));
  __builtin_memcpy(&hi, reinterpret_cast<const char*>(&x) + sizeof(lo), sizeof(hi));
  const v8 a = op(lo, hi);
  v4 l4, h4;
  __builtin_memcpy(&l4, &a, sizeof(l4));
  __builtin_memcpy(&h4, reinterpret_cast<const char*>(&a) + sizeof(l4), sizeof(h4));
  const v4 b = op(l4, h4);
  return op(op(b[0], b[1]), op(b[2], b[3]));
}

inline float hsum(v16 x) {
  return reduce16(x, [](auto a, auto b) { return a + b; });
}

inline float hmax(v16 x) {
  return reduce16(x, [](auto a, auto b) { return a > b ? a : b; });
}

// The attention kernels' "minus infinity" for masked scores: finite, since the build uses -ffast-math.
constexpr float kMinScore = -1e30f;

// The KV pool's element formats (kvserve/kernels/kv_quant.py): float32, whose elements are the values, or 1-byte int8,
// float8_e4m3fn and float8_e5m2 elements whose value is float(stored) * scale. The attention kernels are
// templates over the element's storage type, float or uint8_t (by_kv_storage): one instance reads all three
// 1-byte formats and tells them apart per row of head_dim elements (load_row: a branch that goes the same way
// for a whole call), so that each kernel is compiled twice rather than four times.
enum class KVFormat : uint8_t { kFloat32, kInt8, kE4M3, kE5M2 };

inline KVFormat kv_format_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return KVFormat::kFloat32;
    case at::kChar: return KVFormat::kInt8;
    case at::kFloat8_e4m3fn: return KVFormat::kE4M3;
    case at::kFloat8_e5m2: return KVFormat::kE5M2;
    default: TORCH_CHECK(false, "kv_cache: float32, int8, float8_e4m3fn or float8_e5m2, not ", dtype);
  }
}

template <typename T>
struct KVType {
  using type = T;
};

template <typename T>
constexpr bool kQuantised = !std::is_same_v<T, float>;

// make(KVType<float>{}) for a float32 pool, make(KVType<uint8_t>{}) for the 1-byte ones.
template <typename Make>
void by_kv_storage(KVFormat format, Make make) {
  if (format == KVFormat::kFloat32) {
    make(KVType<float>{});
  } else {
    make(KVType<uint8_t>{});
  }
}

// 16 pool elements as 16 floats: their stored values (the caller applies the row's scale). With AVX2 and F16C,
// in intrinsics (GCC's generic vectors convert bytes to wider lanes one byte at a time there): int8 by vpmovsxbd
// and vcvtdq2ps; float8 through float16, exactly (vcvtph2ps, subnormal halves included): e5m2 is the high byte of
// a float16, and e4m3's 7 bits below the sign, at bits 13..7 of a float16, make one of the same mantissa and an
// exponent 8 less (normal and subnormal alike), so that times 256 it is the e4m3 value.
#if defined(__AVX2__) && defined(__F16C__)
inline v16 join8(__m256 lo, __m256 hi) {
#ifdef KVSERVE_V16_PAIR
  return {reinterpret_cast<v8>(lo), reinterpret_cast<v8>(hi)};
#else
  v16 out;
  __builtin_memcpy(&out, &lo, sizeof(lo));
  __builtin_memcpy(reinterpret_cast<char*>(&out) + sizeof(lo), &hi, sizeof(hi));
  return out;
#endif
}

inline __m128i load_bytes(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

inline v16 load16_int8(const uint8_t* p) {
  const __m128i x = load_bytes(p);
  return join8(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)),
               _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(x, x))));
}

inline v16 halves_to_float(__m256i h) {
  return join8(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)));
}

inline v16 load16_e5m2(const uint8_t* p) {
  return halves_to_float(_mm256_slli_epi16(_mm256_cvtepu8_epi16(load_bytes(p)), 8));
}

// The byte s eeee mmm, shifted to the high byte of 16 bits and then right by 1 with its sign (s s eeee mmm 000
// 0000), with bit 14 cleared: the float16 s 0 eeee mmm 000 0000.
inline v16 load16_e4m3(const uint8_t* p) {
  const __m256i high = _mm256_slli_epi16(_mm256_cvtepu8_epi16(load_bytes(p)), 8);
  const __m256i half = _mm256_and_si256(_mm256_srai_epi16(high, 1), _mm256_set1_epi16(static_cast<int16_t>(0xbfff)));
  return halves_to_float(half) * 256.f;
}
#else
typedef uint8_t v16u8u __attribute__((vector_size(16), aligned(1), may_alias));
typedef int8_t v16i8u __attribute__((vector_size(16), aligned(1), may_alias));
typedef int32_t v16i32 __attribute__((vector_size(64)));
typedef uint32_t v16u32 __attribute__((vector_size(64)));

inline v16 load16_int8(const uint8_t* p) {
  return __builtin_convertvector(__builtin_convertvector(*reinterpret_cast<const v16i8u*>(p), v16i32), v16);
}

// float8 with M mantissa bits and exponent bias B, from its bits: sign << 31, and for em = byte & 0x7f a
// normal number's bits (em << (23 - M)) + ((127 - B) << 23) (em >= 2^M) or a subnormal's value em * unit (em <
// 2^M, unit = 2^(1 - B - M)). Every intermediate is a normal float or 0: nothing to flush where DAZ is on.
template <int M, int B>
inline v16 load16_fp8(const uint8_t* p, float unit) {
  const v16u32 u = __builtin_convertvector(*reinterpret_cast<const v16u8u*>(p), v16u32);
  const v16u32 em = u & 0x7fu;
  const v16u32 normal = (em << (23 - M)) + ((127u - B) << 23);
  const v16 sub = __builtin_convertvector((v16i32)em, v16) * unit;  // vector casts keep the bits
  const v16u32 bits = (em >= v16u32{} + (1u << M) ? normal : (v16u32)sub) | ((u & 0x80u) << 24);
  return (v16)bits;
}

inline v16 load16_e5m2(const uint8_t* p) { return load16_fp8<2, 15>(p, 0x1p-16f); }
inline v16 load16_e4m3(const uint8_t* p) { return load16_fp8<3, 7>(p, 0x1p-9f); }
#endif

inline v16 load16(const float* p, KVFormat) { return load(p); }

inline v16 load16(const uint8_t* p, KVFormat format) {
  switch (format) {
    case KVFormat::kInt8: return load16_int8(p);
    case KVFormat::kE4M3: return load16_e4m3(p);
    default: return load16_e5m2(p);
  }
}

// A row of 16 * NV pool elements as NV vectors, with one branch on the format per row.
template <int NV>
inline void load_row(const float* p, KVFormat, v16* row) {
#pragma GCC unroll 16
  for (int i = 0; i < NV; ++i) row[i] = load(p + 16 * i);
}

template <int NV>
inline void load_row(const uint8_t* p, KVFormat format, v16* row) {
  switch (format) {
    case KVFormat::kInt8:
#pragma GCC unroll 16
      for (int i = 0; i < NV; ++i) row[i] = load16_int8(p + 16 * i);
      return;
    case KVFormat::kE4M3:
#pragma GCC unroll 16
      for (int i = 0; i < NV; ++i) row[i] = load16_e4m3(p + 16 * i);
      return;
    default:
#pragma GCC unroll 16
      for (int i = 0; i < NV; ++i) row[i] = load16_e5m2(p + 16 * i);
  }
}

// One element's stored value, for the kernels' scalar paths (c10's conversions).
inline float element(const float* p, int64_t d, KVFormat) { return p[d]; }

inline float element(const uint8_t* p, int64_t d, KVFormat format) {
  switch (format) {
    case KVFormat::kInt8: return static_cast<int8_t>(p[d]);
    case KVFormat::kE4M3: return static_cast<float>(c10::Float8_e4m3fn(p[d], c10::Float8_e4m3fn::from_bits()));
    default: return static_cast<float>(c10::Float8_e5m2(p[d], c10::Float8_e5m2::from_bits()));
  }
}

// Where the kernels read the scales of a pool of 1-byte elements: key (or value) row t of page `page` and kv
// head h has its scale at k[(page * page_size + t) * slot_stride + h * head_stride]. The kv_scales tensor
// [2, num_pages, page_size, num_kv_heads] float32 gives strides (num_kv_heads, 1); the tensor scheme (no
// kv_scales) gives (0, 0) over a single 1.0.
struct KVScales {
  const float* k;
  const float* v;
  int64_t slot_stride, head_stride;

  const float* k_at(int64_t slot, int64_t h) const { return k + slot * slot_stride + h * head_stride; }
  const float* v_at(int64_t slot, int64_t h) const { return v + slot * slot_stride + h * head_stride; }
};

// The scale of row t, with the rows' scales at scale[t * slot_stride]: a constant 1 for float32 pools, which
// have none, so that their kernels' multiplications by it compile away.
template <typename T>
inline float row_scale(const float* scale, int64_t t, int64_t slot_stride) {
  if constexpr (kQuantised<T>) {
    return scale[t * slot_stride];
  } else {
    return 1.f;
  }
}

// Checks kv_scales against one layer's kv_cache [2, num_pages, page_size, num_kv_heads, head_dim]: none for a
// float32 cache; for a 1-byte one none (the tensor scheme) or a contiguous float32 [2, num_pages, page_size,
// num_kv_heads].
inline void check_kv_scales(const at::Tensor& kv_cache, const std::optional<at::Tensor>& kv_scales) {
  if (!kv_scales.has_value()) return;
  const at::Tensor& s = *kv_scales;
  TORCH_CHECK(kv_cache.element_size() == 1, "kv_scales: only a 1-byte cache has scales");
  TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() && s.dim() == 4 && s.size(0) == 2 &&
                  s.size(1) == kv_cache.size(1) && s.size(2) == kv_cache.size(2) && s.size(3) == kv_cache.size(3),
              "kv_scales: a contiguous float32 [2, num_pages, page_size, num_kv_heads]");
}

inline KVScales kv_scales_of(const at::Tensor& kv_cache, const std::optional<at::Tensor>& kv_scales) {
  static const float one = 1.f;
  check_kv_scales(kv_cache, kv_scales);
  if (!kv_scales.has_value()) return {&one, &one, 0, 0};
  const float* k = kv_scales->data_ptr<float>();
  return {k, k + kv_scales->numel() / 2, kv_cache.size(3), 1};
}

// A sliding window and attention sinks (kvserve/kernels/window.py): a query at position p reads key j when
// p - window < j <= p, or j < sinks (the sinks scored against the query's second rotation, q_sink). window 0:
// every j <= p, and no sinks.
struct KeyWindow {
  int64_t window, sinks;

  // The first key after the sinks that a query at pos reads (0 without a window).
  int64_t first_key(int64_t pos) const { return window > 0 ? std::max(pos - window + 1, sinks) : 0; }
};

// The paged kernels' window arguments, checked: q_sink, when there are sinks, a float32 tensor shaped as q.
inline KeyWindow checked_window(int64_t window, int64_t sinks, const at::Tensor& q,
                                const std::optional<at::Tensor>& q_sink) {
  TORCH_CHECK(window >= 0 && sinks >= 0 && (window > 0 || sinks == 0), "window >= 0, and sinks only with a window");
  TORCH_CHECK(sinks == 0 || (q_sink.has_value() && q_sink->scalar_type() == at::kFloat && q_sink->is_contiguous() &&
                             q_sink->sizes() == q.sizes()),
              "attention sinks need q_sink: contiguous float32, shaped as q");
  return {window, sinks};
}

// The paged kernels' logits_soft_cap (0: none; > 0: scores become cap * tanh(s / cap)) as a float, checked on its
// bits: -ffast-math folds std::isfinite, and comparisons with NaN, as if every value were finite.
inline float checked_soft_cap(double logits_soft_cap) {
  const float cap = static_cast<float>(logits_soft_cap);  // past float's range: inf, refused below
  uint32_t bits;
  std::memcpy(&bits, &cap, sizeof bits);
  TORCH_CHECK(((bits >> 23) & 0xff) != 0xff && cap >= 0.f, "logits_soft_cap: finite and >= 0 (0 = none)");
  return cap;
}

// packed_linear.cpp: y[:, 0:32 count] = x [M, K] @ panels (count = 1 or 2 adjacent float32 panels [K, 32]).
void panel_rows(const float* x, int64_t M, int64_t K, const float* panels, int count, float* y, int64_t ldy);

}  // namespace kvserve
