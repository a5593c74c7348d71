// The Llama-family decoder (see model.h).
#include "trainer/model/model.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <atomic>
#include <map>

#include "trainer/model/layers.h"
#include "trainer/model/model_size.h"
#include "trainer/model/row_kernels.h"
#include "trainer/util/torch_compat.h"

namespace trainer {

namespace F = torch::nn::functional;
using model_detail::apply_rope;
using model_detail::linear;
using model_detail::linear_fused;
using model_detail::norm_forward;

namespace {

// RMSNorm as one autograd node, wherever compat's fused norm is not used (the CPU; CUDA with
// LibTorch < 2.9; an input whose dtype differs from the weight's, as q/k norms under bf16). Per row
// of D values, in at least fp32: r = rsqrt(mean(x^2) + eps), xhat = x r, y = xhat w. Backward,
// from dy, with g = dy w:
//   dw = sum over rows of dy xhat
//   dx_i = r g_i + sum_j g_j x_j (d r / d x_i),   d r / d x_i = -r^3 x_i / D,
//        = r g_i - r xhat_i mean_j(g_j xhat_j) = r (g - xhat mean(g xhat))_i
// It keeps x and r (one value per row). On the CPU, for fp32 and fp64 with the weight's dtype, both
// directions are one pass over each row (row_kernels.cpp): on a host-bound step the ~4 forward and
// ~9 backward ATen kernels (each a dispatch, an allocation and a sweep) were ~7% of the step.
// Elsewhere (CUDA, bf16 inputs) they are ATen kernels, computing the same numbers as the composite
// (pow, mean, add, rsqrt, mul, mul), which kept x, r and xhat over six autograd nodes.
std::atomic<bool> cpu_row_kernels_enabled{true};  // cpu_row_kernels_set(), for tests

bool rms_norm_row_kernel_applies(const torch::Tensor& x, const torch::Tensor& weight) {
  return cpu_row_kernels_enabled && x.device().is_cpu() && x.scalar_type() == weight.scalar_type() &&
         (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kFloat64);
}

// How many contiguous row ranges for_each_row_chunk cuts rows of `dim` values into: one per
// intra-op thread, but at least 32K values each. It depends only on the shape and the thread
// count, so each chunk's partial sums are the same from run to run.
int64_t row_chunk_count(int64_t rows, int64_t dim) {
  return std::max<int64_t>(1, std::min<int64_t>({rows * dim >> 15, rows, at::get_num_threads()}));
}

// Runs fn(first_row, last_row, chunk) over row_chunk_count(rows, dim) contiguous row ranges on
// LibTorch's intra-op threads.
template <typename Fn>
void for_each_row_chunk(int64_t rows, int64_t dim, Fn fn) {
  const int64_t chunks = row_chunk_count(rows, dim);
  at::parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) fn(rows * c / chunks, rows * (c + 1) / chunks, c);
  });
}

class RmsNormFunction : public torch::autograd::Function<RmsNormFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps) {
    if (rms_norm_row_kernel_applies(x, weight)) {
      const auto xc = x.contiguous(), wc = weight.contiguous();  // (..., D), (D)
      const int64_t dim = xc.size(-1), rows = xc.numel() / std::max<int64_t>(dim, 1);
      auto y = torch::empty_like(xc);                                  // (..., D)
      auto rstd_shape = xc.sizes().vec();
      rstd_shape.back() = 1;
      auto rstd = torch::empty(rstd_shape, xc.options());  // (..., 1)
      AT_DISPATCH_FLOATING_TYPES(xc.scalar_type(), "rms_norm_rows_forward", [&] {
        const auto *xp = xc.data_ptr<scalar_t>(), *wp = wc.data_ptr<scalar_t>();
        auto *yp = y.data_ptr<scalar_t>(), *rp = rstd.data_ptr<scalar_t>();
        for_each_row_chunk(rows, dim, [&](int64_t first, int64_t last, int64_t) {
          model_detail::rms_norm_rows_forward(xp + first * dim, wp, last - first, dim, eps, yp + first * dim,
                                              rp + first);
        });
      });
      ctx->save_for_backward({xc, weight, rstd});
      return y;
    }
    const auto wide = x.to(at::promote_types(x.scalar_type(), torch::kFloat32));  // (..., D)
    const auto rstd = (wide * wide).mean(-1, /*keepdim=*/true).add_(eps).rsqrt_();  // (..., 1)
    ctx->save_for_backward({x, weight, rstd});
    return (wide * rstd * weight).to(x.scalar_type());
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1], &rstd = saved[2];
    if (rms_norm_row_kernel_applies(x, weight) && x.scalar_type() == rstd.scalar_type()) {
      const auto dy = grad_outputs[0].to(x.scalar_type()).contiguous();  // (..., D)
      const auto wc = weight.contiguous();
      const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(dim, 1);
      auto dx = torch::empty_like(x);  // (..., D)
      const bool want_dw = ctx->needs_input_grad(1);
      // One row of double partial sums per chunk, added in chunk order.
      const int64_t chunks = row_chunk_count(rows, dim);
      auto dw_parts = want_dw ? torch::zeros({chunks, dim}, x.options().dtype(torch::kFloat64))  // (C, D)
                              : torch::Tensor();
      AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rms_norm_rows_backward", [&] {
        const auto *xp = x.data_ptr<scalar_t>(), *wp = wc.data_ptr<scalar_t>(), *rp = rstd.data_ptr<scalar_t>(),
                   *dyp = dy.data_ptr<scalar_t>();
        auto* dxp = dx.data_ptr<scalar_t>();
        double* parts = want_dw ? dw_parts.data_ptr<double>() : nullptr;
        for_each_row_chunk(rows, dim, [&](int64_t first, int64_t last, int64_t c) {
          model_detail::rms_norm_rows_backward(xp + first * dim, wp, rp + first, dyp + first * dim, last - first, dim,
                                               dxp + first * dim, parts ? parts + c * dim : nullptr);
        });
      });
      torch::Tensor dw;
      if (want_dw) dw = (chunks == 1 ? dw_parts[0] : dw_parts.sum(0)).to(weight.scalar_type());
      return {ctx->needs_input_grad(0) ? dx : torch::Tensor(), dw, torch::Tensor()};
    }
    const auto wide = x.to(rstd.scalar_type());
    const auto dy = grad_outputs[0].to(rstd.scalar_type());  // (..., D)
    const auto xhat = wide * rstd;                            // (..., D)
    const auto g = dy * weight;                               // (..., D)
    const auto dx = (g - xhat * (g * xhat).mean(-1, /*keepdim=*/true)) * rstd;
    torch::Tensor dw;
    if (ctx->needs_input_grad(1)) dw = (dy * xhat).reshape({-1, x.size(-1)}).sum(0).to(weight.scalar_type());
    return {ctx->needs_input_grad(0) ? dx.to(x.scalar_type()) : torch::Tensor(), dw, torch::Tensor()};
  }
};

}  // namespace

void cpu_row_kernels_set(bool enabled) { cpu_row_kernels_enabled = enabled; }

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  if (x.scalar_type() == weight.scalar_type() && compat::fused_rms_norm(x.device()))
    return compat::rms_norm(x, weight, eps_);
  // At least fp32 (bf16 inputs are upcast; float64, used by gradient checks, is kept).
  return RmsNormFunction::apply(x, weight, eps_);
}

// torch::empty: allocated, never touched until drawn (model.h).
LinearImpl::LinearImpl(int64_t in, int64_t out) { weight = register_parameter("weight", torch::empty({out, in})); }

torch::Tensor LinearImpl::forward(const torch::Tensor& x) { return model_detail::linear_gemm(x, weight); }

EmbeddingImpl::EmbeddingImpl(int64_t vocab, int64_t dim) {
  weight = register_parameter("weight", torch::empty({vocab, dim}));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& tokens) { return F::embedding(tokens, weight); }

namespace model_detail {

Linear linear(int64_t in, int64_t out) { return Linear(in, out); }

// x: (B, H, L, hd). HF's rotate_half pairs dimension i with i + rotary_dim/2:
//   rope(x) = x * cos + rotate_half(x) * sin,  rotate_half(x) = (-x2, x1)  for x = (x1, x2).
// With the sign folded into the table, sin_signed = (-sin1, sin2), this is
//   rope(x) = x * cos + P(x) * sin_signed,   P(x) = (x2, x1), a roll by half, its own inverse,
// the same numbers (a negation is exact). RopeFunction computes it as one autograd node. The map
// is linear in x: out_i = x_i c_i + x_P(i) s_i, so the gradient of x_j collects g_j c_j from the
// first term and g_P(j) s_P(j) from the second (P(i) = j exactly when i = P(j)):
//   dx = g * cos + P(g * sin_signed).
// Three kernels each way (roll, mul, addcmul), where the composite recorded four nodes, ran four
// kernels each way and summed the two gradients reaching x. Nothing is kept but the tables. On the
// CPU (fp32 and fp64) each direction is one pass over each row instead (rope_rows,
// row_kernels.cpp): ATen's roll is a narrow and a cat. The gradient is written in the dimension
// order of x's strides, so that for the transposed views the attention passes (x is (B, L, H, hd)
// in memory) the view's backward needs no copy to return to (B, L, H * hd).
class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& cos,
                               const torch::Tensor& sin_signed) {
    ctx->save_for_backward({cos, sin_signed});
    if (rope_row_kernel_applies(x, cos, sin_signed)) {
      auto out = torch::empty(x.sizes(), x.options());  // (B, H, L, rot)
      rope_rows_run(x, cos, sin_signed, /*adjoint=*/false, out);
      // The order of x's dimensions in memory, outermost first, for the gradient's layout.
      auto order = std::vector<int64_t>{0, 1, 2, 3};
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x.stride(a) > x.stride(b); });
      ctx->saved_data["order"] = order;
      return out;
    }
    return x.roll(cos.size(-1) / 2, -1).mul_(sin_signed).addcmul_(x, cos);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &cos = saved[0], &sin_signed = saved[1];
    const auto& g = grad_outputs[0];  // (B, H, L, rot)
    if (ctx->saved_data.count("order") && rope_row_kernel_applies(g, cos, sin_signed)) {
      const auto order = ctx->saved_data["order"].toIntVector();
      std::vector<int64_t> sizes, inverse(4);
      for (size_t i = 0; i < order.size(); ++i) sizes.push_back(g.size(order[i])), inverse[order[i]] = i;
      auto dx = torch::empty(sizes, g.options()).permute(inverse);  // (B, H, L, rot) in x's memory order
      rope_rows_run(g, cos, sin_signed, /*adjoint=*/true, dx);
      return {dx, torch::Tensor(), torch::Tensor()};
    }
    return {(g * sin_signed).roll(cos.size(-1) / 2, -1).addcmul_(g, cos), torch::Tensor(), torch::Tensor()};
  }

 private:
  // CPU, fp32 or fp64 alike, 4-D, rows contiguous, tables (B or 1, 1, L or 1, rot) alike.
  static bool rope_row_kernel_applies(const torch::Tensor& x, const torch::Tensor& cos,
                                      const torch::Tensor& sin_signed) {
    const auto type = x.scalar_type();
    return cpu_row_kernels_enabled && x.device().is_cpu() && (type == torch::kFloat32 || type == torch::kFloat64) &&
           cos.scalar_type() == type && sin_signed.scalar_type() == type && x.dim() == 4 && cos.dim() == 4 &&
           x.stride(3) == 1 && cos.stride(3) == 1 && cos.strides() == sin_signed.strides() &&
           cos.sizes() == sin_signed.sizes() && cos.size(1) == 1 && cos.size(3) == x.size(3) &&
           (cos.size(0) == 1 || cos.size(0) == x.size(0)) && (cos.size(2) == 1 || cos.size(2) == x.size(2));
  }
  static model_detail::RowGrid row_grid(const torch::Tensor& t, at::IntArrayRef sizes) {
    model_detail::RowGrid grid{};
    for (int i = 0; i < 3; ++i) grid.sizes[i] = sizes[i], grid.strides[i] = t.size(i) == 1 ? 0 : t.stride(i);
    return grid;
  }
  static void rope_rows_run(const torch::Tensor& in, const torch::Tensor& cos, const torch::Tensor& sin_signed,
                            bool adjoint, torch::Tensor& out) {
    AT_DISPATCH_FLOATING_TYPES(in.scalar_type(), "rope_rows", [&] {
      model_detail::rope_rows(in.data_ptr<scalar_t>(), row_grid(in, in.sizes()), cos.data_ptr<scalar_t>(),
                              sin_signed.data_ptr<scalar_t>(), row_grid(cos, in.sizes()), in.size(3), adjoint,
                              out.data_ptr<scalar_t>(), row_grid(out, in.sizes()));
    });
  }
};

bool router_row_kernel_applies(const torch::Tensor& logits) {
  return cpu_row_kernels_enabled && logits.device().is_cpu() && logits.dim() == 2 &&
         (logits.scalar_type() == torch::kFloat32 || logits.scalar_type() == torch::kFloat64);
}

bool swiglu_row_kernel_applies(const torch::Tensor& gate_up) {
  return cpu_row_kernels_enabled && gate_up.device().is_cpu() && gate_up.is_contiguous() &&
         (gate_up.scalar_type() == torch::kFloat32 || gate_up.scalar_type() == torch::kBFloat16);
}

namespace {
uint16_t* bf16_bits(const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }
}  // namespace

void swiglu_rows_forward_into(const torch::Tensor& gate_up, torch::Tensor& h) {
  const int64_t F = h.size(-1), rows = h.numel() / std::max<int64_t>(F, 1);
  TORCH_CHECK(swiglu_row_kernel_applies(gate_up) && h.is_contiguous() && h.scalar_type() == gate_up.scalar_type() &&
                  gate_up.numel() == 2 * h.numel(),
              "swiglu_rows_forward_into: gate_up ", gate_up.sizes(), ", h ", h.sizes());
  if (gate_up.scalar_type() == torch::kFloat32)
    swiglu_rows_forward(gate_up.data_ptr<float>(), rows, F, h.data_ptr<float>());
  else
    swiglu_rows_forward(bf16_bits(gate_up), rows, F, bf16_bits(h));
}

void swiglu_rows_backward_into(const torch::Tensor& gate_up, const torch::Tensor& dh, torch::Tensor& dgate_up) {
  const int64_t F = dh.size(-1), rows = dh.numel() / std::max<int64_t>(F, 1);
  TORCH_CHECK(swiglu_row_kernel_applies(gate_up) && dh.is_contiguous() && dgate_up.is_contiguous() &&
                  dh.scalar_type() == gate_up.scalar_type() && dgate_up.scalar_type() == gate_up.scalar_type() &&
                  gate_up.numel() == 2 * dh.numel() && dgate_up.numel() == gate_up.numel(),
              "swiglu_rows_backward_into: gate_up ", gate_up.sizes(), ", dh ", dh.sizes());
  if (gate_up.scalar_type() == torch::kFloat32)
    swiglu_rows_backward(gate_up.data_ptr<float>(), dh.data_ptr<float>(), rows, F, dgate_up.data_ptr<float>());
  else
    swiglu_rows_backward(bf16_bits(gate_up), bf16_bits(dh), rows, F, bf16_bits(dgate_up));
}

void swiglu_backward_out(torch::Tensor dg, torch::Tensor du, const torch::Tensor& dh, const torch::Tensor& g,
                         const torch::Tensor& u, const torch::Tensor& silu_g) {
  at::silu_backward_out(dg, dh * u, g);
  at::mul_out(du, dh, silu_g);
}

// Rotates the first rotary_dim dimensions and passes the rest through.
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed) {
  const auto rotary_dim = cos.size(-1);
  if (rotary_dim == x.size(-1)) return RopeFunction::apply(x, cos, sin_signed);
  return torch::cat({RopeFunction::apply(x.narrow(-1, 0, rotary_dim), cos, sin_signed),
                     x.narrow(-1, rotary_dim, x.size(-1) - rotary_dim)},
                    -1);
}

// One GEMM for several projections of the same input: their weights (each (out_i, D)) are
// concatenated along the output dimension per forward. The copy is of weights only, small next to
// the activations; it saves a GEMM per extra projection forward, two backward, and the
// accumulation of their input gradients. Returns the (..., sum out_i) output. Callers take the
// projections apart with split_with_sizes, not narrow: split's backward concatenates the pieces'
// gradients in one pass, where each narrow's backward zero-fills a full-width gradient and
// autograd adds them (3% of an isolated fused layer's forward + backward on the CPU; within
// noise in a whole step, docs/benchmarks.md "Against the PyTorch peer").
torch::Tensor linear_fused(const torch::Tensor& x, std::initializer_list<torch::Tensor> weights) {
  return linear_gemm(x, torch::cat(weights));
}

namespace {

// x W^T in bf16 on a CPU whose LibTorch sums bf16 products in bf16 (compat::cpu_bf16_gemm_via_fp32):
// the bf16 operands multiplied and summed in fp32, the result rounded to bf16 once, as autocast's
// bf16 F::linear on a GPU computes. Backward, from dy (bf16), the same way:
//   dx = round(dy W),   dW = round(dy^T x)   (over all leading dimensions of x)
// Takes and keeps bf16 x and W (the casts are autograd's nodes before it, as under autocast).
class Fp32SummedLinear : public torch::autograd::Function<Fp32SummedLinear> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x, const torch::Tensor& weight) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);  // fp32 GEMMs stay fp32
    ctx->save_for_backward({x, weight});                                               // (..., in), (out, in) bf16
    return F::linear(x.to(torch::kFloat32), weight.to(torch::kFloat32)).to(torch::kBFloat16);  // (..., out)
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    const auto dy = grad_outputs[0].to(torch::kBFloat16).to(torch::kFloat32);  // (..., out)
    torch::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = dy.matmul(weight.to(torch::kFloat32)).to(torch::kBFloat16);
    if (ctx->needs_input_grad(1)) {
      const auto rows = dy.reshape({-1, dy.size(-1)}), inputs = x.reshape({-1, x.size(-1)});  // (N, out), (N, in)
      dw = rows.t().mm(inputs.to(torch::kFloat32)).to(torch::kBFloat16);                      // (out, in)
    }
    return {dx, dw};
  }
};

}  // namespace

torch::Tensor linear_gemm(const torch::Tensor& x, const torch::Tensor& weight) {
  if (x.is_cpu() && compat::cpu_bf16_gemm_via_fp32()) {
    if (compat::autocast_is_enabled(false)) {
      // What autocast's F::linear would do: cast fp32 (and, 1.13, fp16) operands to bf16 through
      // its cache (a weight used twice in one forward is cast once), leave fp64 alone.
      const auto x16 = at::autocast::cached_cast(at::kBFloat16, x, c10::DeviceType::CPU);
      const auto w16 = at::autocast::cached_cast(at::kBFloat16, weight, c10::DeviceType::CPU);
      if (x16.scalar_type() == at::kBFloat16 && w16.scalar_type() == at::kBFloat16) return Fp32SummedLinear::apply(x16, w16);
    } else if (x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16) {
      return Fp32SummedLinear::apply(x, weight);
    }
  }
  return F::linear(x, weight);
}

RopeTables rope_tables(const torch::Tensor& positions, const torch::Tensor& inv_freq, double scale) {
  const auto angles = (positions.to(torch::kFloat32).unsqueeze(-1) * inv_freq).unsqueeze(1);  // (B, 1, L, rot/2)
  auto cos = angles.cos(), sin = angles.sin();
  if (scale != 1.0) cos.mul_(scale), sin.mul_(scale);  // fp32, as transformers' cos() * attention_scaling
  return {torch::cat({cos, cos}, -1), torch::cat({-sin, sin}, -1)};  // (B, 1, L, rot) each
}

}  // namespace model_detail

namespace {

// The function a Recompute node reruns (or, with keep_graph, whose graph it keeps), the autocast
// state it first ran under, and the unit hooks (UnitHooks).
struct RecomputeClosure : torch::CustomClassHolder {
  RecomputeFn fn;
  bool autocast = false, cuda = false;
  UnitHooks hooks;
  // keep_graph (hooks.rerun == false): fn's inputs (detached leaves) and outputs, recorded in forward.
  std::vector<torch::Tensor> kept_inputs, kept_outputs;
};

// The custom autograd node behind recompute() and run_unit(): forward keeps only the inputs (and
// the closure); backward reruns the closure with recording on, then backpropagates the incoming
// gradients through the rerun. That inner backward is reentrant: the engine runs it inside this
// node's backward, and it accumulates parameter gradients into .grad like any other. With
// rerun=false forward records fn on detached copies of its inputs and backward goes through that
// graph, so the node only marks where a unit's backward begins and ends.
class Recompute : public torch::autograd::Function<Recompute> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<RecomputeClosure> closure, at::TensorList inputs) {
    if (closure->hooks.before_run) closure->hooks.before_run(/*backward=*/false);
    std::vector<torch::Tensor> outputs;
    if (closure->hooks.rerun) {
      ctx->save_for_backward(inputs.vec());
      compat::AutocastCacheOffGuard uncached;  // each weight's bf16 cast lives while the layer runs
      outputs = closure->fn(inputs.vec());  // grad mode is off inside forward: nothing recorded
    } else {
      for (const auto& input : inputs) closure->kept_inputs.push_back(input.detach().requires_grad_(input.requires_grad()));
      torch::AutoGradMode record(true);
      closure->kept_outputs = closure->fn(closure->kept_inputs);
      for (const auto& output : closure->kept_outputs) outputs.push_back(output.detach());
    }
    ctx->saved_data["closure"] = c10::IValue::make_capsule(std::move(closure));
    return outputs;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto closure = c10::static_intrusive_pointer_cast<RecomputeClosure>(ctx->saved_data["closure"].toCapsule());
    std::vector<torch::Tensor> inputs, outputs;
    if (closure->hooks.rerun) {
      for (const auto& saved : ctx->get_saved_variables())
        inputs.push_back(saved.detach().requires_grad_(saved.requires_grad()));
      if (closure->hooks.before_run) closure->hooks.before_run(/*backward=*/true);
      torch::AutoGradMode record(true);
      compat::AutocastGuard autocast(closure->autocast, closure->cuda);
      outputs = closure->fn(inputs);
    } else {
      inputs = std::move(closure->kept_inputs);
      outputs = std::move(closure->kept_outputs);
    }
    std::vector<torch::Tensor> roots, grads;
    for (size_t i = 0; i < outputs.size(); ++i)
      if (grad_outputs[i].defined() && outputs[i].requires_grad()) roots.push_back(outputs[i]), grads.push_back(grad_outputs[i]);
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    outputs.clear();  // the unit's graph is released before its hook runs
    if (closure->hooks.after_backward) closure->hooks.after_backward();
    torch::autograd::variable_list input_grads = {torch::Tensor()};  // the closure argument
    for (const auto& input : inputs) input_grads.push_back(input.requires_grad() ? input.grad() : torch::Tensor());
    return input_grads;
  }
};

}  // namespace

namespace model_detail {

// RMSNorm, recomputed in backward under remat_policy=minimal: its fp32 intermediates (the
// upcast input, squares, rsqrt, normalized value) are not kept.
torch::Tensor norm_forward(RMSNorm& norm, const torch::Tensor& x, bool recompute_elementwise) {
  if (!recompute_elementwise) return norm(x);
  return recompute(
      [norm](const std::vector<torch::Tensor>& in) mutable { return std::vector<torch::Tensor>{norm->forward(in[0])}; },
      {x})[0];
}

}  // namespace model_detail

std::vector<torch::Tensor> run_unit(const RecomputeFn& fn, const std::vector<torch::Tensor>& inputs, UnitHooks hooks) {
  const bool recording = torch::GradMode::is_enabled() &&
                         std::any_of(inputs.begin(), inputs.end(), [](const torch::Tensor& t) { return t.requires_grad(); });
  if (!recording) {
    if (hooks.before_run) hooks.before_run(/*backward=*/false);
    return fn(inputs);
  }
  auto closure = c10::make_intrusive<RecomputeClosure>();
  closure->fn = fn;
  closure->cuda = !inputs.empty() && inputs[0].is_cuda();
  closure->autocast = compat::autocast_is_enabled(closure->cuda);
  closure->hooks = std::move(hooks);
  return Recompute::apply(std::move(closure), at::TensorList(inputs));
}

std::vector<torch::Tensor> recompute(const RecomputeFn& fn, const std::vector<torch::Tensor>& inputs) {
  return run_unit(fn, inputs, {});
}

AttentionImpl::AttentionImpl(const Config& c)
    : num_heads_(c.base_num_query_heads), num_kv_heads_(c.base_num_kv_heads), head_dim_(c.head_dim) {
  q_proj = register_module("q_proj", linear(c.base_emb_dim, num_heads_ * head_dim_));
  k_proj = register_module("k_proj", linear(c.base_emb_dim, num_kv_heads_ * head_dim_));
  v_proj = register_module("v_proj", linear(c.base_emb_dim, num_kv_heads_ * head_dim_));
  o_proj = register_module("o_proj", linear(num_heads_ * head_dim_, c.base_emb_dim));
  if (c.use_qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(head_dim_, c.normalization_layer_epsilon));
    k_norm = register_module("k_norm", RMSNorm(head_dim_, c.normalization_layer_epsilon));
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& allowed,
                                     bool recompute_norms) {
  const auto B = x.size(0), L = x.size(1);
  const auto q_dim = num_heads_ * head_dim_, kv_dim = num_kv_heads_ * head_dim_;
  const auto qkv = linear_fused(x, {q_proj->weight, k_proj->weight, v_proj->weight})  // (B, L, q_dim + 2 kv_dim)
                       .split_with_sizes({q_dim + kv_dim, kv_dim}, -1);
  auto v = qkv[1].view({B, L, num_kv_heads_, head_dim_}).transpose(1, 2);  // (B, Hkv, L, hd)
  // Under bf16 autocast q and k are bf16: the fp32 tables are cast once per layer.
  const auto cos = rope.cos.to(qkv[0].scalar_type()), sin_signed = rope.sin_signed.to(qkv[0].scalar_type());
  torch::Tensor q, k;
  if (!q_norm) {
    // q and k are adjacent heads of the GEMM's output: RoPE rotates all Hq + Hkv heads in one pass
    // (one set of elementwise kernels per layer instead of two), then they are split by head.
    const auto qk = apply_rope(qkv[0].view({B, L, num_heads_ + num_kv_heads_, head_dim_}).transpose(1, 2), cos,
                               sin_signed)  // (B, Hq + Hkv, L, hd)
                        .split_with_sizes({num_heads_, num_kv_heads_}, 1);
    q = qk[0], k = qk[1];  // (B, Hq, L, hd), (B, Hkv, L, hd)
  } else {
    const auto parts = qkv[0].split_with_sizes({q_dim, kv_dim}, -1);
    q = norm_forward(q_norm, parts[0].view({B, L, num_heads_, head_dim_}), recompute_norms);     // (B, L, Hq, hd)
    k = norm_forward(k_norm, parts[1].view({B, L, num_kv_heads_, head_dim_}), recompute_norms);  // (B, L, Hkv, hd)
    q = apply_rope(q.transpose(1, 2), cos, sin_signed);  // (B, Hq, L, hd)
    k = apply_rope(k.transpose(1, 2), cos, sin_signed);  // (B, Hkv, L, hd)
  }
  // Query head h reads kv head h / (Hq / Hkv) (HF repeat_kv); repeated only where the kernel needs it.
  const auto out = model_detail::causal_attention(q, k, v, allowed);  // (B, Hq, L, hd)
  return o_proj(out.transpose(1, 2).reshape({B, L, num_heads_ * head_dim_}));
}

MlpImpl::MlpImpl(int64_t dim, int64_t hidden) {
  gate_proj = register_module("gate_proj", linear(dim, hidden));
  up_proj = register_module("up_proj", linear(dim, hidden));
  down_proj = register_module("down_proj", linear(hidden, dim));
}

namespace {

// SwiGLU on the fused gate/up GEMM output as one autograd node: h = silu(g) * u for
// gate_up = [g | u] (.., 2F). Backward (swiglu_backward_out) recomputes silu(g) and writes dg and du
// into the two halves of one (.., 2F) gradient. Keeps gate_up only: the composite
// (split, silu, mul) also kept silu(g), (.., F) per layer, and ran the same four backward kernels
// plus a cat of the halves' gradients, over three autograd nodes.
class SwiGLUFunction : public torch::autograd::Function<SwiGLUFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& gate_up) {
    const int64_t F = gate_up.size(-1) / 2;
    ctx->save_for_backward({gate_up});
    if (model_detail::swiglu_row_kernel_applies(gate_up)) {
      auto sizes = gate_up.sizes().vec();
      sizes.back() = F;
      auto h = torch::empty(sizes, gate_up.options());  // (.., F)
      model_detail::swiglu_rows_forward_into(gate_up, h);
      return h;
    }
    return torch::silu(gate_up.narrow(-1, 0, F)).mul_(gate_up.narrow(-1, F, F));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto gate_up = ctx->get_saved_variables()[0];
    const int64_t F = gate_up.size(-1) / 2;
    const auto g = gate_up.narrow(-1, 0, F), u = gate_up.narrow(-1, F, F);
    const auto dh = grad_outputs[0].to(gate_up.scalar_type());
    auto grad = torch::empty(gate_up.sizes(), gate_up.options());  // (.., 2F): [dg | du]
    if (model_detail::swiglu_row_kernel_applies(gate_up)) {
      model_detail::swiglu_rows_backward_into(gate_up, dh.contiguous(), grad);
      return {grad};
    }
    model_detail::swiglu_backward_out(grad.narrow(-1, 0, F), grad.narrow(-1, F, F), dh, g, u, torch::silu(g));
    return {grad};
  }
};

}  // namespace

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  // The node keeps gate_up only, which is also all that remat_policy=minimal would keep of it: so
  // that policy runs the same node, with no rerun and the same numbers as `none`.
  const auto gate_up = linear_fused(x, {gate_proj->weight, up_proj->weight});  // (B, L, 2F)
  return down_proj(SwiGLUFunction::apply(gate_up));
}

DecoderLayerImpl::DecoderLayerImpl(const Config& c, bool use_moe, int64_t layer_index) {
  input_layernorm = register_module("input_layernorm", RMSNorm(c.base_emb_dim, c.normalization_layer_epsilon));
  const std::string attention = model_layer_attention(c, layer_index);
  if (attention == "mla")
    mla_attn = register_module("self_attn", MlaAttention(c));
  else if (attention == "gla")
    gla_attn = register_module("self_attn", GlaAttention(c, layer_index));
  else
    self_attn = register_module("self_attn", Attention(c));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.base_emb_dim, c.normalization_layer_epsilon));
  if (use_moe)
    moe = register_module("mlp", Moe(c));
  else
    mlp = register_module("mlp", Mlp(c.base_emb_dim, c.base_mlp_dim));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const BlockContext& ctx) {
  const bool minimal = ctx.recompute_elementwise;
  const auto normed_in = norm_forward(input_layernorm, x, minimal);
  const auto h = x + (mla_attn   ? mla_attn->forward(normed_in, ctx.rope_mla, ctx.allowed)
                      : gla_attn ? gla_attn->forward(normed_in, ctx.rope, ctx.segment_ids)
                                 : self_attn->forward(normed_in, ctx.rope, ctx.allowed, minimal));
  const auto normed = norm_forward(post_attention_layernorm, h, minimal);
  return h + (moe ? moe->forward(normed, ctx) : mlp->forward(normed));
}

SharedHeadImpl::SharedHeadImpl(int64_t dim, double eps) {
  norm = register_module("norm", RMSNorm(dim, eps));
}

MtpLayerImpl::MtpLayerImpl(const Config& c, int64_t depth)
    : DecoderLayerImpl(c, /*use_moe=*/c.mtp_moe_mlp, c.base_num_decoder_layers + depth - 1) {
  enorm = register_module("enorm", RMSNorm(c.base_emb_dim, c.normalization_layer_epsilon));
  hnorm = register_module("hnorm", RMSNorm(c.base_emb_dim, c.normalization_layer_epsilon));
  eh_proj = register_module("eh_proj", linear(2 * c.base_emb_dim, c.base_emb_dim));
  shared_head = register_module("shared_head", SharedHead(c.base_emb_dim, c.normalization_layer_epsilon));
}

torch::Tensor MtpLayerImpl::forward_depth(const torch::Tensor& previous, const torch::Tensor& shifted_embeddings,
                                          const BlockContext& ctx) {
  const auto combined = torch::cat({enorm(shifted_embeddings), hnorm(previous)}, -1);  // (B, L, 2D)
  return DecoderLayerImpl::forward(eh_proj(combined), ctx);
}

DecoderStackImpl::DecoderStackImpl(const Config& c)
    : num_decoder_layers(c.base_num_decoder_layers),
      rotary_dim_(static_cast<int64_t>(std::llround(c.partial_rotary_factor * static_cast<double>(c.head_dim)))),
      rope_theta_(c.rope_max_timescale) {
  remat_policy = c.remat_policy;
  embed_tokens = register_module("embed_tokens", Embedding(c.vocab_size, c.base_emb_dim));
  layers = register_module("layers", torch::nn::ModuleList());
  const bool moe_model = c.num_experts > 1;
  for (int64_t i = 0; i < c.base_num_decoder_layers; ++i)
    layers->push_back(DecoderLayer(c, moe_model && i >= c.first_num_dense_layers, i));
  for (int64_t k = 1; k <= c.mtp_num_layers; ++k) layers->push_back(MtpLayer(c, k));
  norm = register_module("norm", RMSNorm(c.base_emb_dim, c.normalization_layer_epsilon));
  if (c.rope_type == "llama3") scaled_inv_freq_ = model_llama3_rope_inverse_frequencies(c);
  if (c.attention_type == "mla") {
    mla_inv_freq_ = model_mla_rope_inverse_frequencies(c);
    mla_rope_scale_ = config_rope_attention_factor(c);
  } else if (c.rope_type == "yarn") {  // global layers only: config validation refuses it with GLA layers
    scaled_inv_freq_ = model_yarn_rope_inverse_frequencies(c, rotary_dim_);
    global_rope_scale_ = config_rope_attention_factor(c);
  }
}

// Llama 3.1's RoPE scaling (transformers' rope_type "llama3", MaxText's "llama3.1") over the
// rotary dims d: with f_i = theta^(-2i/d), wavelength w_i = 2 pi / f_i and the original context L0,
//   w_i < L0 / high_freq_factor:  f_i kept (turns many times over L0: local order),
//   w_i > L0 / low_freq_factor:   f_i / factor (long wavelengths stretched to the longer context),
//   between:  (1 - s) f_i / factor + s f_i,  s = (L0 / w_i - low) / (high - low),
// s running from 0 at the low-frequency end to 1 at the high one, so the rule is continuous.
std::vector<double> model_llama3_rope_inverse_frequencies(const Config& c) {
  const int64_t d = std::llround(c.partial_rotary_factor * static_cast<double>(c.head_dim)), half = d / 2;
  const double L0 = static_cast<double>(c.original_max_position_embeddings);
  const double low = c.rope_low_freq_factor, high = c.rope_high_freq_factor;
  std::vector<double> freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const double f = std::pow(c.rope_max_timescale, -2.0 * static_cast<double>(i) / static_cast<double>(d));
    const double wavelength = 2 * M_PI / f;
    if (wavelength < L0 / high) {
      freq[i] = f;
    } else if (wavelength > L0 / low) {
      freq[i] = f / c.rope_factor;
    } else {
      const double s = (L0 / wavelength - low) / (high - low);
      freq[i] = (1 - s) * f / c.rope_factor + s * f;
    }
  }
  return freq;
}

// Host frequencies as an fp32 tensor on `device`, copied once and then cached: no copy on the step's path.
static const torch::Tensor& rope_frequencies_on(const std::vector<double>& freq, torch::Tensor& cache,
                                                const torch::Device& device) {
  if (!cache.defined() || cache.device() != device)
    cache = torch::tensor(freq, torch::TensorOptions().dtype(torch::kFloat64)).to(torch::kFloat32).to(device);
  return cache;
}

// YaRN's RoPE frequencies over d rotary dims (DeepSeek-V3's, as MaxText and transformers compute
// them): f_i = theta^(-2i/d), i < d/2, blended with itself / rope_factor:
//   f_i' = f_i * (1 - r_i) + f_i / factor * r_i,  r_i = clamp((i - low) / (high - low), 0, 1),
// where low = floor(c(beta_fast)), high = ceil(c(beta_slow)) clamped to [0, d - 1] (no floor /
// ceil with rope_truncate=false) and c(r) = d ln(L0 / (2 pi r)) / (2 ln theta) is the dim that
// turns r times over the original context L0: fast-turning dims (i < low) are kept, slow ones
// (i > high) interpolated by factor.
std::vector<double> model_yarn_rope_inverse_frequencies(const Config& c, int64_t d) {
  const int64_t half = d / 2;
  const double theta = c.rope_max_timescale;
  std::vector<double> freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) freq[i] = std::pow(theta, -2.0 * static_cast<double>(i) / static_cast<double>(d));
  const auto correction_dim = [&](double rotations) {
    return static_cast<double>(d) * std::log(static_cast<double>(c.original_max_position_embeddings) / (rotations * 2 * M_PI)) /
           (2 * std::log(theta));
  };
  double low = correction_dim(c.beta_fast), high = correction_dim(c.beta_slow);
  if (c.rope_truncate) low = std::floor(low), high = std::ceil(high);
  low = std::max(low, 0.0);
  high = std::min(high, static_cast<double>(d - 1));
  if (high == low) high += 0.001;
  for (int64_t i = 0; i < half; ++i) {
    const double ramp = std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0);
    freq[i] = freq[i] * (1.0 - ramp) + freq[i] / c.rope_factor * ramp;
  }
  return freq;
}

// MLA's RoPE frequencies over qk_rope_head_dim = d dims: theta^(-2i/d), or YaRN's (rope_type=yarn).
std::vector<double> model_mla_rope_inverse_frequencies(const Config& c) {
  const int64_t d = c.qk_rope_head_dim;
  if (c.rope_type == "yarn") return model_yarn_rope_inverse_frequencies(c, d);
  std::vector<double> freq(static_cast<size_t>(d / 2));
  for (int64_t i = 0; i < d / 2; ++i)
    freq[i] = std::pow(c.rope_max_timescale, -2.0 * static_cast<double>(i) / static_cast<double>(d));
  return freq;
}

BlockContext DecoderStackImpl::context(const torch::Tensor& positions, const torch::Tensor& segment_ids,
                                       bool one_segment_per_row) const {
  const auto L = positions.size(1);
  // RoPE in fp32: inv_freq_i = theta^(-2i/rotary_dim) (or rope_type=llama3's / yarn's), angle =
  // position * inv_freq. The frequencies are made once per device (the unscaled ones by the same
  // fp32 ops as before they were cached, so no bit moves).
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(positions.device());
  if (!scaled_inv_freq_.empty())
    rope_frequencies_on(scaled_inv_freq_, global_inv_freq_device_, positions.device());
  else if (!global_inv_freq_device_.defined() || global_inv_freq_device_.device() != positions.device())
    global_inv_freq_device_ = torch::pow(rope_theta_, -torch::arange(0, rotary_dim_, 2, opts) / static_cast<double>(rotary_dim_));
  BlockContext ctx;
  ctx.rope = model_detail::rope_tables(positions, global_inv_freq_device_, global_rope_scale_);
  if (!mla_inv_freq_.empty())
    ctx.rope_mla = model_detail::rope_tables(positions, rope_frequencies_on(mla_inv_freq_, mla_inv_freq_device_, positions.device()),
                                             mla_rope_scale_);
  ctx.recompute_elementwise = remat_policy == "minimal" && torch::GradMode::is_enabled();
  ctx.valid = segment_ids != 0;
  if (!one_segment_per_row) ctx.segment_ids = segment_ids;
  if (one_segment_per_row) return ctx;  // plain causal: no mask (ctx.allowed undefined)
  // Query i may attend key j when j <= i and both are in the same segment (packed documents).
  const auto causal = torch::ones({L, L}, opts.dtype(torch::kBool)).tril();
  const auto same_segment = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1);  // (B, L, L)
  ctx.allowed = (same_segment & causal).unsqueeze(1);  // (B, 1, L, L)
  return ctx;
}

torch::Tensor DecoderStackImpl::forward(const torch::Tensor& embeddings, const BlockContext& ctx) {
  auto x = embeddings;
  for (int64_t i = 0; i < num_decoder_layers; ++i) {
    auto layer = layers[i]->as<DecoderLayerImpl>();
    if (remat_policy != "full" && !layer_hooks) {
      x = layer->forward(x, ctx);
      continue;
    }
    // remat_policy=full: only the block's input is kept; a MoE block's statistics come back as
    // outputs of the recomputed function (load balance, router z, counts, score std), so the rerun in
    // backward does not append them a second time. A sharded layer (layer_hooks) is the same unit,
    // with its gather before each run and its gradient reduction after its backward.
    BlockContext block_ctx = ctx;
    const auto block = [layer, block_ctx](const std::vector<torch::Tensor>& in) {
      std::vector<MoeLayerStats> stats;
      BlockContext local = block_ctx;
      local.moe_stats = &stats;
      std::vector<torch::Tensor> out = {layer->forward(in[0], local)};
      for (const auto& s : stats) out.insert(out.end(), {s.load_balance, s.router_z, s.counts, s.probs_std});
      return out;
    };
    UnitHooks hooks;
    if (layer_hooks) {
      hooks.rerun = remat_policy == "full" || layer_hooks->decoder_layer_rerun();
      hooks.before_run = [hooks_owner = layer_hooks, i](bool backward) { hooks_owner->decoder_layer_gather(i, backward); };
      hooks.after_backward = [hooks_owner = layer_hooks, i] { hooks_owner->decoder_layer_grads_ready(i); };
    }
    const auto out = run_unit(block, {x}, std::move(hooks));
    x = out[0];
    if (out.size() > 1 && ctx.moe_stats) ctx.moe_stats->push_back({out[1], out[2], out[3].detach(), out[4].detach()});
  }
  return x;
}

TransformerImpl::TransformerImpl(const Config& c)
    : mtp_num_layers_(c.mtp_num_layers), mtp_input_after_final_norm_(c.mtp_input_after_final_norm) {
  model = register_module("model", DecoderStack(c));
  if (!c.logits_via_embedding) lm_head = register_module("lm_head", linear(c.base_emb_dim, c.vocab_size));
}

torch::Tensor TransformerImpl::head(const torch::Tensor& normed_hidden) {
  const auto logits = lm_head ? lm_head(normed_hidden) : model_detail::linear_gemm(normed_hidden, model->embed_tokens->weight);
  return logits.to(at::promote_types(logits.scalar_type(), torch::kFloat32));
}

torch::Tensor mtp_shift_tokens(const torch::Tensor& tokens, const torch::Tensor& segment_ids, int64_t k) {
  const auto L = tokens.size(1);
  const auto in_range = torch::arange(L, segment_ids.options()) < L - k;  // (L)
  const auto same = (segment_ids.roll(-k, 1) == segment_ids) & in_range;   // (B, L)
  return torch::where(same, tokens.roll(-k, 1), torch::zeros_like(tokens));
}

torch::Tensor TransformerImpl::head_weight() const {
  return lm_head ? lm_head->weight : model->embed_tokens->weight;
}

ModelOutput TransformerImpl::forward(const torch::Tensor& tokens, const torch::Tensor& positions,
                                     const torch::Tensor& segment_ids, bool one_segment_per_row, bool logits) {
  ModelOutput out;
  BlockContext ctx = model->context(positions, segment_ids, one_segment_per_row);
  ctx.moe_stats = &out.moe_stats;
  auto hidden = model->forward(model->embed_tokens(tokens), ctx);  // (B, L, D) before the final norm
  auto normed = model->norm(hidden);                                 // (B, L, D)
  out.head_input = normed;
  if (logits) out.logits = head(normed);
  // Depth k reads depth k-1's hidden state before its final norm (DeepSeek-V3 style), or after it
  // (mtp_input_after_final_norm: Ling 2.0's HF code and Megatron; it is then also the head's input).
  for (int64_t k = 1; k <= mtp_num_layers_; ++k) {
    auto mtp = model->layers[model->num_decoder_layers + k - 1]->as<MtpLayerImpl>();
    const auto shifted = model->embed_tokens(mtp_shift_tokens(tokens, segment_ids, k));
    hidden = mtp->forward_depth(mtp_input_after_final_norm_ ? normed : hidden, shifted, ctx);
    normed = mtp->shared_head->norm(hidden);
    out.mtp_head_inputs.push_back(normed);
    if (logits) out.mtp_logits.push_back(head(normed));
  }
  return out;
}

std::vector<Moe> TransformerImpl::moe_layers() {
  std::vector<Moe> out;
  for (size_t i = 0; i < model->layers->size(); ++i) {  // decoder layers, then MTP blocks (mtp_moe_mlp)
    const auto layer = model->layers[i]->as<DecoderLayerImpl>();
    if (layer->moe) out.push_back(layer->moe);
  }
  return out;
}

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Walks the checkpoint tensors of `by_parameter` in checkpoint order, calling
// fn(name, tensor, shape). Stacked experts become one entry per expert (gate, up, down), named
// by global id; with total_experts > 0 every expert of the full layer is visited, and those the
// stacked tensors do not hold come with an undefined tensor (model_build draws them anyway).
template <class Fn>
void checkpoint_walk(const NamedTensors& by_parameter, int64_t first_expert, int64_t total_experts, Fn&& fn) {
  static const std::string kGateUp = "experts.gate_up_proj", kDown = "experts.down_proj";
  std::map<std::string, torch::Tensor> down_of;  // layer prefix "model.layers.N.mlp." -> (E, D, F)
  for (const auto& [name, tensor] : by_parameter)
    if (ends_with(name, kDown)) down_of[name.substr(0, name.size() - kDown.size())] = tensor;
  for (const auto& [name, tensor] : by_parameter) {
    if (ends_with(name, kDown)) continue;  // visited with its gate_up_proj
    if (!ends_with(name, kGateUp)) {
      fn(name, tensor, tensor.sizes().vec());
      continue;
    }
    const auto prefix = name.substr(0, name.size() - kGateUp.size());
    const auto down = down_of.at(prefix);  // (E_here, D, F)
    const int64_t here = tensor.size(0), hidden = down.size(2), dim = down.size(1);
    const int64_t first = total_experts > 0 ? 0 : first_expert, last = total_experts > 0 ? total_experts : first_expert + here;
    for (int64_t e = first; e < last; ++e) {
      const auto expert = prefix + "experts." + std::to_string(e) + ".";
      const bool held = e >= first_expert && e < first_expert + here;
      const int64_t i = e - first_expert;
      fn(expert + "gate_proj.weight", held ? tensor[i].narrow(0, 0, hidden) : torch::Tensor(), std::vector<int64_t>{hidden, dim});
      fn(expert + "up_proj.weight", held ? tensor[i].narrow(0, hidden, hidden) : torch::Tensor(), std::vector<int64_t>{hidden, dim});
      fn(expert + "down_proj.weight", held ? down[i] : torch::Tensor(), std::vector<int64_t>{dim, hidden});
    }
  }
}

}  // namespace

bool model_is_stacked_experts(const std::string& parameter_name) {
  return ends_with(parameter_name, "experts.gate_up_proj") || model_is_stacked_down_proj(parameter_name);
}

bool model_is_stacked_down_proj(const std::string& parameter_name) { return ends_with(parameter_name, "experts.down_proj"); }

NamedTensors model_checkpoint_views(const NamedTensors& by_parameter, int64_t first_expert) {
  NamedTensors out;
  checkpoint_walk(by_parameter, first_expert, /*total_experts=*/0,
                  [&](const std::string& name, const torch::Tensor& tensor, const std::vector<int64_t>&) {
                    out.emplace_back(name, tensor);
                  });
  return out;
}

// Megatron's init: N(0, init_method_std^2), and the projections that write into the residual
// stream (attention o_proj, MLP and expert down_proj) at std / sqrt(2 x decoder layers), so the
// residual's variance after the stack does not grow with the depth (scaled_init_method_normal).
ModelInitializer::ModelInitializer(const Config& config, int64_t expert_rank)
    : generator_(at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config.init_weights_seed))),
      first_expert_(expert_rank * (config.num_experts / config.expert_parallelism)),
      total_experts_(config.num_experts > 1 ? config.num_experts : 0),
      std_(config.init_method_std),
      output_std_(config.init_output_layers_scaled
                      ? config.init_method_std / std::sqrt(2.0 * static_cast<double>(config.base_num_decoder_layers))
                      : config.init_method_std) {}

void ModelInitializer::draw(const NamedTensors& parameters) {
  torch::NoGradGuard no_grad;
  checkpoint_walk(parameters, first_expert_, total_experts_,
                  [&](const std::string& name, torch::Tensor tensor, const std::vector<int64_t>& shape) {
                    if (ends_with(name, "norm.weight")) {
                      tensor.fill_(1.0);
                      return;
                    }
                    // Another rank's expert: drawn into scratch, so the generator stays in step.
                    if (!tensor.defined()) tensor = torch::empty(shape);
                    const bool output = ends_with(name, "o_proj.weight") || ends_with(name, "down_proj.weight");
                    tensor.normal_(0.0, output ? output_std_ : std_, generator_);
                  });
}

Transformer model_build(const Config& config, int64_t expert_rank, bool draw) {
  Transformer model(config);
  if (draw) {
    NamedTensors parameters;
    for (const auto& item : model->named_parameters()) parameters.emplace_back(item.key(), item.value());
    ModelInitializer(config, expert_rank).draw(parameters);
  }
  return model;
}

}  // namespace trainer
