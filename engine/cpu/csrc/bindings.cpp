// The Python module `tokenloom_cpu_kernels`: one binding per kernel, declared here
// so each kernel file holds only its kernel (engine/cpu/extension.py builds
// every file in engine/cpu/csrc/ into this one module).
#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

// paged_decode_attention.cpp
torch::Tensor paged_decode_attention(
    torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
    torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window);
std::string paged_decode_attention_path();

// paged_prefill_attention.cpp
void paged_prefill_attention(
    torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor seq_indices, double scale, int64_t window);

// paged_shared_decode_attention.cpp
void paged_shared_decode_attention(
    torch::Tensor out, torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
    torch::Tensor seq_lens, torch::Tensor query_start_loc, torch::Tensor members, torch::Tensor group_starts,
    torch::Tensor shared_blocks, double scale);

// sample_rows.cpp
torch::Tensor sample_rows(torch::Tensor logits, torch::Tensor temperatures, torch::Tensor uniforms);

// apply_penalties.cpp
void apply_penalties(torch::Tensor logits, torch::Tensor rows, torch::Tensor slots, torch::Tensor counts,
                     torch::Tensor prompt_mask, torch::Tensor repetition, torch::Tensor frequency,
                     torch::Tensor presence);

// apply_token_bitmask.cpp
void apply_token_bitmask(torch::Tensor logits, torch::Tensor bitmask, torch::Tensor rows);

// small_batch_linear.cpp
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor slabs, torch::Tensor bias, bool out_fp32);
bool has_small_batch_linear();
void set_one_token_prefetch(bool on);
bool one_token_prefetch();

// fused_ops.cpp
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, int64_t lanes);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, int64_t lanes);
torch::Tensor silu_and_mul(torch::Tensor gate_up, int64_t lanes);
torch::Tensor rotary_store_kv(
    torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
    torch::Tensor k_cache, torch::Tensor v_cache, int64_t num_heads, int64_t num_kv_heads);

// decode_stack.cpp: a class, bound there
void bind_decode_stack(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)");
  m.def("paged_decode_attention_path", &paged_decode_attention_path,
        "the vector passes paged_decode_attention was built with: avx512_bf16, avx512, avx2_x8 or default");
  m.def("paged_prefill_attention", &paged_prefill_attention, "paged causal attention for query chunks, into out (CPU)");
  m.def("paged_shared_decode_attention", &paged_shared_decode_attention,
        "decodes of sequences sharing their first blocks, one tile per group, into out (CPU)");
  m.def("sample_rows", &sample_rows, "one token per row: greedy, or an inverse-CDF draw at a temperature (CPU)");
  m.def("apply_penalties", &apply_penalties, "repetition, frequency and presence penalties in place (CPU)");
  m.def("apply_token_bitmask", &apply_token_bitmask, "the grammar's bitmask on listed rows of logits, in place (CPU)");
  m.def("small_batch_linear", &small_batch_linear, "bf16 linear for a few tokens, weights in 16-feature slabs (CPU)");
  m.def("has_small_batch_linear", &has_small_batch_linear, "whether this build has small_batch_linear (AVX512_BF16)");
  m.def("set_one_token_prefetch", &set_one_token_prefetch,
        "whether one-token bf16 slab calls prefetch their weights in software (engine/cpu/prefetch_tuner.py chooses)");
  m.def("one_token_prefetch", &one_token_prefetch, "whether one-token bf16 slab calls prefetch in software");
  m.def("add_rms_norm", &add_rms_norm, "residual += x; x = rmsnorm(residual) * weight, in place (CPU)");
  m.def("rms_norm", &rms_norm, "rmsnorm(x) * weight (CPU)");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up from [T, 2I] gate|up (CPU)");
  m.def("rotary_store_kv", &rotary_store_kv, "rotary on q and k, k and v into the paged cache; returns q (CPU)");
  bind_decode_stack(m);
}
