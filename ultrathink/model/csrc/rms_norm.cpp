// RMSNorm forward and backward on a CPU, one pass over each row where torch 2.13's rms_norm makes several
// elementwise passes (pow, mean, rsqrt, two products, casts: 3-7x slower here, fused_norm.py). Rows are split over
// torch's threads; within a row the loops are plain enough for the compiler to vectorise (-O3 -march=native
// -fopenmp-simd). Statistics in fp32 whatever the input dtype (fp32 or bf16), as the Python path does.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
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

// y = x * rstd * w per row, rstd = 1 / sqrt(mean(x^2) + eps), kept for the backward.
template <typename T>
void forward_rows(const T* x, const float* w, T* y, float* rstd, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> row(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      T* yr = y + r * d;
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < d; ++i) {
        row[i] = to_float(xr[i]);
        squares += row[i] * row[i];
      }
      const float scale = 1.f / std::sqrt(squares / d + eps);
      rstd[r] = scale;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) yr[i] = from_float<T>(row[i] * scale * w[i]);
    }
  });
}

// With x̂ = x * rstd and g = dy * w: dx = rstd * (g - x̂ * mean(g * x̂)), dw = Σ_rows dy * x̂ (each thread sums its own
// rows into its own buffer; the buffers are added in thread order, so a given thread count gives the same bits).
template <typename T>
void backward_rows(const T* dy, const T* x, const float* w, const float* rstd, T* dx, float* dw, int64_t rows,
                   int64_t d) {
  const int threads = at::get_num_threads();
  std::vector<float> partial(static_cast<size_t>(threads) * d, 0.f);
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    float* dw_part = partial.data() + static_cast<size_t>(at::get_thread_num()) * d;
    std::vector<float> normed(d), g(d);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * d;
      const T* dyr = dy + r * d;
      const float scale = rstd[r];
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t i = 0; i < d; ++i) {
        const float grad = to_float(dyr[i]);
        normed[i] = to_float(xr[i]) * scale;
        dw_part[i] += grad * normed[i];
        g[i] = grad * w[i];
        dot += g[i] * normed[i];
      }
      const float mean = dot / d;
      T* dxr = dx + r * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) dxr[i] = from_float<T>(scale * (g[i] - normed[i] * mean));
    }
  });
  for (int t = 0; t < threads; ++t)
    for (int64_t i = 0; i < d; ++i) dw[i] += partial[static_cast<size_t>(t) * d + i];
}

void check(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16,
              "rms_norm: fp32 or bf16 input, got ", x.scalar_type());
  TORCH_CHECK(w.scalar_type() == torch::kFloat && w.dim() == 1 && w.is_contiguous() && w.size(0) == x.size(-1),
              "rms_norm: a contiguous fp32 weight of the last dimension's size");
}

std::vector<torch::Tensor> forward(torch::Tensor x, const torch::Tensor& w, double eps) {
  check(x, w);
  x = x.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto y = torch::empty_like(x);
  auto rstd = torch::empty({rows}, x.options().dtype(torch::kFloat));
  if (x.scalar_type() == torch::kBFloat16)
    forward_rows(x.data_ptr<c10::BFloat16>(), w.data_ptr<float>(), y.data_ptr<c10::BFloat16>(),
                 rstd.data_ptr<float>(), rows, d, static_cast<float>(eps));
  else
    forward_rows(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>(), rstd.data_ptr<float>(), rows, d,
                 static_cast<float>(eps));
  return {y, rstd};
}

std::vector<torch::Tensor> backward(torch::Tensor dy, const torch::Tensor& x, const torch::Tensor& w,
                                    const torch::Tensor& rstd) {
  check(x, w);
  dy = dy.to(x.scalar_type()).contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto dx = torch::empty_like(x);
  auto dw = torch::zeros({d}, w.options());
  if (x.scalar_type() == torch::kBFloat16)
    backward_rows(dy.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), w.data_ptr<float>(),
                  rstd.data_ptr<float>(), dx.data_ptr<c10::BFloat16>(), dw.data_ptr<float>(), rows, d);
  else
    backward_rows(dy.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(), rstd.data_ptr<float>(),
                  dx.data_ptr<float>(), dw.data_ptr<float>(), rows, d);
  return {dx, dw};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &forward, "RMSNorm forward: (y, rstd)");
  m.def("backward", &backward, "RMSNorm backward: (dx, dw)");
}
