// A decode step's decoder layers in one call from Python (engine/cpu/decode_stack.py).
//
// On the eager path a one-token step runs ~15 torch or kernel calls per layer from Python:
// for SmolLM2's 30 layers ~450 calls, whose interpreter and module dispatch cost about as much
// as the step's weight read (docs/cpu-kernels.md). Here the same kernels run in the same
// order, with the same arguments, from a C++ loop: the bits are the eager path's.
//
// Only what every layer of the plain decoder has: RMSNorm with the residual add, GQA
// attention with rotary fused into the KV store (and an optional per-head q/k RMSNorm, all
// in the KV cache's dtype, as engine/models/attention.py casts to it where it differs),
// the paged decode kernel, and a SiLU-gated MLP. The matmuls are whatever the model runner
// put in place: bf16 slabs (small_batch_linear.cpp), int8 panels (an op of the quantized
// kernels' module, reached through torch's dispatcher since it is another shared library), oneDNN-prepacked
// weights (mkldnn::_linear_pointwise, as PackedLinear calls it) or plain weights. A step with
// LoRA rows adds each row's adapter after the projections the pool adapts (lora_rows.h).
#include "lora_rows.h"
#include "work_pool.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

// fused_ops.cpp, paged_decode_attention.cpp, small_batch_linear.cpp
void add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps, int64_t lanes);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps, int64_t lanes);
torch::Tensor silu_and_mul(torch::Tensor gate_up, int64_t lanes);
torch::Tensor rotary_store_kv(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor slot_mapping,
                              torch::Tensor k_cache, torch::Tensor v_cache, int64_t num_heads, int64_t num_kv_heads);
torch::Tensor paged_decode_attention(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                     torch::Tensor block_tables, torch::Tensor seq_lens, double scale, int64_t window);
torch::Tensor small_batch_linear(torch::Tensor x, torch::Tensor slabs, torch::Tensor bias, bool out_fp32);

namespace {

// The kinds of matmul a layer's linears may be (engine/cpu/decode_stack.py's constants).
// kQuantized: an op of the quantized-kernels library, named by the layer, with the schema
// (Tensor x, Tensor weight, Tensor scales, Tensor bias, int out_features, bool out_fp32) -> Tensor.
enum class LinearKind : int64_t { kSlabs = 0, kQuantized = 1, kOneDnn = 2, kPlain = 3 };


struct Linear {
  LinearKind kind;
  torch::Tensor weight;  // slabs, int8 panels, oneDNN's opaque weight, or the plain [out, in] weight
  torch::Tensor scales;  // quantized: the panels' scales; else empty
  torch::Tensor bias;  // empty: none (each kind's own convention, as its Python module holds it)
  int64_t out_features;
  std::optional<c10::OperatorHandle> op;  // quantized and oneDNN: the dispatcher's handle, found once

  // x: [num_tokens, in_features] -> [num_tokens, out_features], as the Python module computes it.
  torch::Tensor forward(const torch::Tensor& x) const {
    switch (kind) {
      case LinearKind::kSlabs:
        return small_batch_linear(x, weight, bias, false);
      case LinearKind::kQuantized: {
        torch::jit::Stack stack{x, weight, scales, bias, out_features, false};
        op->callBoxed(&stack);
        return stack[0].toTensor();
      }
      case LinearKind::kOneDnn: {
        std::optional<torch::Tensor> b;
        if (bias.numel() > 0) b = bias;
        torch::jit::Stack stack{x.contiguous(), weight, b, std::string("none"),
                                c10::List<std::optional<at::Scalar>>(), std::optional<std::string>(std::string())};
        op->callBoxed(&stack);
        return stack[0].toTensor();
      }
      case LinearKind::kPlain:
        return bias.numel() > 0 ? at::linear(x, weight, bias) : at::linear(x, weight);
    }
    TORCH_CHECK(false, "unknown linear kind");
  }
};

struct Layer {
  torch::Tensor input_norm, post_norm;  // [hidden_size]
  torch::Tensor q_norm, k_norm;  // [head_dim], or empty: no per-head q/k norm
  Linear qkv, o_proj, gate_up, down;
  torch::Tensor k_cache, v_cache;  // [num_blocks, num_kv_heads, block_size, head_dim]
  double scale;
  int64_t window;  // 0: the whole context
  // The LoRA pool's tensors of each projection (set_lora); empty: not adapted.
  tokenloom_cpu::LoRAWeights qkv_lora{}, o_lora{}, gate_up_lora{}, down_lora{};
};

// What a profiled forward times, per layer (scripts/bench/gguf_decode_profile.py reads them).
enum Phase : int { kNorm, kQkv, kRotaryStore, kAttention, kOProj, kPostNorm, kGateUp, kSiluMul, kDown, kNumPhases };

// (kind, weight, scales, bias, out_features, the quantized op's name or "")
using LinearSpec = std::tuple<int64_t, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, std::string>;

// Whether the kind shares its work out through tokenloom_cpu::share_out (so on a WorkPool);
// oneDNN's and ATen's own matmuls would run on one thread inside the pool's region.
bool shares_out(LinearKind kind) { return kind == LinearKind::kSlabs || kind == LinearKind::kQuantized; }

}  // namespace

// The pool decode steps run their layers in (work_pool.h); the quantized kernels' library is
// handed its address (work_pool_address) so that its matmuls share out on it too.
tokenloom_cpu::WorkPool& decode_pool() {
  static tokenloom_cpu::WorkPool pool;
  tokenloom_cpu::work_pool_slot() = &pool;
  return pool;
}

int64_t work_pool_address() { return reinterpret_cast<int64_t>(&decode_pool()); }

class DecodeStack {
 public:
  DecodeStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, int64_t sum_lanes,
              int64_t silu_lanes, bool is_silu_exact)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), eps_(eps), sum_lanes_(sum_lanes),
        silu_lanes_(silu_lanes), is_silu_exact_(is_silu_exact) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_norm, torch::Tensor q_norm, torch::Tensor k_norm,
                 LinearSpec qkv, LinearSpec o_proj, LinearSpec gate_up, LinearSpec down, torch::Tensor k_cache,
                 torch::Tensor v_cache, double scale, int64_t window) {
    layers_.push_back(Layer{input_norm, post_norm, q_norm, k_norm, make_linear(qkv), make_linear(o_proj),
                            make_linear(gate_up), make_linear(down), k_cache, v_cache, scale, window});
    const Layer& layer = layers_.back();
    is_pooled_ = (layers_.size() == 1 || is_pooled_) && shares_out(layer.qkv.kind) && shares_out(layer.o_proj.kind) &&
                 shares_out(layer.gate_up.kind) && shares_out(layer.down.kind);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Profiling on: each forward adds every op's seconds to [num_layers, kNumPhases] (a clock read
  // between ops, a few ns each); off (the default) reads no clock. Returns the sums so far.
  void set_profiling(bool on) {
    is_profiling_ = on;
    phase_seconds_ = torch::zeros({num_layers(), kNumPhases}, torch::kFloat64);
  }
  torch::Tensor phase_seconds() const { return phase_seconds_.clone(); }
  // Layer `index`'s LoRA pool tensors, A [max_loras, P * R, in] and B [max_loras, P * R, out] of
  // qkv, o, gate_up and down (empty ones: that projection is not adapted), held by reference.
  void set_lora(int64_t index, torch::Tensor qkv_a, torch::Tensor qkv_b, torch::Tensor o_a, torch::Tensor o_b,
                torch::Tensor gate_up_a, torch::Tensor gate_up_b, torch::Tensor down_a, torch::Tensor down_b) {
    TORCH_CHECK(index >= 0 && index < num_layers(), "no layer ", index);
    Layer& layer = layers_[index];
    layer.qkv_lora = {qkv_a, qkv_b};
    layer.o_lora = {o_a, o_b};
    layer.gate_up_lora = {gate_up_a, gate_up_b};
    layer.down_lora = {down_a, down_b};
  }

  // Whether forward runs its layers in the work pool's region (every matmul shares out).
  bool is_pooled() const { return is_pooled_; }

  // The model's final RMSNorm (weight [hidden_size], the layers' eps): forward then ends with it,
  // in the same call, while the last layer's output is still in cache (a Python call after the
  // stack runs on the cache the weight stream left, several times slower than warm). Empty: none.
  void set_final_norm(torch::Tensor weight) { final_norm_ = weight; }
  bool has_final_norm() const { return final_norm_.numel() > 0; }

  // hidden: [num_seqs, hidden_size], the embeddings of a decode-only step (row i: sequence i);
  // cos, sin: [num_seqs, head_dim]; slot_mapping: [num_seqs] int64; block_tables:
  // [num_seqs, max_num_blocks] int32; seq_lens: [num_seqs] int32; lora_*: the step's rows grouped
  // by LoRA slot (LoRAGroups: slot, rows or empty for all, scale), none for a step of the base.
  // Returns (the last MLP's output, the residual stream before it is added), as
  // DecoderForCausalLM's layer loop does, or with a final norm set (the final hidden states, the
  // residual stream with that output added); `hidden` becomes the residual stream.
  std::vector<torch::Tensor> forward(torch::Tensor hidden, torch::Tensor cos, torch::Tensor sin,
                                     torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens,
                                     std::vector<int64_t> lora_slots, std::vector<torch::Tensor> lora_rows,
                                     std::vector<double> lora_scales) {
    TORCH_CHECK(!layers_.empty(), "no layers");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(0) == seq_lens.size(0), "one token per sequence");
    const tokenloom_cpu::LoRAGroups lora =
        tokenloom_cpu::make_lora_groups(std::move(lora_slots), std::move(lora_rows), std::move(lora_scales), hidden.size(0));
    torch::Tensor residual = hidden;
    torch::Tensor x;
    // Every layer on one OpenMP region, its kernels' work shared out on the pool, where every
    // matmul can share out; else each kernel on torch's threads, region by region.
    const auto run_layers = [&] {
      x = run_layers_from(hidden, residual, cos, sin, slot_mapping, block_tables, seq_lens, lora);
      if (has_final_norm()) add_rms_norm(x, residual, final_norm_, eps_, sum_lanes_);  // x, residual in place
    };
    if (is_pooled_) {
      decode_pool().run_region(at::get_num_threads(), run_layers);
    } else {
      run_layers();
    }
    return {x, residual};
  }

 private:
  torch::Tensor run_layers_from(const torch::Tensor& hidden, torch::Tensor& residual, const torch::Tensor& cos,
                                const torch::Tensor& sin, const torch::Tensor& slot_mapping,
                                const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                const tokenloom_cpu::LoRAGroups& lora) const {
    const int64_t num_tokens = hidden.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    using Clock = std::chrono::steady_clock;
    double* seconds = is_profiling_ ? phase_seconds_.data_ptr<double>() : nullptr;
    Clock::time_point last = seconds != nullptr ? Clock::now() : Clock::time_point();
    const auto mark = [&](size_t i, Phase phase) {  // the time since the last mark goes to `phase`
      if (seconds == nullptr) return;
      const Clock::time_point now = Clock::now();
      seconds[i * kNumPhases + phase] += std::chrono::duration<double>(now - last).count();
      last = now;
    };
    torch::Tensor x = rms_norm(hidden, layers_[0].input_norm, eps_, sum_lanes_);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      if (i > 0) add_rms_norm(x, residual, layer.input_norm, eps_, sum_lanes_);  // x, residual in place
      mark(i, kNorm);
      torch::Tensor qkv = layer.qkv.forward(x);  // [num_tokens, q_size + 2 * kv_size]
      tokenloom_cpu::add_lora(qkv, x, layer.qkv_lora, lora);
      const bool is_cast = qkv.scalar_type() != layer.k_cache.scalar_type();  // attention in the cache's dtype
      if (is_cast) qkv = qkv.to(layer.k_cache.scalar_type());
      mark(i, kQkv);
      if (layer.q_norm.numel() > 0) norm_qk_in_place(qkv, layer, num_tokens, q_size, kv_size);
      // [num_tokens, num_heads, head_dim]; k rotated in place, k and v in the cache
      torch::Tensor q = rotary_store_kv(qkv, cos, sin, slot_mapping, layer.k_cache, layer.v_cache, num_heads_,
                                        num_kv_heads_);
      mark(i, kRotaryStore);
      torch::Tensor out = paged_decode_attention(q, layer.k_cache, layer.v_cache, block_tables, seq_lens, layer.scale,
                                                 layer.window);  // [num_tokens, num_heads, head_dim]
      out = out.reshape({num_tokens, q_size});
      if (is_cast) out = out.to(hidden.scalar_type());
      mark(i, kAttention);
      torch::Tensor attn = layer.o_proj.forward(out);  // [num_tokens, hidden_size]
      tokenloom_cpu::add_lora(attn, out, layer.o_lora, lora);
      mark(i, kOProj);
      add_rms_norm(attn, residual, layer.post_norm, eps_, sum_lanes_);
      mark(i, kPostNorm);
      torch::Tensor gate_up = layer.gate_up.forward(attn);  // [num_tokens, 2 * intermediate_size]
      tokenloom_cpu::add_lora(gate_up, attn, layer.gate_up_lora, lora);
      mark(i, kGateUp);
      const torch::Tensor act = silu_mul(gate_up);  // [num_tokens, intermediate_size]
      mark(i, kSiluMul);
      x = layer.down.forward(act);  // [num_tokens, hidden_size]
      tokenloom_cpu::add_lora(x, act, layer.down_lora, lora);
      mark(i, kDown);
    }
    return x;
  }

  Linear make_linear(const LinearSpec& spec) const {
    const auto& [kind, weight, scales, bias, out_features, op_name] = spec;
    TORCH_CHECK(kind >= 0 && kind <= 3, "linear kind must be 0..3");
    Linear linear{static_cast<LinearKind>(kind), weight, scales, bias, out_features};
    auto& dispatcher = c10::Dispatcher::singleton();
    if (linear.kind == LinearKind::kQuantized) linear.op = dispatcher.findSchemaOrThrow(op_name.c_str(), "");
    if (linear.kind == LinearKind::kOneDnn) linear.op = dispatcher.findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    return linear;
  }

  // Attention's _norm_qk_in_place: each head's q and k normed over head_dim, written back into qkv.
  void norm_qk_in_place(torch::Tensor& qkv, const Layer& layer, int64_t num_tokens, int64_t q_size,
                        int64_t kv_size) const {
    auto q = qkv.slice(1, 0, q_size).view({num_tokens, num_heads_, head_dim_});
    auto k = qkv.slice(1, q_size, q_size + kv_size).view({num_tokens, num_kv_heads_, head_dim_});
    q.copy_(rms_norm(q.reshape({-1, head_dim_}), layer.q_norm, eps_, sum_lanes_).view(q.sizes()));
    k.copy_(rms_norm(k.reshape({-1, head_dim_}), layer.k_norm, eps_, sum_lanes_).view(k.sizes()));
  }

  // engine.cpu.fused.CpuFusedOps.silu_and_mul: torch's own op where the kernel cannot give its fp32 bits.
  torch::Tensor silu_mul(const torch::Tensor& gate_up) const {
    if (gate_up.scalar_type() == at::kFloat && !is_silu_exact_) {
      auto halves = gate_up.chunk(2, -1);
      return at::silu(halves[0]) * halves[1];
    }
    return silu_and_mul(gate_up, silu_lanes_);
  }

  int64_t num_heads_, num_kv_heads_, head_dim_;
  double eps_;
  int64_t sum_lanes_, silu_lanes_;
  bool is_silu_exact_;
  bool is_pooled_ = false;
  bool is_profiling_ = false;
  torch::Tensor phase_seconds_;  // [num_layers, kNumPhases] float64, while profiling
  torch::Tensor final_norm_;  // [hidden_size], or undefined: forward returns before the final norm
  std::vector<Layer> layers_;
};

void bind_decode_stack(pybind11::module& m) {
  m.def("work_pool_address", &work_pool_address, "the decode steps' work pool, for the quantized kernels' library");
  pybind11::class_<DecodeStack>(m, "DecodeStack", "a decode step's decoder layers in one call (CPU)")
      .def(pybind11::init<int64_t, int64_t, int64_t, double, int64_t, int64_t, bool>())
      .def("add_layer", &DecodeStack::add_layer)
      .def("num_layers", &DecodeStack::num_layers)
      .def("set_lora", &DecodeStack::set_lora)
      .def("is_pooled", &DecodeStack::is_pooled)
      .def("set_final_norm", &DecodeStack::set_final_norm)
      .def("has_final_norm", &DecodeStack::has_final_norm)
      .def("set_profiling", &DecodeStack::set_profiling)
      .def("phase_seconds", &DecodeStack::phase_seconds)
      .def("forward", &DecodeStack::forward, pybind11::arg("hidden"), pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("slot_mapping"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
           pybind11::arg("lora_slots") = std::vector<int64_t>(), pybind11::arg("lora_rows") = std::vector<torch::Tensor>(),
           pybind11::arg("lora_scales") = std::vector<double>(), pybind11::call_guard<pybind11::gil_scoped_release>());
}
