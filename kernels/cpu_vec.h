// What the cpu backend's C++ files share: 16-float vectors, their loads and stores at any float's alignment,
// lane reductions, and the float32 panel layout of the packed linear layers (kernels/cpu_paged.py keys its
// build cache on this file's text too, since torch's JIT build watches only the .cpp sources).
#pragma once

#include <cstdint>
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

// 16 floats: GCC/Clang lower it to one AVX-512 register, two AVX2 ones, or four NEON ones. v16u is the same
// at any float's alignment, for loads and stores of rows in the pool or in a panel.
typedef float v16 __attribute__((vector_size(64)));
typedef float v16u __attribute__((vector_size(64), aligned(4), may_alias));

inline v16 load(const float* p) { return *reinterpret_cast<const v16u*>(p); }
inline void store(float* p, v16 v) { *reinterpret_cast<v16u*>(p) = v; }

constexpr int kPanel = 32;  // output columns per packed weight panel: two vectors

// Rows of x per work item of the panel GEMMs (packed_linear.cpp, block_linear.cpp): a multiple of panel_rows'
// 6-row tile; a 512-token prefill chunk makes 6 items per pair of panels, so the two threads end together.
constexpr int64_t kRowChunk = 96;

typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

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

// packed_linear.cpp: y[:, 0:32 count] = x [M, K] @ panels (count = 1 or 2 adjacent float32 panels [K, 32]).
void panel_rows(const float* x, int64_t M, int64_t K, const float* panels, int count, float* y, int64_t ldy);

}  // namespace kvserve
