// deepinfer_cpu::prefill_attention: the attention of a prefill chunk's queries over its packed context, fp32,
// x86-64 (AVX2 for the softmax; the products through the BLAS's sgemm).
//
//   q [T, H, D]          the chunk's queries (nope and rope parts together)
//   k [C, H, D]          the context's keys, per head (the latents expanded by W_UK, the shared rope key)
//   v [C, H, Dv]         the context's values, per head
//   starts [T]           where each query's sequence begins in the packed context
//   positions [T]        each query's position in its sequence: it attends to keys starts .. starts + position
//   -> o [T, H, Dv] = softmax(scale * q . k) . v over each query's keys (zero for a query with none).
//
// The graph form scores every query against the whole context bucket ([H, T, C] written, masked, read by the
// softmax, written again and read by the second product), though a chunk's causal mask leaves half of it or more
// unused. Here each task (QB queries, one head) scores only the keys its queries can see, one contiguous span
// per query (their union for the block), keeps the scores in a buffer the size of that span, and applies the
// softmax and the values while they are in cache. Tasks run on torch's thread pool, the most expensive first,
// each thread taking the next. Token-major operands, as the projections write them and o_proj reads the result.
// Built with the other kernels by runtime/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

#include <dlfcn.h>

namespace {

using deepinfer_simd::exp_nonpositive;

// The BLAS's sgemm (MKL's in torch's x86 wheels, exported by libtorch_cpu), found at run time: one call per score
// block and one per weighted sum, single-threaded inside the task's thread. Without it the op takes the torch form.
using sgemm_fn = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                          const int*, const float*, const int*, const float*, float*, const int*);

sgemm_fn blas_sgemm() {
  static const sgemm_fn f = [] {
    void* sym = dlsym(RTLD_DEFAULT, "sgemm_");
    if (sym == nullptr)                 // torch's library loaded without its symbols in the global scope
      if (void* lib = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD)) sym = dlsym(lib, "sgemm_");
    return reinterpret_cast<sgemm_fn>(sym);
  }();
  return f;
}

// Queries a task. Against 16 and 32 (a 2-core Zen 3 VM, 2 threads): the demo model's chunk (4 heads, 256 queries,
// context 256) 0.27 against 0.34 ms; 16 heads of 192/128 dims over a 1024-key context 19 against 20-30 ms. Larger
// blocks score more of the masked triangle by the diagonal; smaller ones run the GEMMs at a lower rate.
constexpr int64_t QB = 64;

// Row r's scores s[0, n) -> its probabilities over its own keys [a, b) (scaled, max subtracted, normalised) and
// exact zeros elsewhere in [0, n).
void softmax_span(float* s, int64_t n, int64_t a, int64_t b, float scale) {
  const __m256 sv = _mm256_set1_ps(scale);
  __m256 mx8 = _mm256_set1_ps(-std::numeric_limits<float>::infinity()), nan8 = _mm256_setzero_ps();
  int64_t c = a;
  for (; c + 8 <= b; c += 8) {
    const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(s + c), sv);
    mx8 = _mm256_max_ps(mx8, x);
    nan8 = _mm256_or_ps(nan8, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  alignas(32) float part[8];
  _mm256_store_ps(part, mx8);
  float mx = *std::max_element(part, part + 8);
  bool nan = _mm256_movemask_ps(nan8) != 0;
  for (; c < b; ++c) {
    const float x = s[c] * scale;
    mx = std::max(mx, x);
    nan |= std::isnan(x);
  }
  if (nan) mx = std::numeric_limits<float>::quiet_NaN();    // NaN propagates, as in the torch form
  const __m256 mv = _mm256_set1_ps(mx);
  __m256 sum8 = _mm256_setzero_ps();
  for (c = a; c + 8 <= b; c += 8) {
    const __m256 e = exp_nonpositive(_mm256_fmsub_ps(_mm256_loadu_ps(s + c), sv, mv));
    _mm256_storeu_ps(s + c, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  _mm256_store_ps(part, sum8);
  float sum = part[0] + part[1] + part[2] + part[3] + part[4] + part[5] + part[6] + part[7];
  for (; c < b; ++c) {
    s[c] = std::exp(s[c] * scale - mx);
    sum += s[c];
  }
  const float inv = 1.f / sum;
  const __m256 iv = _mm256_set1_ps(inv);
  for (c = a; c + 8 <= b; c += 8) _mm256_storeu_ps(s + c, _mm256_mul_ps(_mm256_loadu_ps(s + c), iv));
  for (; c < b; ++c) s[c] *= inv;
  std::fill(s, s + a, 0.f);
  std::fill(s + b, s + n, 0.f);
}

// The torch form (masked scores over the whole context, softmax): other dtypes, and where no BLAS sgemm was found.
at::Tensor torch_form(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                      const at::Tensor& positions, double scale) {
  const at::Tensor key = at::arange(k.size(0), starts.options().dtype(at::kLong));
  const at::Tensor rel = key.unsqueeze(0) - starts.to(at::kLong).unsqueeze(1);
  const at::Tensor valid = rel.ge(0).logical_and(rel.le(positions.to(at::kLong).unsqueeze(1)));     // [T, C]
  at::Tensor scores = at::matmul(q.transpose(0, 1), k.permute({1, 2, 0})).to(at::kFloat).mul(scale);  // [H, T, C]
  scores.masked_fill_(valid.logical_not().unsqueeze(0), -std::numeric_limits<double>::infinity());
  at::Tensor mx = std::get<0>(scores.max(-1, true));
  mx = at::where(at::isfinite(mx), mx, at::zeros_like(mx));
  const at::Tensor e = at::exp(scores - mx), denom = e.sum(-1, true);
  const at::Tensor o = at::matmul(e.to(v.scalar_type()), v.transpose(0, 1)).to(at::kFloat) / denom.clamp_min(1e-30);
  return o.transpose(0, 1).contiguous();                                                      // [T, H, Dv]
}

at::Tensor prefill_attention(const at::Tensor& q_, const at::Tensor& k_, const at::Tensor& v_, const at::Tensor& starts_,
                             const at::Tensor& positions_, double scale) {
  TORCH_CHECK(q_.device().is_cpu() && k_.device().is_cpu() && v_.device().is_cpu(), "prefill_attention: CPU tensors only");
  TORCH_CHECK(q_.scalar_type() == at::kFloat && k_.scalar_type() == at::kFloat && v_.scalar_type() == at::kFloat,
              "prefill_attention: fp32 only");
  TORCH_CHECK(q_.dim() == 3 && k_.dim() == 3 && v_.dim() == 3 && starts_.dim() == 1 && positions_.dim() == 1,
              "prefill_attention: q [T, H, D], k [C, H, D], v [C, H, Dv], starts [T], positions [T]");
  const sgemm_fn gemm = blas_sgemm();
  if (gemm == nullptr) return torch_form(q_, k_, v_, starts_, positions_, scale);
  const at::Tensor q = q_.contiguous(), k = k_.contiguous(), v = v_.contiguous();
  const at::Tensor starts = starts_.to(at::kLong).contiguous(), positions = positions_.to(at::kLong).contiguous();
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), C = k.size(0), Dv = v.size(2);
  TORCH_CHECK(k.size(1) == H && v.size(1) == H && k.size(2) == D && v.size(0) == C,
              "prefill_attention: q [", T, ", ", H, ", ", D, "] needs k [C, ", H, ", ", D, "] and v [C, ", H, ", Dv]");
  TORCH_CHECK(starts.size(0) == T && positions.size(0) == T, "prefill_attention: starts and positions need ", T, " rows");
  TORCH_CHECK(H * std::max(D, Dv) <= INT32_MAX && C <= INT32_MAX, "prefill_attention: sizes beyond the BLAS's int");
  at::Tensor o = at::empty({T, H, Dv}, q.options());
  if (H == 0 || T == 0 || C == 0) return o.zero_();

  // Each query's keys: one span [lo, hi) of the context (empty for a padding query).
  std::vector<int64_t> lo(T), hi(T);
  const int64_t* sp = starts.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    lo[t] = std::max<int64_t>(sp[t], 0);
    hi[t] = pp[t] < 0 ? lo[t] : std::min(sp[t] + pp[t] + 1, C);
    if (hi[t] < lo[t]) hi[t] = lo[t];
  }
  // Tasks (query block, head), the most keys first: each thread takes the next from a shared counter, so the
  // causal chunk's heavy last blocks do not all land on one thread.
  const int64_t NQ = (T + QB - 1) / QB;
  std::vector<int64_t> blo(NQ, C), bhi(NQ, 0);
  for (int64_t t = 0; t < T; ++t)
    if (hi[t] > lo[t]) {
      blo[t / QB] = std::min(blo[t / QB], lo[t]);
      bhi[t / QB] = std::max(bhi[t / QB], hi[t]);
    }
  std::vector<int64_t> order;          // blocks with keys; the others (padding only) are zeros
  for (int64_t b = 0; b < NQ; ++b) {
    if (bhi[b] > blo[b]) order.push_back(b);
    else o.narrow(0, b * QB, std::min(T, (b + 1) * QB) - b * QB).zero_();
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return bhi[x] - blo[x] > bhi[y] - blo[y]; });
  const int64_t tasks = static_cast<int64_t>(order.size()) * H;
  std::atomic<int64_t> next{0};
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = o.data_ptr<float>();
  const float s = static_cast<float>(scale);
  const int ldqk = static_cast<int>(H * D), ldv = static_cast<int>(H * Dv);
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    std::vector<float> buf;
    for (int64_t task; (task = next.fetch_add(1)) < tasks;) {
      const int64_t b = order[task / H], h = task % H;
      const int64_t t0 = b * QB, nr = std::min(T, t0 + QB) - t0, c0 = blo[b], n = bhi[b] - c0;
      buf.resize(static_cast<size_t>(nr * n));
      // Scores [nr, n] = q rows . k rows (column-major for the BLAS: [n, nr] = k^T-transposed times q^T).
      {
        const int m_ = static_cast<int>(n), n_ = static_cast<int>(nr), k_ = static_cast<int>(D), ldc = m_;
        const float one = 1.f, zero = 0.f;
        gemm("T", "N", &m_, &n_, &k_, &one, kp + (c0 * H + h) * D, &ldqk, qp + (t0 * H + h) * D, &ldqk, &zero,
             buf.data(), &ldc);
      }
      for (int64_t r = 0; r < nr; ++r) {
        const int64_t t = t0 + r;
        if (hi[t] > lo[t]) softmax_span(buf.data() + r * n, n, lo[t] - c0, hi[t] - c0, s);
        else std::fill(buf.data() + r * n, buf.data() + (r + 1) * n, 0.f);
      }
      // o rows [nr, Dv] = probabilities [nr, n] . v rows [n, Dv].
      {
        const int m_ = static_cast<int>(Dv), n_ = static_cast<int>(nr), k_ = static_cast<int>(n), ldb = k_;
        const float one = 1.f, zero = 0.f;
        gemm("N", "N", &m_, &n_, &k_, &one, vp + (c0 * H + h) * Dv, &ldv, buf.data(), &ldb, &zero,
             op + (t0 * H + h) * Dv, &ldv);
      }
    }
  });
  return o;
}

// deepinfer::prefill_attention on CPU: the kernel for fp32, the torch form for other dtypes.
at::Tensor prefill_attention_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& starts,
                                 const at::Tensor& positions, double scale) {
  if (q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat)
    return prefill_attention(q, k, v, starts, positions, scale);
  return torch_form(q, k, v, starts, positions, scale);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(deepinfer_cpu, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, Tensor starts, Tensor positions, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(deepinfer_cpu, CPU, m) {
  m.impl("prefill_attention", prefill_attention);
}

TORCH_LIBRARY_IMPL(deepinfer, CPU, m) {   // runtime/ops.py defines the op; on CPU this replaces its Python body
  m.impl("prefill_attention", prefill_attention_cpu);
}
