// The Python module of the CPU kernels: paged_attention.cpp, prefill_attention.cpp, fused_ops.cpp,
// linear_bf16.cpp and shm_allreduce.cpp.

#include <torch/extension.h>

void decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, int64_t layer,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor out);
void prefill_attention(const at::Tensor& query, const at::Tensor& kv_cache, int64_t layer,
                       const at::Tensor& block_table, int64_t context_len, double scale, at::Tensor out,
                       at::Tensor workspace, const std::string& isa);
bool prefill_attention_available();
std::vector<std::string> prefill_attention_isas();
int64_t prefill_workspace_bytes(int64_t keys, int64_t num_kv_heads, int64_t head_dim);
bool bf16_linear_available();
at::Tensor pack_bf16_linear(const at::Tensor& weight);
void bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                 at::Tensor out);
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out);
void add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight, double eps,
                  at::Tensor out);
void silu_mul(const at::Tensor& gate_up, at::Tensor out);
void rope_cache(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                at::Tensor kv_cache, int64_t layer, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                at::Tensor q_out);

void shm_allreduce_init(at::Tensor segment, int64_t world, int64_t slot_floats, int64_t spins);
int64_t shm_allreduce_bytes(int64_t world, int64_t slot_floats);
bool shm_allreduce(at::Tensor x, const at::Tensor& segment, int64_t rank, int64_t call, double timeout_s);
void shm_allreduce_abort(const at::Tensor& segment);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)");
  m.def("prefill_attention", &prefill_attention, "causal prefill attention from the paged pool (bf16)",
        py::arg("query"), py::arg("kv_cache"), py::arg("layer"), py::arg("block_table"), py::arg("context_len"),
        py::arg("scale"), py::arg("out"), py::arg("workspace"), py::arg("isa") = "");
  m.def("prefill_attention_available", &prefill_attention_available, "built for AVX512-BF16 (or AMX) here");
  m.def("prefill_attention_isas", &prefill_attention_isas, "instruction sets usable here, best first");
  m.def("prefill_workspace_bytes", &prefill_workspace_bytes, "workspace bytes prefill_attention needs");
  m.def("bf16_linear_available", &bf16_linear_available, "built for AVX512-BF16 here");
  m.def("pack_bf16_linear", &pack_bf16_linear, "weight [N, K] bf16 -> the packed tiles bf16_linear reads");
  m.def("bf16_linear", &bf16_linear, "out = x W^T (+ bias), bf16, from a packed weight", py::arg("x"),
        py::arg("packed"), py::arg("bias"), py::arg("out"));
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * weight");
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta; out = RMSNorm(hidden) * weight");
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up");
  m.def("rope_cache", &rope_cache, "RoPE on q (into q_out) and k (in place); K/V written to the pool");
  m.def("shm_allreduce_init", &shm_allreduce_init, "lay out a shared-memory all-reduce segment (the driver)");
  m.def("shm_allreduce_bytes", &shm_allreduce_bytes, "bytes of a segment for world ranks and slot_floats");
  m.def("shm_allreduce", &shm_allreduce, "sum x over the ranks in rank order, in place; false: aborted or late",
        py::call_guard<py::gil_scoped_release>());
  m.def("shm_allreduce_abort", &shm_allreduce_abort, "wake and fail every wait on the segment");
}
