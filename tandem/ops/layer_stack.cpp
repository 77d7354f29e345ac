// The decoder stack of the Llama family and Gemma 3 in one native call: every layer of a step, from
// the first layer's norm to the last layer's MLP, without going back to Python between operators.
//
// At batch 1 a step of the default model (30 layers) is ~330 operator calls; through Python each
// costs its argument parsing, the dispatcher and an output allocation, which together were more
// than the linears' time. Here each layer calls the same kernels the PyTorch path calls (this
// file adds no arithmetic of its own), so the two paths agree to the bit, and the Python
// loop (tandem/model/llama.py) stays the reference and the fallback.
//
// The stack is built once, after loading, as a torch custom class holding the weights (no copies:
// the same tensors the modules hold). Each linear is one of the forms model/linear.py plans:
//   kDense   a [out, in] weight, at::linear
//   kPanels  a bf16 weight packed into small_batch_linear's panels, up to its rows; past them the
//            same weight packed for oneDNN (PackedLinear's two copies), mkldnn::_linear_pointwise
//   kGguf    ggml blocks as stored, gguf_linear or gguf_linear_q8 (up to max_rows rows)
//   kOnednn  a bf16 weight packed for oneDNN only (no bf16 dot-product instructions for the panels)
//   parts    a fused layer in several block formats (model/linear.py's gguf-split): kGguf parts side by side
// A step whose rows exceed a linear's max_rows, or that the kernels cannot serve, is left to the
// Python path by the caller (LayerStack.max_rows).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include "batch_invariant.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>
#include <vector>

namespace tandem_ops {

// group_reduce.cpp: a worker group's all-reduce over its shared-memory exchange.
at::Tensor group_all_reduce(const at::Tensor& t, int64_t base, int64_t rank, int64_t size, int64_t slot_bytes);

// The kernels of the other translation units (fused.cpp, kv_write.cpp, paged_attention.cpp,
// paged_prefill.cpp, linear.cpp).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& w,
                                                double eps);
void rotary_(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor silu_and_mul(const at::Tensor& x);
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
at::Tensor& paged_decode_attention_out(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                       const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale,
                                       int64_t window, double softcap, const std::optional<at::Tensor>& sinks,
                                       at::Tensor& out);
at::Tensor& paged_prefill_attention_out(const at::Tensor& q_in, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                        const at::Tensor& block_tables, const at::Tensor& query_start,
                                        const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                                        at::Tensor& out);
at::Tensor small_batch_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                              int64_t out_features);

namespace {

enum LinearKind : int64_t { kDense = 0, kPanels = 1, kGguf = 2, kGgufQ8 = 3, kOnednn = 4 };

using GgufOp = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, const std::optional<at::Tensor>&);

// PackedLinear's oneDNN product (torch.ops.mkldnn._linear_pointwise), boxed: its schema's list of
// optional scalars has no stable unboxed C++ type across torch versions.
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias ? c10::IValue(*bias) : c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::List<std::optional<c10::Scalar>>()), c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

c10::TypedOperatorHandle<GgufOp> gguf_op(bool int8_activations) {
  // The quantized kernels live in their own translation units' anonymous namespaces: reached
  // through the dispatcher (a lookup once, ~1 us a call).
  return c10::Dispatcher::singleton()
      .findSchemaOrThrow(int8_activations ? "tandem::gguf_linear_q8" : "tandem::gguf_linear", "")
      .typed<GgufOp>();
}

struct LinearW {
  int64_t kind = kDense;
  at::Tensor weight;  // dense [out, in], panels, or the blocks [out, row bytes]
  std::optional<at::Tensor> bias;
  int64_t out_features = 0, in_features = 0, qtype = 0;
  int64_t max_rows = std::numeric_limits<int64_t>::max();  // of this form (panels: of the panels)
  std::optional<at::Tensor> wide;  // kPanels: oneDNN's packed copy, for more rows than the panels'
  // A fused layer whose parts are in different block formats (a Q4_K_M file's q, k in Q4_K and v in
  // Q6_K): each part's output side by side, then the bias.
  std::vector<LinearW> parts;

  int64_t rows_served() const { return wide ? std::numeric_limits<int64_t>::max() : max_rows; }

  at::Tensor operator()(const at::Tensor& x) const {
    if (!parts.empty()) {
      std::vector<at::Tensor> outs;
      outs.reserve(parts.size());
      for (const LinearW& p : parts) outs.push_back(p(x));
      at::Tensor y = at::cat(outs, -1);
      return bias ? y.add_(*bias) : y;
    }
    switch (kind) {
      case kPanels:  // batch-invariant: the panels at any row count (oneDNN sums in another order)
        return x.size(0) <= max_rows || !wide || batch_invariant() ? small_batch_linear(x, weight, bias, out_features)
                                                                   : onednn_linear(x, *wide, bias);
      case kGguf:
      case kGgufQ8: {
        static const auto f = gguf_op(false), q8 = gguf_op(true);
        return (kind == kGgufQ8 ? q8 : f).call(x, weight, qtype, in_features, bias);
      }
      case kOnednn: return onednn_linear(x, weight, bias);
      default: return at::linear(x, weight, bias);
    }
  }
};

struct LayerW {
  at::Tensor input_norm, post_norm;
  std::optional<at::Tensor> q_norm, k_norm;  // Qwen3's and Gemma 3's per-head norms
  std::vector<LinearW> linears;               // qkv, o, gate_up, down
  int64_t window = 0;
  bool rotates = true;                        // false: a layer without RoPE (SmolLM3)
  // Gemma 3's sandwich: post_norm normalises the attention output, pre_ff_norm adds it to the
  // residual stream and normalises the MLP's input, post_ff_norm its output; local: the sliding
  // layers' own rotary table.
  std::optional<at::Tensor> pre_ff_norm, post_ff_norm;
  bool local = false;
  // OLMo 2's layout: no norm before attention or the MLP; post_norm normalises the attention output
  // and post_ff_norm the MLP's, each before its residual add; q/k norms over the whole projection.
  bool post_norms = false;
};

enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

std::optional<at::Tensor> given(const at::Tensor& t) {
  return t.defined() && t.numel() > 0 ? std::optional<at::Tensor>(t) : std::nullopt;
}

}  // namespace

class LayerStack : public torch::CustomClassHolder {
 public:
  // act: the MLP's activation (0 SwiGLU, 1 GeGLU with tanh-approximated GELU).
  LayerStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t act)
      : H_(num_heads), KVH_(num_kv_heads), D_(head_dim), eps_(eps), scale_(scale), act_(act) {
    TORCH_CHECK(H_ > 0 && KVH_ > 0 && H_ % KVH_ == 0 && D_ > 0, "LayerStack: bad head geometry");
    TORCH_CHECK(act == kSilu || act == kGeluTanh, "LayerStack: unknown activation ", act);
  }

  // Makes the last layer a Gemma 3 layer (see LayerW).
  void set_sandwich(const at::Tensor& pre_ff_norm, const at::Tensor& post_ff_norm, bool local) {
    TORCH_CHECK(!layers_.empty(), "LayerStack: add_layer first");
    LayerW& L = layers_.back();
    L.pre_ff_norm = pre_ff_norm.contiguous();
    L.post_ff_norm = post_ff_norm.contiguous();
    L.local = local;
  }

  // Makes the last layer an OLMo 2 layer (see LayerW; its input_norm is unused).
  void set_post_norms(const at::Tensor& post_ff_norm) {
    TORCH_CHECK(!layers_.empty(), "LayerStack: add_layer first");
    layers_.back().post_ff_norm = post_ff_norm.contiguous();
    layers_.back().post_norms = true;
  }

  // q_norm/k_norm: empty tensors when the family has none; rotates: false for a layer without RoPE.
  void add_layer(const at::Tensor& input_norm, const at::Tensor& post_norm, const at::Tensor& q_norm,
                 const at::Tensor& k_norm, int64_t window, bool rotates) {
    TORCH_CHECK(layers_.empty() || layers_.back().linears.size() == 4, "LayerStack: the previous layer lacks linears");
    layers_.push_back(
        LayerW{input_norm.contiguous(), post_norm.contiguous(), given(q_norm), given(k_norm), {}, window, rotates});
  }

  // The next linear as parts in different block formats (kinds kGguf or kGgufQ8; outs: each part's rows),
  // their outputs side by side, then bias (empty: none).
  void add_split_linear(const std::vector<int64_t>& kinds, const std::vector<at::Tensor>& weights,
                        const std::vector<int64_t>& outs, const std::vector<int64_t>& qtypes,
                        const std::vector<int64_t>& max_rows, const at::Tensor& bias, int64_t in_features) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "LayerStack: add_layer first");
    const size_t n = kinds.size();
    TORCH_CHECK(n > 0 && weights.size() == n && outs.size() == n && qtypes.size() == n && max_rows.size() == n,
                "LayerStack: add_split_linear's lists differ in length");
    LinearW l;
    l.bias = given(bias);
    l.in_features = in_features;
    for (size_t i = 0; i < n; ++i) {
      TORCH_CHECK(kinds[i] == kGguf || kinds[i] == kGgufQ8, "LayerStack: a split linear's parts are ggml blocks");
      LinearW p{kinds[i], weights[i], std::nullopt, outs[i], in_features, qtypes[i],
                max_rows[i] > 0 ? max_rows[i] : std::numeric_limits<int64_t>::max(), std::nullopt};
      l.out_features += outs[i];
      l.max_rows = std::min(l.max_rows, p.rows_served());
      l.parts.push_back(std::move(p));
    }
    max_rows_ = std::min(max_rows_, l.rows_served());
    layers_.back().linears.push_back(std::move(l));
  }

  // Every attention and MLP output scaled by it before the residual add (Granite's residual multiplier).
  void set_residual_scale(double scale) { residual_scale_ = scale; }

  // The next of the last layer's linears, in the order qkv, o, gate_up, down; bias: empty for none;
  // max_rows: the most rows this form serves (0: any); wide: kPanels' oneDNN copy (None: none).
  void add_linear(int64_t kind, const at::Tensor& weight, const at::Tensor& bias, int64_t out_features,
                  int64_t in_features, int64_t qtype, int64_t max_rows, const std::optional<at::Tensor>& wide) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() < 4, "LayerStack: add_layer first");
    TORCH_CHECK(kind >= kDense && kind <= kOnednn, "LayerStack: unknown linear kind ", kind);
    LinearW l{kind, weight, given(bias), out_features, in_features, qtype,
              max_rows > 0 ? max_rows : std::numeric_limits<int64_t>::max(),
              kind == kPanels ? wide : std::nullopt};
    max_rows_ = std::min(max_rows_, l.rows_served());
    layers_.back().linears.push_back(std::move(l));
  }

  // One shard of a worker group (tensor parallelism): o_proj's and down_proj's outputs are partial
  // sums, all-reduced over the group's shared-memory exchange (group_reduce.cpp) at base.
  void set_group(int64_t base, int64_t rank, int64_t size, int64_t slot_bytes) {
    TORCH_CHECK(base != 0 && size > 1 && 0 <= rank && rank < size && slot_bytes > 0, "LayerStack: bad group");
    group_base_ = base;
    group_rank_ = rank;
    group_size_ = size;
    group_slot_bytes_ = slot_bytes;
  }

  int64_t group_slot_bytes() const { return group_slot_bytes_; }
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  int64_t max_rows() const { return max_rows_; }

  // x: the embedded tokens [T, hidden]; cos/sin: the rotary rows of its positions (local_*: the
  // sliding layers' table, for layers marked local). kv_caches [layers, 2, blocks, block_size, KVH, D]. The first
  // num_decodes rows are single-token queries; the rest are the prefill kernel's (query_start over
  // them). sampled_only: the last layer continues with sampled_rows only (perhaps none), each
  // as one query over sampled_block_tables / sampled_seq_lens. Returns the last layer's output and
  // residual, not yet added (the final norm adds them).
  std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                                             const at::Tensor& local_cos, const at::Tensor& local_sin,
                                             const at::Tensor& kv_caches, const at::Tensor& slot_mapping,
                                             int64_t num_decodes, const at::Tensor& decode_block_tables,
                                             const at::Tensor& decode_seq_lens,
                                             const at::Tensor& prefill_block_tables,
                                             const at::Tensor& prefill_query_start,
                                             const at::Tensor& prefill_seq_lens, bool sampled_only,
                                             const at::Tensor& sampled_rows,
                                             const at::Tensor& sampled_block_tables,
                                             const at::Tensor& sampled_seq_lens) {
    TORCH_CHECK(!layers_.empty() && layers_.back().linears.size() == 4, "LayerStack: incomplete");
    TORCH_CHECK(kv_caches.dim() == 6 && kv_caches.size(0) == num_layers(), "LayerStack: kv_caches must be [",
                num_layers(), ", 2, blocks, block_size, KVH, D]");
    const int64_t T = x_in.size(0), q_size = H_ * D_, kv_size = KVH_ * D_;
    TORCH_CHECK(T <= max_rows_, "LayerStack: ", T, " rows, more than its linears serve (", max_rows_, ")");
    const int64_t num_prefills = prefill_seq_lens.size(0);
    at::Tensor x = x_in, residual;
    for (int64_t i = 0; i < num_layers(); ++i) {
      const LayerW& L = layers_[i];
      const bool last_sampled = sampled_only && i + 1 == num_layers();
      at::Tensor h;
      if (L.post_norms) {  // the previous output joins the stream, which attention reads unnormed
        if (i > 0) x = x + residual;
        residual = h = x;
      } else if (i == 0) {
        residual = x;
        h = rms_norm(x, L.input_norm, eps_);
      } else {
        std::tie(h, residual) = add_rms_norm(x, residual, L.input_norm, eps_);
      }
      const at::Tensor qkv = L.linears[0](h);
      at::Tensor q = qkv.narrow(1, 0, q_size).view({T, H_, D_});
      at::Tensor k = qkv.narrow(1, q_size, kv_size).view({T, KVH_, D_});
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({T, KVH_, D_});
      if (L.q_norm && L.k_norm && L.post_norms) {  // over the whole projection (OLMo 2)
        q = rms_norm(qkv.narrow(1, 0, q_size).contiguous(), *L.q_norm, eps_).view({T, H_, D_});
        k = rms_norm(qkv.narrow(1, q_size, kv_size).contiguous(), *L.k_norm, eps_).view({T, KVH_, D_});
      } else if (L.q_norm && L.k_norm) {
        q = rms_norm(q.reshape({-1, D_}), *L.q_norm, eps_).view({T, H_, D_});
        k = rms_norm(k.reshape({-1, D_}), *L.k_norm, eps_).view({T, KVH_, D_});
      }
      if (L.rotates) rotary_(q, k, L.local ? local_cos : cos, L.local ? local_sin : sin);
      at::Tensor k_cache = kv_caches[i][0], v_cache = kv_caches[i][1];
      write_kv(k, v, k_cache, v_cache, slot_mapping);
      at::Tensor attn;
      if (last_sampled) {
        const at::Tensor qs = q.index_select(0, sampled_rows);
        attn = at::empty(qs.sizes(), qs.options());
        paged_decode_attention_out(qs, k_cache, v_cache, sampled_block_tables, sampled_seq_lens, scale_, L.window,
                                   0.0, std::nullopt, attn);
        residual = residual.index_select(0, sampled_rows);
      } else {
        attn = at::empty({T, H_, D_}, q.options());
        if (num_decodes > 0) {
          at::Tensor out = attn.narrow(0, 0, num_decodes);
          paged_decode_attention_out(q.narrow(0, 0, num_decodes), k_cache, v_cache, decode_block_tables,
                                     decode_seq_lens, scale_, L.window, 0.0, std::nullopt, out);
        }
        if (num_prefills > 0) {
          at::Tensor out = attn.narrow(0, num_decodes, T - num_decodes);
          paged_prefill_attention_out(q.narrow(0, num_decodes, T - num_decodes), k_cache, v_cache,
                                      prefill_block_tables, prefill_query_start, prefill_seq_lens, scale_, L.window,
                                      0.0, out);
        }
      }
      const at::Tensor o = scaled(reduce(L.linears[1](attn.view({attn.size(0), q_size}))));
      if (L.post_norms) {
        residual = residual + rms_norm(o, L.post_norm, eps_);
        x = rms_norm(reduce(L.linears[3](activation(L.linears[2](residual)))), *L.post_ff_norm, eps_);
      } else if (L.pre_ff_norm) {
        std::tie(h, residual) = add_rms_norm(rms_norm(o, L.post_norm, eps_), residual, *L.pre_ff_norm, eps_);
        x = rms_norm(reduce(L.linears[3](activation(L.linears[2](h)))), *L.post_ff_norm, eps_);
      } else {
        std::tie(h, residual) = add_rms_norm(o, residual, L.post_norm, eps_);
        x = scaled(reduce(L.linears[3](activation(L.linears[2](h)))));
      }
    }
    return {x, residual};
  }

 private:
  at::Tensor reduce(const at::Tensor& partial) const {
    if (group_base_ == 0) return partial;
    return group_all_reduce(partial, group_base_, group_rank_, group_size_, group_slot_bytes_);
  }

  at::Tensor scaled(const at::Tensor& t) const { return residual_scale_ == 1.0 ? t : t * residual_scale_; }

  // GatedMLP's arithmetic, op for op.
  at::Tensor activation(const at::Tensor& gate_up) const {
    if (act_ == kSilu) return silu_and_mul(gate_up);
    const auto parts = gate_up.chunk(2, -1);
    return at::gelu(parts[0], "tanh") * parts[1];
  }

  int64_t H_, KVH_, D_;
  double eps_, scale_;
  double residual_scale_ = 1.0;
  int64_t act_;
  std::vector<LayerW> layers_;
  int64_t max_rows_ = std::numeric_limits<int64_t>::max();
  int64_t group_base_ = 0, group_rank_ = 0, group_size_ = 1, group_slot_bytes_ = 0;
};

}  // namespace tandem_ops

TORCH_LIBRARY_FRAGMENT(tandem, m) {
  m.class_<tandem_ops::LayerStack>("LayerStack")
      .def(torch::init<int64_t, int64_t, int64_t, double, double, int64_t>())
      .def("add_layer", &tandem_ops::LayerStack::add_layer)
      .def("set_sandwich", &tandem_ops::LayerStack::set_sandwich)
      .def("set_post_norms", &tandem_ops::LayerStack::set_post_norms)
      .def("add_linear", &tandem_ops::LayerStack::add_linear)
      .def("add_split_linear", &tandem_ops::LayerStack::add_split_linear)
      .def("set_group", &tandem_ops::LayerStack::set_group)
      .def("set_residual_scale", &tandem_ops::LayerStack::set_residual_scale)
      .def("group_slot_bytes", &tandem_ops::LayerStack::group_slot_bytes)
      .def("num_layers", &tandem_ops::LayerStack::num_layers)
      .def("max_rows", &tandem_ops::LayerStack::max_rows)
      .def("forward", &tandem_ops::LayerStack::forward);
}
