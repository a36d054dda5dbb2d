// The small per-layer ops of the CPU backend, each one pass over its rows: RMSNorm (with the residual add
// before it), SiLU(gate) * up, and RoPE on the fused projection's q and k with k and v stored straight into
// their cache slots (quantised there, for a pool of 1-byte elements, as kvserve/kernels/kv_quant.py does in torch).
//
// Why: in a decode step each of these runs on a few kilobytes right after a projection has streamed
// megabytes through the caches, so its inputs and every intermediate are cold. torch's composite versions
// make five to ten passes (RMSNorm: pow, mean, add, rsqrt, mul, mul; RoPE: slice, neg, cat, mul, mul, add,
// then a contiguous copy of q and two index_copy_ into the cache), and in that position each pass is a trip
// through cold memory: together they were a large share of a decode step.
//
// Numerics follow HF's order (RMSNorm: x * rsqrt(mean(x^2) + eps), then * weight; SiLU: g / (1 + exp(-g)));
// the sum of squares is accumulated in a different order, and exp is the vectorised libm's, so results may
// differ from torch's in the last bit or two.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_vec.h"

namespace kvserve {
namespace {

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.is_contiguous(), name,
              ": a contiguous float32 [rows, features]");
}

// y = (x * rsqrt(mean(x^2) + eps)) * w for one row.
inline void norm_row(const float* x, const float* w, int64_t n, float eps, float* y) {
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) sum += x[j] * x[j];
  // in double, so that -ffast-math's approximate reciprocal square root is not used for the one scale
  const float r = static_cast<float>(1.0 / std::sqrt(static_cast<double>(sum / static_cast<float>(n)) + eps));
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] = (x[j] * r) * w[j];
}

// rms_norm of each row of x into a new tensor; first x += delta in place when delta is given.
at::Tensor norm_rows(at::Tensor& x, const at::Tensor* delta, const at::Tensor& w, double eps) {
  const int64_t M = x.size(0), n = x.size(1);
  TORCH_CHECK(w.numel() == n && w.is_contiguous() && w.scalar_type() == at::kFloat, "w: float32 [features]");
  auto y = at::empty_like(x);
  float* xp = x.data_ptr<float>();
  const float* dp = delta != nullptr ? delta->data_ptr<float>() : nullptr;
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* xr = xp + r * n;
      if (dp != nullptr) {
        const float* dr = dp + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) xr[j] += dr[j];
      }
      norm_row(xr, wp, n, static_cast<float>(eps), yp + r * n);
    }
  });
  return y;
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  at::Tensor rows = x;  // read only: no delta is added
  return norm_rows(rows, nullptr, w, eps);
}

// x += delta (in place: the residual stream), then returns rms_norm(x, w, eps).
at::Tensor add_rms_norm_(at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  check_rows(delta, "delta");
  TORCH_CHECK(delta.sizes() == x.sizes(), "delta must have x's shape");
  return norm_rows(x, &delta, w, eps);
}

// gate_up [M, 2I] (gate then up, as the fused projection writes them) -> silu(gate) * up [M, I].
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  const int64_t M = gate_up.size(0), I = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: an even number of columns");
  auto out = at::empty({M, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float *g = gp + r * 2 * I, *u = g + I;
      float* o = op + r * I;
#pragma omp simd
      for (int64_t j = 0; j < I; ++j) o[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
    }
  });
  return out;
}

namespace {

// The rotate-half RoPE of one head: out = in * cos + rotate_half(in) * sin.
inline void rotate_head(const float* in, const float* c, const float* s, int64_t D, float* out) {
  const int64_t half = D / 2;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) out[j] = in[j] * c[j] + (-in[j + half]) * s[j];
#pragma omp simd
  for (int64_t j = half; j < D; ++j) out[j] = in[j] * c[j] + in[j - half] * s[j];
}

// One head's row x [n] as a pool's 1-byte elements dst, per kvserve/kernels/kv_quant.py: with a scale per (token, kv
// head), s = max |x| / qmax (1 where that is 0) and y = x / s; without (the tensor scheme) s = 1 and y = x.
// int8: y rounded half to even, clamped to +-127; float8: y clamped to +-qmax, then rounded to nearest even
// (c10's conversion, torch's own). Returns s. Compiled without -ffast-math, so that s and y are the IEEE
// quotients torch computes, not products with reciprocals, and -0 stays -0: the bytes equal torch's.
#if defined(__clang__)
#pragma float_control(precise, on, push)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
#endif
float quantise_row(const float* x, int64_t n, KVFormat format, bool per_token, uint8_t* dst) {
  const float qmax = format == KVFormat::kInt8 ? 127.f : format == KVFormat::kE4M3 ? 448.f : 57344.f;
  float s = 1.f;
  if (per_token) {
    float amax = 0.f;
    for (int64_t d = 0; d < n; ++d) amax = std::fabs(x[d]) > amax ? std::fabs(x[d]) : amax;
    s = amax / qmax;
    if (s == 0.f) s = 1.f;
  }
  for (int64_t d = 0; d < n; ++d) {
    const float q = x[d] / s;
    const float y = q < -qmax ? -qmax : q > qmax ? qmax : q;
    if (format == KVFormat::kInt8) {
      dst[d] = static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(y)));
    } else if (format == KVFormat::kE4M3) {
      dst[d] = c10::Float8_e4m3fn(y).x;
    } else {
      dst[d] = c10::Float8_e5m2(y).x;
    }
  }
  return s;
}
#if defined(__clang__)
#pragma float_control(pop)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

// Where rope_store writes: q [M, H, D], and one layer's cache as slots [2][num_slots][Hkv * D] of 1-byte or
// float elements, with the scales [2][num_slots][Hkv] when there are any.
struct RopeOut {
  float* q;
  void* kv;
  float* scales;  // nullptr: none (float32 pools, and the tensor scheme)
  int64_t num_slots;
  KVFormat format;
};

// Token t of rope_store into a float32 cache: q and k rotated, k and v copied into slot `slot`.
void rope_token_float(const float* x, const float* c, const float* s, int64_t t, int64_t slot, int64_t H,
                      int64_t Hkv, int64_t D, const RopeOut& out) {
  const int64_t row = Hkv * D;
  float* kp = static_cast<float*>(out.kv);
  float* vp = kp + out.num_slots * row;
  for (int64_t h = 0; h < H + Hkv; ++h)
    rotate_head(x + h * D, c, s, D, h < H ? out.q + (t * H + h) * D : kp + slot * row + (h - H) * D);
  std::memcpy(vp + slot * row, x + (H + Hkv) * D, row * sizeof(float));
}

// The same into a cache of 1-byte elements: k rotated into `rotated` [D], then k and v quantised into the slot.
void rope_token_quantised(const float* x, const float* c, const float* s, int64_t t, int64_t slot, int64_t H,
                          int64_t Hkv, int64_t D, const RopeOut& out, float* rotated) {
  const int64_t row = Hkv * D;
  uint8_t* kp = static_cast<uint8_t*>(out.kv);
  uint8_t* vp = kp + out.num_slots * row;
  const bool per_token = out.scales != nullptr;
  for (int64_t h = 0; h < H; ++h) rotate_head(x + h * D, c, s, D, out.q + (t * H + h) * D);
  for (int64_t h = 0; h < Hkv; ++h) {
    rotate_head(x + (H + h) * D, c, s, D, rotated);
    const float k_scale = quantise_row(rotated, D, out.format, per_token, kp + slot * row + h * D);
    const float v_scale = quantise_row(x + (H + Hkv + h) * D, D, out.format, per_token, vp + slot * row + h * D);
    if (per_token) {
      out.scales[slot * Hkv + h] = k_scale;
      out.scales[(out.num_slots + slot) * Hkv + h] = v_scale;
    }
  }
}

}  // namespace

// qkv [M, (H + 2 Hkv) D]: RoPE (rotate-half layout; cos, sin [M, D]) on the H query and Hkv key heads. Returns q
// [M, H, D]; writes the rotated k and the plain v of token t to slot slot_mapping[t] of kv_cache, one layer's
// [2, num_pages, page_size, Hkv, D]: as they are into a float32 cache, quantised (quantise_row) into a 1-byte
// one, with their scales into kv_scales [2, num_pages, page_size, Hkv] unless that is None (the tensor scheme).
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t H, int64_t Hkv,
                      at::Tensor& kv_cache, const std::optional<at::Tensor>& kv_scales,
                      const at::Tensor& slot_mapping) {
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t M = qkv.size(0), D = cos.size(1);
  TORCH_CHECK(qkv.size(1) == (H + 2 * Hkv) * D && D % 2 == 0, "qkv: [tokens, (H + 2 Hkv) * head_dim]");
  TORCH_CHECK(cos.size(0) == M && sin.sizes() == cos.sizes(), "cos, sin: [tokens, head_dim]");
  const KVFormat format = kv_format_of(kv_cache.scalar_type());
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.is_contiguous() && kv_cache.size(0) == 2 && kv_cache.size(3) == Hkv &&
                  kv_cache.size(4) == D,
              "kv_cache: one layer's contiguous [2, num_pages, page_size, Hkv, head_dim]");
  check_kv_scales(kv_cache, kv_scales);
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.size(0) == M && slot_mapping.scalar_type() == at::kLong,
              "slot_mapping: int64 [tokens]");
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  auto slots = slot_mapping.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < M; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot ", sp[t], " out of range");
  auto q = at::empty({M, H, D}, qkv.options());
  const RopeOut out{q.data_ptr<float>(), kv_cache.data_ptr(),
                    kv_scales.has_value() ? kv_scales->data_ptr<float>() : nullptr, num_slots, format};
  const float *xp = qkv.data_ptr<float>(), *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  const int64_t width = qkv.size(1);
  at::parallel_for(0, M, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(format == KVFormat::kFloat32 ? 0 : D);
    for (int64_t t = begin; t < end; ++t) {
      const float *x = xp + t * width, *c = cp + t * D, *s = snp + t * D;
      if (format == KVFormat::kFloat32) {
        rope_token_float(x, c, s, t, sp[t], H, Hkv, D, out);
      } else {
        rope_token_quantised(x, c, s, t, sp[t], H, Hkv, D, out, rotated.data());
      }
    }
  });
  return q;
}

// Per row of logits [n, vocab]: the first index of the maximum (as torch.argmax) and logsumexp, in two passes
// over the row while it is in cache, where argmax + log_softmax made three over the whole matrix and wrote one.
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(const at::Tensor& logits) {
  check_rows(logits, "logits");
  const int64_t n = logits.size(0), V = logits.size(1);
  TORCH_CHECK(V > 0, "logits: an empty vocabulary");
  auto ids = at::empty({n}, logits.options().dtype(at::kLong));
  auto lse = at::empty({n}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* sp = lse.data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* x = lp + r * V;
      float best = x[0];
      int64_t at = 0;
      for (int64_t j = 1; j < V; ++j) {
        if (x[j] > best) {
          best = x[j];
          at = j;
        }
      }
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t j = 0; j < V; ++j) sum += std::exp(x[j] - best);
      ip[r] = at;
      sp[r] = best + std::log(sum);
    }
  });
  return {ids, lse};
}

}  // namespace kvserve
