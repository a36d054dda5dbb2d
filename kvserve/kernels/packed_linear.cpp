// y = x @ w.T with w packed once into column panels: the CPU backend's linear layers (float32).
//
// MKL's sgemm packs the weight matrix on every call. With the few rows of a decode step that packing costs
// more than the product, which only has to read the weights once. Here the weights are packed once, at load,
// into panels of 32 output columns,
//
//   panels      [num_panels = N / 32, K, 32]   float32, contiguous: panels[p, k, j] = w[32 p + j, k]
//
// so a panel streams from memory in order. With AVX-512, a micro-kernel takes two adjacent panels and up to 6
// rows of x and keeps the 6 x 64 block of y in registers while it walks k: per k, four vector loads of the
// panels, one broadcast per row, 4 FMAs per row (an 8 x 32 kernel handles an odd last panel). With the 16
// registers of AVX2 (or NEON's 32 of 4 floats), a 3 x 32 kernel takes one panel at a time. A work item is a pair of
// panels over up to 96 rows of x, claimed by whichever intra-op thread is free (cpu_parallel.h); the pair stays
// in L2 while the item's row tiles pass over it. It needs no second copy of the weights, and is compared with
// MKL's sgemm on the model's shapes, from a decode step's rows to a prefill chunk's, by bench/bench_worker.py.
//
//   x           [M, K]          float32, contiguous
//   returns     [M, N]          float32
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

#include "cpu_parallel.h"
#include "cpu_vec.h"

namespace kvserve {
namespace {

// Rows of x per call of the one-panel kernel: 8 (16 accumulators) with AVX-512's 32 registers, 3 (6
// accumulators, and the panel row's two vectors) with 8 (4 measured slower).
constexpr int kMaxRows = kVectorRegs >= 32 ? 8 : 3;

// y[0:R, 0:32P] = x[0:R, :] @ [panel_0 .. panel_P-1]: P adjacent panels (2P vectors per row, R x 2P
// accumulators in registers); each broadcast of x feeds 2P FMAs.
template <int R, int P>
void micro_kernel(const float* x, int64_t ldx, const float* panels, int64_t K, float* y, int64_t ldy) {
  v16 acc[R][2 * P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * P; ++j) acc[r][j] = v16{};
  for (int64_t k = 0; k < K; ++k) {
    v16 w[2 * P];
#pragma GCC unroll 8
    for (int j = 0; j < 2 * P; ++j) w[j] = load(panels + (j / 2) * K * kPanel + k * kPanel + (j % 2) * 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
#pragma GCC unroll 8
      for (int j = 0; j < 2 * P; ++j) acc[r][j] += xv * w[j];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int j = 0; j < 2 * P; ++j) store(y + r * ldy + j * 16, acc[r][j]);
}

using MicroKernel = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);
// Two panels at once, up to 6 rows (24 accumulators): four FMAs per broadcast, where 32 registers hold them.
// An odd last panel, and every panel where they do not: one panel, up to kMaxRows rows.
constexpr bool kWidePairs = kVectorRegs >= 32;
constexpr int kWideRows = 6;
constexpr MicroKernel kWide[kWideRows + 1] = {nullptr,             micro_kernel<1, 2>, micro_kernel<2, 2>,
                                             micro_kernel<3, 2>, micro_kernel<4, 2>, micro_kernel<5, 2>,
                                             micro_kernel<6, 2>};
constexpr MicroKernel kNarrow[8 + 1] = {nullptr,             micro_kernel<1, 1>, micro_kernel<2, 1>,
                                               micro_kernel<3, 1>, micro_kernel<4, 1>, micro_kernel<5, 1>,
                                               micro_kernel<6, 1>, micro_kernel<7, 1>, micro_kernel<8, 1>};

}  // namespace

at::Tensor pack_panels(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat, "w: a float32 matrix [N, K]");
  TORCH_CHECK(w.size(0) % kPanel == 0, "N must be a multiple of ", kPanel, ", got ", w.size(0));
  return w.reshape({w.size(0) / kPanel, kPanel, w.size(1)}).transpose(1, 2).contiguous();
}

void panel_rows(const float* x, int64_t M, int64_t K, const float* panels, int count, float* y, int64_t ldy) {
  if (count == 2 && !kWidePairs) {  // each panel on its own: the same FMAs in the same order per column
    panel_rows(x, M, K, panels, 1, y, ldy);
    panel_rows(x, M, K, panels + K * kPanel, 1, y + kPanel, ldy);
    return;
  }
  const int max_rows = count == 2 ? kWideRows : kMaxRows;
  const MicroKernel* kernels = count == 2 ? kWide : kNarrow;
  for (int64_t m = 0; m < M; m += max_rows) {
    const int rows = static_cast<int>(std::min<int64_t>(max_rows, M - m));
    kernels[rows](x + m * K, K, panels, K, y + m * ldy, ldy);
  }
}

at::Tensor linear_packed(const at::Tensor& x, const at::Tensor& panels) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x: contiguous float32 [M, K]");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kPanel && panels.is_contiguous() &&
                  panels.scalar_type() == at::kFloat, "panels: contiguous float32 [N / 32, K, 32]");
  const int64_t M = x.size(0), K = x.size(1), num_panels = panels.size(0);
  TORCH_CHECK(panels.size(1) == K, "x has ", K, " columns, the panels ", panels.size(1), " rows");
  auto y = at::empty({M, num_panels * kPanel}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* pp = panels.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldy = num_panels * kPanel;
  // Work items: a pair of panels (the last may be single) over a chunk of rows, claimed by whichever thread is
  // free (cpu_parallel.h).
  const int64_t num_pairs = (num_panels + 1) / 2;
  const int64_t num_chunks = (M + kRowChunk - 1) / kRowChunk;
  parallel_items(num_pairs * num_chunks, [&](int64_t item) {
    const int64_t p = 2 * (item / num_chunks), r0 = (item % num_chunks) * kRowChunk;
    panel_rows(xp + r0 * K, std::min(kRowChunk, M - r0), K, pp + p * K * kPanel, p + 1 < num_panels ? 2 : 1,
               yp + r0 * ldy + p * kPanel, ldy);
  });
  return y;
}

}  // namespace kvserve
