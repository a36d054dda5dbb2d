// The CPU backend's extension module: the paged decode and prefill kernels (paged_decode.cpp,
// paged_prefill.cpp), the packed linear layers (packed_linear.cpp, block_linear.cpp) and the per-layer small ops
// (layer_ops.cpp).
// kvserve/kernels/cpu_paged.py builds the files into one module.
#include <torch/extension.h>

#include <optional>

namespace kvserve {
torch::Tensor paged_decode(const torch::Tensor& q, const torch::Tensor& kv_cache,
                           const std::optional<torch::Tensor>& kv_scales, const torch::Tensor& tables,
                           const torch::Tensor& seq_lens, double scale, int64_t window, int64_t sinks,
                           const std::optional<torch::Tensor>& q_sink, double logits_soft_cap);
int64_t parallel_threads(int64_t num_tasks);
bool paged_prefill_supports(int64_t head_dim, int64_t num_heads, int64_t num_kv_heads, int64_t page_size);
torch::Tensor paged_prefill(const torch::Tensor& q, const torch::Tensor& kv_cache,
                            const std::optional<torch::Tensor>& kv_scales, const torch::Tensor& tables,
                            const torch::Tensor& row_start, const torch::Tensor& q_lens,
                            const torch::Tensor& start_pos, double scale, torch::Tensor& out, int64_t window,
                            int64_t sinks, const std::optional<torch::Tensor>& q_sink, double logits_soft_cap);
torch::Tensor pack_panels(const torch::Tensor& w);
torch::Tensor linear_packed(const torch::Tensor& x, const torch::Tensor& panels);
std::vector<torch::Tensor> pack_blocks(const torch::Tensor& w, int64_t bits);
torch::Tensor linear_blocks(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& d,
                            const torch::Tensor& m);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor add_rms_norm_(torch::Tensor& x, const torch::Tensor& delta, const torch::Tensor& w, double eps);
torch::Tensor silu_mul(const torch::Tensor& gate_up);
torch::Tensor rope_store(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin, int64_t H,
                         int64_t Hkv, torch::Tensor& kv_cache, const std::optional<torch::Tensor>& kv_scales,
                         const torch::Tensor& slot_mapping);
std::tuple<torch::Tensor, torch::Tensor> argmax_logsumexp(const torch::Tensor& logits);
}  // namespace kvserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_decode", &kvserve::paged_decode,
        "paged decode attention, K/V read in place: float32 q, a float32 / int8 / float8 pool with its kv_scales "
        "or None; a sliding window (0 = none) and sinks scored against q_sink; scores soft-capped at "
        "cap * tanh(s / cap) (0 = no cap) (CPU)",
        py::arg("q"), py::arg("kv_cache"), py::arg("kv_scales"), py::arg("tables"), py::arg("seq_lens"),
        py::arg("scale"), py::arg("window") = 0, py::arg("sinks") = 0, py::arg("q_sink") = py::none(),
        py::arg("logits_soft_cap") = 0.0);
  m.def("paged_prefill", &kvserve::paged_prefill,
        "causal attention of prefill chunks' rows of q over their pages, written into out: float32 q, a float32 / "
        "int8 / float8 pool with its kv_scales or None; a sliding window (0 = none) and sinks scored against "
        "q_sink; scores soft-capped at cap * tanh(s / cap) (0 = no cap) (CPU)",
        py::arg("q"), py::arg("kv_cache"), py::arg("kv_scales"), py::arg("tables"), py::arg("row_start"),
        py::arg("q_lens"), py::arg("start_pos"), py::arg("scale"), py::arg("out"), py::arg("window") = 0,
        py::arg("sinks") = 0, py::arg("q_sink") = py::none(), py::arg("logits_soft_cap") = 0.0);
  m.def("paged_prefill_supports", &kvserve::paged_prefill_supports,
        "whether paged_prefill takes (head_dim, num_heads, num_kv_heads, page_size)");
  m.def("parallel_threads", &kvserve::parallel_threads, "intra-op threads one parallel_for ran on (a build check)");
  m.def("pack_panels", &kvserve::pack_panels, "w [N, K] -> panels [N / 32, K, 32] for linear_packed");
  m.def("linear_packed", &kvserve::linear_packed, "x [M, K] @ w.T from w's panels (CPU, float32)");
  m.def("pack_blocks", &kvserve::pack_blocks,
        "w [N, K] -> [q, d, m] panels of exact 4- or 8-bit blocks for linear_blocks; [] when w has none");
  m.def("linear_blocks", &kvserve::linear_blocks, "x [M, K] @ w.T from w's block panels (CPU, float32)");
  m.def("rms_norm", &kvserve::rms_norm, "RMSNorm of each row of x [M, n] (CPU, float32)");
  m.def("add_rms_norm_", &kvserve::add_rms_norm_, "x += delta in place, then RMSNorm of x (CPU, float32)");
  m.def("silu_mul", &kvserve::silu_mul, "gate_up [M, 2I] -> silu(gate) * up [M, I] (CPU, float32)");
  m.def("rope_store", &kvserve::rope_store,
        "RoPE on qkv's q and k heads; k and v stored in their cache slots, quantised into a 1-byte cache (scales "
        "into kv_scales unless None); returns q [M, H, D] (CPU, float32)");
  m.def("argmax_logsumexp", &kvserve::argmax_logsumexp, "per row of logits: (argmax, logsumexp) (CPU, float32)");
}
