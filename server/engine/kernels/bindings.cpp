// The Python module of the CPU kernels: paged_attention.cpp and fused_ops.cpp.

#include <torch/extension.h>

void decode_attention(const at::Tensor& query, const at::Tensor& kv_cache, int64_t layer,
                      const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale, at::Tensor out);
void rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor out);
void add_rms_norm(at::Tensor hidden, const at::Tensor& delta, const at::Tensor& weight, double eps,
                  at::Tensor out);
void silu_mul(const at::Tensor& gate_up, at::Tensor out);
void rope_cache(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                at::Tensor kv_cache, int64_t layer, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets,
                at::Tensor q_out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention (CPU)");
  m.def("rms_norm", &rms_norm, "out = RMSNorm(x) * weight");
  m.def("add_rms_norm", &add_rms_norm, "hidden += delta; out = RMSNorm(hidden) * weight");
  m.def("silu_mul", &silu_mul, "out = silu(gate) * up");
  m.def("rope_cache", &rope_cache, "RoPE on q (into q_out) and k (in place); K/V written to the pool");
}
