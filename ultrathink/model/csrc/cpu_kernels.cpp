// RMSNorm, and rotary embedding (after an optional RMSNorm: Qwen3's q/k norms), forward and backward on a CPU, one
// pass over each row where torch 2.13 makes several elementwise passes (cpu_kernels.py says how much that costs);
// attention's causal softmax forward, which reads only the scores each query may see; and SwiGLU's gate.
// Rows (SwiGLU: elements) are split over torch's threads (at::parallel_for: OpenMP, so the library is built with
// -fopenmp; without it the loop ran on one thread); within a row the loops are plain enough for the compiler to
// vectorise (-O3 -march=native). Arithmetic in fp32 whatever the input dtype (fp32 or bf16), rounded once on output.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace {

// bf16 <-> fp32 as bit operations, which vectorise (c10::BFloat16's conversions do not). Round to nearest even, as
// c10 does; NaN stays NaN.
inline float to_float(float v) { return v; }
inline float to_float(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
template <typename T> T from_float(float f);
template <> float from_float<float>(float f) { return f; }
template <> c10::BFloat16 from_float<c10::BFloat16>(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  uint16_t rounded = f != f ? 0x7FC0 : static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  return c10::BFloat16(rounded, c10::BFloat16::from_bits());
}

constexpr int64_t kRowsPerTask = 16;

// Where each row of d values starts in a (batch, positions, heads, d) tensor whose last dimension is contiguous and
// whose other three have any strides: row r counts in the logical order (batch, then positions, then heads). So the
// rotation can write its output heads first, as attention's matmuls read it (Attention.forward transposes it to
// (batch, heads, positions, d)), and read a gradient that comes back in that layout, without a copy either way.
struct Rows {
  int64_t heads, positions, head_stride, position_stride, batch_stride;
  int64_t operator()(int64_t r) const {
    return r / (heads * positions) * batch_stride + (r / heads) % positions * position_stride + r % heads * head_stride;
  }
};

// Rows packed one after the other, d values apart.
Rows packed(int64_t d) { return {1, 1, d, d, d}; }

Rows rows_of(const torch::Tensor& t) {
  TORCH_CHECK(t.dim() == 4 && t.stride(3) == 1, "a (batch, positions, heads, d) tensor with contiguous rows");
  return {t.size(2), t.size(1), t.stride(2), t.stride(1), t.stride(0)};
}

// Rows of d values (x: rows x d), each normalised when Norm, then rotated when Rotate:
//   n = x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) (kept for the backward), else n = x;
//   y = n * cos + rotate_half(n) * sin, where rotate_half(n) = (-n[h:], n[:h]) for h = d / 2 (as Hugging Face's
//   Llama and Qwen apply it) and row r is at position (r / heads) % positions of the cos/sin tables; else y = n.
// RMSNorm is <Norm, !Rotate>; Qwen3's q/k norms and rotary <Norm, Rotate>; Llama's rotary <!Norm, Rotate>.
// D: the row size when known at compile time (the loops then have no remainder to test), else 0. T is x's type, O
// the output's: x's own, or bf16 from fp32 (a norm feeding matmuls under bf16 autocast).
template <typename T, typename O, bool Norm, bool Rotate, int64_t D>
void forward_range(const T* __restrict__ x, const float* __restrict__ cos, const float* __restrict__ sin,
                   const float* __restrict__ w, O* __restrict__ y, Rows out, float* __restrict__ rstd, int64_t begin,
                   int64_t end, int64_t width, int64_t heads, int64_t positions, float eps) {
  static_assert(Norm || Rotate, "nothing to compute");
  const int64_t d = D ? D : width, h = d / 2;
  std::vector<float> buffer(d);
  float* __restrict__ n = buffer.data();
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * d;
    O* yr = y + out(r);
    float squares = 0.f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < d; ++i) {
      n[i] = to_float(xr[i]);
      squares += n[i] * n[i];
    }
    float scale = 1.f;
    if (Norm) {
      scale = 1.f / std::sqrt(squares / d + eps);
      rstd[r] = scale;
    }
    if (!Rotate) {  // the norm straight to the output
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) yr[i] = from_float<O>(Norm ? n[i] * scale * w[i] : n[i]);
      continue;
    }
    if (Norm) {
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) n[i] *= scale * w[i];
    }
    const int64_t p = (r / heads) % positions;
    const float* c = cos + p * d;
    const float* s = sin + p * d;
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) {
      yr[i] = from_float<O>(n[i] * c[i] - n[i + h] * s[i]);
      yr[i + h] = from_float<O>(n[i + h] * c[i + h] + n[i] * s[i + h]);
    }
  }
}

// forward_range over all rows, split over torch's threads. The rows' loop is a function of its own so that its
// pointers keep __restrict__: in the lambda that OpenMP's region runs they lose it, and the backward's loop (the
// same split) then vectorised 1.6 times slower on one thread.
template <typename T, typename O, bool Norm, bool Rotate, int64_t D>
void forward_rows(const T* x, const float* cos, const float* sin, const float* w, O* y, Rows out, float* rstd,
                  int64_t rows, int64_t width, int64_t heads, int64_t positions, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    forward_range<T, O, Norm, Rotate, D>(x, cos, sin, w, y, out, rstd, begin, end, width, heads, positions, eps);
  });
}

// The rotation's transpose takes dy to dn: dn[i] = dy[i] c[i] + dy[i+h] s[i+h], dn[i+h] = dy[i+h] c[i+h] - dy[i] s[i]
// (without a rotation dn = dy, read as the norm's loop goes). Then the norm's: with x̂ = x * rstd and g = dn * w,
// dx = rstd * (g - x̂ * mean(g * x̂)) and dw = Σ_rows dn * x̂ (each thread sums its own rows into its own buffer; the
// buffers are added in thread order, so a given thread count gives the same bits). Without a norm dx = dn. dy is
// of the forward's output type O, its rows where `in` says; dx of x's type T, packed.
template <typename T, typename O, bool Norm, bool Rotate, int64_t D>
void backward_range(const O* __restrict__ dy, Rows in, const T* __restrict__ x, const float* __restrict__ cos,
                    const float* __restrict__ sin, const float* __restrict__ w, const float* __restrict__ rstd,
                    T* __restrict__ dx, float* __restrict__ dw_part, int64_t begin, int64_t end, int64_t width,
                    int64_t heads, int64_t positions) {
  static_assert(Norm || Rotate, "nothing to compute");
  const int64_t d = D ? D : width, h = d / 2;
  std::vector<float> buffers(2 * d);
  float* __restrict__ dn = buffers.data();
  float* __restrict__ normed = buffers.data() + d;
  for (int64_t r = begin; r < end; ++r) {
    const O* dyr = dy + in(r);
    if (Rotate) {
      const int64_t p = (r / heads) % positions;
      const float* c = cos + p * d;
      const float* s = sin + p * d;
#pragma omp simd
      for (int64_t i = 0; i < h; ++i) {
        const float lo = to_float(dyr[i]), hi = to_float(dyr[i + h]);
        dn[i] = lo * c[i] + hi * s[i + h];
        dn[i + h] = hi * c[i + h] - lo * s[i];
      }
    }
    T* dxr = dx + r * d;
    if (!Norm) {
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) dxr[i] = from_float<T>(dn[i]);
      continue;
    }
    const T* xr = x + r * d;
    const float scale = rstd[r];
    float dot = 0.f;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < d; ++i) {
      const float grad = Rotate ? dn[i] : to_float(dyr[i]);
      normed[i] = to_float(xr[i]) * scale;
      dw_part[i] += grad * normed[i];
      dn[i] = grad * w[i];
      dot += dn[i] * normed[i];
    }
    const float mean = dot / d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) dxr[i] = from_float<T>(scale * (dn[i] - normed[i] * mean));
  }
}

// backward_range over all rows, split over torch's threads, each summing dw over its rows into a buffer of its own.
template <typename T, typename O, bool Norm, bool Rotate, int64_t D>
void backward_rows(const O* dy, Rows in, const T* x, const float* cos, const float* sin, const float* w,
                   const float* rstd, T* dx, float* dw, int64_t rows, int64_t width, int64_t heads,
                   int64_t positions) {
  const int64_t d = D ? D : width;
  const int threads = at::get_num_threads();
  std::vector<float> partial(Norm ? static_cast<size_t>(threads) * d : 0, 0.f);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    float* dw_part = Norm ? partial.data() + static_cast<size_t>(at::get_thread_num()) * d : nullptr;
    backward_range<T, O, Norm, Rotate, D>(dy, in, x, cos, sin, w, rstd, dx, dw_part, begin, end, width, heads,
                                          positions);
  });
  for (int t = 0; Norm && t < threads; ++t)
    for (int64_t i = 0; i < d; ++i) dw[i] += partial[static_cast<size_t>(t) * d + i];
}

// e^x for x <= 0 (a score less its row's maximum), vectorisable: 2^n e^r with n = round(x / ln 2) and r = x - n ln 2
// in [-ln 2 / 2, ln 2 / 2] (ln 2 in two parts, so r keeps its bits), e^r by a polynomial of degree 6 (Cephes' expf
// coefficients); 0 below -87 (e^-87 is near fp32's smallest normal), so -inf gives 0.
inline float exp_nonpositive(float x) {
  const bool underflows = x < -87.f;
  x = underflows ? -87.f : x;
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // + 1.5 * 2^23 rounds to an integer
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  const float p = 1.f + r * (1.f + r * (0.5f + r * (0.166666672f + r * (0.0416666418f + r * (0.00833336264f +
                                                                                           r * 0.00138925656f)))));
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;  // 2^n as a float's exponent
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return underflows ? 0.f : p * scale;
}

// SwiGLU's gate, elementwise: h = silu(g) u = g σ(g) u, and its backward du = dh g σ(g),
// dg = dh u σ(g) (1 + g (1 - σ(g))). σ(g) from t = e^-|g| (never overflows): 1 / (1 + t) for g >= 0, t / (1 + t)
// below. Saving g and u is enough for the backward, where torch's silu and product keep silu(g) as well.
inline float sigmoid(float g) {
  const float t = exp_nonpositive(-std::fabs(g));
  const float inverse = 1.f / (1.f + t);
  return g >= 0.f ? inverse : t * inverse;
}

template <typename T>
void swiglu_forward_range(const T* __restrict__ g, const T* __restrict__ u, T* __restrict__ h, int64_t begin,
                          int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float gate = to_float(g[i]);
    h[i] = from_float<T>(gate * sigmoid(gate) * to_float(u[i]));
  }
}

template <typename T>
void swiglu_backward_range(const T* __restrict__ dh, const T* __restrict__ g, const T* __restrict__ u,
                           T* __restrict__ dg, T* __restrict__ du, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float gate = to_float(g[i]), s = sigmoid(gate), d = to_float(dh[i]);
    du[i] = from_float<T>(d * gate * s);
    dg[i] = from_float<T>(d * to_float(u[i]) * s * (1.f + gate * (1.f - s)));
  }
}

constexpr int64_t kElementsPerTask = 1 << 14;

// Rows of `keys` scores (x: rows x keys), row r the query at position first + r % queries, which sees the keys up
// to its own: y = softmax over those keys, 0 after them, in fp32, rounded once. The keys after the last one a query
// sees are never read, and their weights are written as zeros. Each row's loops run to the next multiple of 16 keys
// (those past the query's own read as -inf) so that they end on a whole vector.
template <typename T>
void causal_softmax_range(const T* __restrict__ x, T* __restrict__ y, int64_t begin, int64_t end, int64_t queries,
                          int64_t keys, int64_t first) {
  std::vector<float> buffer(keys);
  float* __restrict__ e = buffer.data();
  for (int64_t r = begin; r < end; ++r) {
    const T* xr = x + r * keys;
    T* yr = y + r * keys;
    const int64_t seen = std::min(keys, first + r % queries + 1), whole = std::min(keys, (seen + 15) / 16 * 16);
    float most = -INFINITY;
#pragma omp simd reduction(max : most)
    for (int64_t j = 0; j < whole; ++j) {
      e[j] = j < seen ? to_float(xr[j]) : -INFINITY;
      most = most > e[j] ? most : e[j];
    }
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < whole; ++j) {
      e[j] = exp_nonpositive(e[j] - most);
      sum += e[j];
    }
    const float inverse = 1.f / sum;
#pragma omp simd
    for (int64_t j = 0; j < whole; ++j) yr[j] = from_float<T>(e[j] * inverse);
    std::memset(static_cast<void*>(yr + whole), 0, (keys - whole) * sizeof(T));
  }
}

template <typename T>
void causal_softmax_rows(const T* x, T* y, int64_t rows, int64_t queries, int64_t keys, int64_t first) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    causal_softmax_range<T>(x, y, begin, end, queries, keys, first);
  });
}

void check_input(const torch::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "a CPU tensor in fp32 or bf16, got ", x.scalar_type(), " on ", x.device());
}

void check_weight(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == torch::kFloat && w.dim() == 1 && w.is_contiguous() &&
                  w.size(0) == x.size(-1),
              "a contiguous fp32 CPU weight of the last dimension's size");
}

// Calls body(T{}, O{}, Norm, D) for x's dtype, the output's (x's own; for RMSNorm also bf16 from fp32), whether
// there is a norm (always, without a rotation), and x's row size when it is a usual one.
template <bool Rotate, typename Body>
void dispatch(const torch::Tensor& x, torch::ScalarType out, bool norm, Body body) {
  auto with_width = [&](auto t, auto o, auto n) {
    switch (x.size(-1)) {
      case 64: return body(t, o, n, std::integral_constant<int64_t, 64>{});
      case 128: return body(t, o, n, std::integral_constant<int64_t, 128>{});
      default: return body(t, o, n, std::integral_constant<int64_t, 0>{});
    }
  };
  auto with_norm = [&](auto t, auto o) {
    if constexpr (Rotate) norm ? with_width(t, o, std::true_type{}) : with_width(t, o, std::false_type{});
    else with_width(t, o, std::true_type{});
  };
  const bool bf16_in = x.scalar_type() == torch::kBFloat16;
  TORCH_CHECK(out == x.scalar_type() || (!Rotate && !bf16_in && out == torch::kBFloat16),
              "an output in the input's dtype, or in bf16 from fp32 (RMSNorm)");
  if (bf16_in) return with_norm(c10::BFloat16{}, c10::BFloat16{});
  if constexpr (!Rotate)
    if (out == torch::kBFloat16) return with_norm(float{}, c10::BFloat16{});
  with_norm(float{}, float{});
}

std::vector<torch::Tensor> rms_norm_forward(torch::Tensor x, const torch::Tensor& w, double eps,
                                            torch::ScalarType out) {
  check_input(x);
  check_weight(x, w);
  x = x.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto y = torch::empty_like(x, x.options().dtype(out));
  auto rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
  dispatch<false>(x, out, true, [&](auto t, auto o, auto n, auto width) {
    using T = decltype(t);
    using O = decltype(o);
    forward_rows<T, O, decltype(n)::value, false, decltype(width)::value>(
        x.data_ptr<T>(), nullptr, nullptr, w.data_ptr<float>(), y.data_ptr<O>(), packed(d), rstd.data_ptr<float>(),
        rows, d, 1, 1, static_cast<float>(eps));
  });
  return {y, rstd};
}

std::vector<torch::Tensor> rms_norm_backward(torch::Tensor dy, const torch::Tensor& x, const torch::Tensor& w,
                                             const torch::Tensor& rstd, torch::ScalarType out) {
  dy = dy.to(out).contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto dx = torch::empty_like(x);
  auto dw = torch::zeros({d}, w.options());
  dispatch<false>(x, out, true, [&](auto t, auto o, auto n, auto width) {
    using T = decltype(t);
    using O = decltype(o);
    backward_rows<T, O, decltype(n)::value, false, decltype(width)::value>(
        dy.data_ptr<O>(), packed(d), x.data_ptr<T>(), nullptr, nullptr, w.data_ptr<float>(), rstd.data_ptr<float>(),
        dx.data_ptr<T>(), dw.data_ptr<float>(), rows, d, 1, 1);
  });
  return {dx, dw};
}

void check_tables(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() >= 2 && x.size(-1) % 2 == 0, "rotary: (..., heads, head_dim) input of an even head_dim");
  for (const auto& t : {cos, sin})
    TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous() && t.dim() == 2 &&
                    t.size(1) == x.size(-1) && (x.numel() / x.size(-1) / x.size(-2)) % t.size(0) == 0,
                "rotary: contiguous fp32 cos/sin tables (positions, head_dim) that tile the input's positions");
}

// heads_first: x is (batch, positions, heads, d) and y, of the same shape, is stored as (batch, heads, positions, d).
std::vector<torch::Tensor> rotary_forward(torch::Tensor x, const torch::Tensor& cos, const torch::Tensor& sin,
                                          const c10::optional<torch::Tensor>& w, double eps, bool heads_first) {
  const bool norm = w.has_value();
  check_input(x);
  if (norm) check_weight(x, *w);
  check_tables(x, cos, sin);
  x = x.contiguous();
  TORCH_CHECK(!heads_first || x.dim() == 4, "rotary: heads first takes a (batch, positions, heads, d) input");
  const int64_t d = x.size(-1), heads = x.size(-2), rows = x.numel() / d;
  auto y = heads_first ? torch::empty({x.size(0), x.size(2), x.size(1), d}, x.options()).transpose(1, 2)
                       : torch::empty_like(x);
  auto rstd = torch::empty({norm ? rows : 0}, x.options().dtype(torch::kFloat));
  dispatch<true>(x, x.scalar_type(), norm, [&](auto t, auto, auto n, auto width) {
    using T = decltype(t);
    forward_rows<T, T, decltype(n)::value, true, decltype(width)::value>(
        x.data_ptr<T>(), cos.data_ptr<float>(), sin.data_ptr<float>(), norm ? w->data_ptr<float>() : nullptr,
        y.data_ptr<T>(), heads_first ? rows_of(y) : packed(d), rstd.data_ptr<float>(), rows, d, heads, cos.size(0),
        static_cast<float>(eps));
  });
  return {y, rstd};
}

std::vector<torch::Tensor> rotary_backward(torch::Tensor dy, const torch::Tensor& x, const torch::Tensor& cos,
                                           const torch::Tensor& sin, const c10::optional<torch::Tensor>& w,
                                           const torch::Tensor& rstd) {
  const bool norm = w.has_value();
  dy = dy.to(x.scalar_type());
  const bool strided = dy.dim() == 4 && dy.stride(3) == 1;  // e.g. heads first, as attention's matmuls give it back
  if (!strided) dy = dy.contiguous();
  const int64_t d = x.size(-1), heads = x.size(-2), rows = x.numel() / d;
  auto dx = torch::empty_like(x);
  auto dw = torch::zeros({norm ? d : 0}, x.options().dtype(torch::kFloat));
  dispatch<true>(x, x.scalar_type(), norm, [&](auto t, auto, auto n, auto width) {
    using T = decltype(t);
    backward_rows<T, T, decltype(n)::value, true, decltype(width)::value>(
        dy.data_ptr<T>(), strided ? rows_of(dy) : packed(d), x.data_ptr<T>(), cos.data_ptr<float>(),
        sin.data_ptr<float>(), norm ? w->data_ptr<float>() : nullptr, rstd.data_ptr<float>(), dx.data_ptr<T>(),
        dw.data_ptr<float>(), rows, d, heads, cos.size(0));
  });
  return {dx, dw};
}

// scores (..., queries, keys): softmax(scores + the causal mask of queries at positions first, first + 1, ...), each
// query seeing the keys up to its own position.
torch::Tensor causal_softmax_forward(torch::Tensor scores, int64_t first) {
  check_input(scores);
  TORCH_CHECK(scores.dim() >= 2 && first >= 0, "causal softmax: scores (..., queries, keys), a first position >= 0");
  scores = scores.contiguous();
  auto y = torch::empty_like(scores);
  const int64_t keys = scores.size(-1), queries = scores.size(-2), rows = scores.numel() / keys;
  if (scores.scalar_type() == torch::kBFloat16)
    causal_softmax_rows(scores.data_ptr<c10::BFloat16>(), y.data_ptr<c10::BFloat16>(), rows, queries, keys, first);
  else
    causal_softmax_rows(scores.data_ptr<float>(), y.data_ptr<float>(), rows, queries, keys, first);
  return y;
}

// gate, up (any shape, one dtype): silu(gate) * up.
torch::Tensor swiglu_forward(torch::Tensor g, torch::Tensor u) {
  check_input(g);
  TORCH_CHECK(u.sizes() == g.sizes() && u.scalar_type() == g.scalar_type(),
              "swiglu: gate and up of one shape and dtype");
  g = g.contiguous();
  u = u.contiguous();
  auto h = torch::empty_like(g);
  at::parallel_for(0, g.numel(), kElementsPerTask, [&](int64_t begin, int64_t end) {
    if (g.scalar_type() == torch::kBFloat16)
      swiglu_forward_range(g.data_ptr<c10::BFloat16>(), u.data_ptr<c10::BFloat16>(), h.data_ptr<c10::BFloat16>(),
                           begin, end);
    else
      swiglu_forward_range(g.data_ptr<float>(), u.data_ptr<float>(), h.data_ptr<float>(), begin, end);
  });
  return h;
}

// The gradients of gate and up, from h's (dh) and the forward's inputs (contiguous, as swiglu_forward made them).
std::vector<torch::Tensor> swiglu_backward(torch::Tensor dh, const torch::Tensor& g, const torch::Tensor& u) {
  dh = dh.to(g.scalar_type()).contiguous();
  auto dg = torch::empty_like(g), du = torch::empty_like(u);
  at::parallel_for(0, g.numel(), kElementsPerTask, [&](int64_t begin, int64_t end) {
    if (g.scalar_type() == torch::kBFloat16)
      swiglu_backward_range(dh.data_ptr<c10::BFloat16>(), g.data_ptr<c10::BFloat16>(), u.data_ptr<c10::BFloat16>(),
                            dg.data_ptr<c10::BFloat16>(), du.data_ptr<c10::BFloat16>(), begin, end);
    else
      swiglu_backward_range(dh.data_ptr<float>(), g.data_ptr<float>(), u.data_ptr<float>(), dg.data_ptr<float>(),
                            du.data_ptr<float>(), begin, end);
  });
  return {dg, du};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm_forward", &rms_norm_forward, "RMSNorm forward: (y, rstd)");
  m.def("rms_norm_backward", &rms_norm_backward, "RMSNorm backward: (dx, dw)");
  m.def("rotary_forward", &rotary_forward, "rotary embedding after an optional RMSNorm, forward: (y, rstd)");
  m.def("rotary_backward", &rotary_backward, "rotary embedding after an optional RMSNorm, backward: (dx, dw)");
  m.def("causal_softmax_forward", &causal_softmax_forward, "attention's causal softmax, forward");
  m.def("swiglu_forward", &swiglu_forward, "silu(gate) * up");
  m.def("swiglu_backward", &swiglu_backward, "silu(gate) * up, backward: (dgate, dup)");
}
