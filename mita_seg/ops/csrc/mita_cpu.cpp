// Fused MiTA read-out on CPU (forward). Routing (landmarks, scores, top-k) is done by the
// caller with ATen ops; see mita_seg/ops/fused_cpu.py. Two parallel phases:
//   A. expert-major: for each (batch*head, expert), gather the expert's k keys and values
//      once, and the queries routed to it (items grouped by a counting sort), then two
//      small GEMMs ([G, d] x [d, k], [G, k] x [k, d]) with the softmax in between. Writes
//      each item's normalised output and log-sum-exp. Random K/V row reads happen once per
//      expert, not once per query.
//   B. query-major, in chunks of queries: the shared expert (softmax over the M landmark
//      logits, one GEMM with V_R) merged with the r routed partials by log-sum-exp.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline void axpy(T* __restrict__ y, T a, const T* __restrict__ x, int64_t d) {
#pragma omp simd
  for (int64_t t = 0; t < d; ++t) y[t] += a * x[t];
}

template <typename T>
void routed_phase(const T* q, const T* k, const T* v, const int64_t* keys, const int64_t* choice,
                  T* o_items, T* lse_items, int64_t BH, int64_t N, int64_t d, int64_t M,
                  int64_t K, int64_t R, T scale) {
  const int64_t NR = N * R;
  // Counting sort of the items of each batch*head by expert.
  std::vector<int64_t> offsets(BH * (M + 1)), order(BH * NR);
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bh = b0; bh < b1; ++bh) {
      int64_t* off = offsets.data() + bh * (M + 1);
      const int64_t* ch = choice + bh * NR;
      std::fill(off, off + M + 1, 0);
      for (int64_t i = 0; i < NR; ++i) ++off[ch[i] + 1];
      for (int64_t m = 0; m < M; ++m) off[m + 1] += off[m];
      std::vector<int64_t> pos(off, off + M);
      int64_t* ord = order.data() + bh * NR;
      for (int64_t i = 0; i < NR; ++i) ord[pos[ch[i]]++] = i;
    }
  });
  const auto opts = torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  at::parallel_for(0, BH * M, 1, [&](int64_t t0, int64_t t1) {
    auto kloc = torch::empty({K, d}, opts), vloc = torch::empty({K, d}, opts);
    std::vector<T> lse(N);
    T* kl = kloc.template data_ptr<T>();
    T* vl = vloc.template data_ptr<T>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / M, m = t % M;
      const int64_t* off = offsets.data() + bh * (M + 1);
      const int64_t G = off[m + 1] - off[m];
      if (G == 0) continue;
      const int64_t* idx = keys + (bh * M + m) * K;
      const T* kb = k + bh * N * d;
      const T* vb = v + bh * N * d;
      for (int64_t j = 0; j < K; ++j) {
        std::copy(kb + idx[j] * d, kb + idx[j] * d + d, kl + j * d);
        std::copy(vb + idx[j] * d, vb + idx[j] * d + d, vl + j * d);
      }
      const int64_t* ord = order.data() + bh * NR + off[m];
      auto qg = torch::empty({G, d}, opts);
      T* qp = qg.template data_ptr<T>();
      for (int64_t g = 0; g < G; ++g) {
        const T* src = q + (bh * N + ord[g] / R) * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) qp[g * d + c] = src[c] * scale;
      }
      auto logits = torch::mm(qg, kloc.t());                          // [G, K]
      T* lg = logits.template data_ptr<T>();
      for (int64_t g = 0; g < G; ++g) {
        T* row = lg + g * K;
        T mx = std::numeric_limits<T>::lowest();
        for (int64_t j = 0; j < K; ++j) mx = std::max(mx, row[j]);
        T sum = 0;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < K; ++j) {  // vectorised exp (libmvec)
          row[j] = std::exp(row[j] - mx);
          sum += row[j];
        }
        lse[g] = mx + std::log(sum);
        const T inv = T(1) / sum;
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) row[j] *= inv;
      }
      auto og = torch::mm(logits, vloc);                              // [G, d]
      const T* op = og.template data_ptr<T>();
      for (int64_t g = 0; g < G; ++g) {
        std::copy(op + g * d, op + g * d + d, o_items + (bh * NR + ord[g]) * d);
        lse_items[bh * NR + ord[g]] = lse[g];
      }
    }
  });
}

template <typename T>
void merge_phase(const T* o_items, const T* lse_items, const T* shared_logits,
                 const T* shared_values, T* out, int64_t BH, int64_t N, int64_t d, int64_t M,
                 int64_t R, bool shared) {
  constexpr int64_t CH = 128;  // queries per task
  const int64_t chunks = (N + CH - 1) / CH;
  const auto opts = torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  at::parallel_for(0, BH * chunks, 1, [&](int64_t t0, int64_t t1) {
    auto p = torch::empty({CH, shared ? M : 1}, opts);
    std::vector<T> mx(CH), sum(CH);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / chunks, n0 = (t % chunks) * CH, n1 = std::min(N, n0 + CH);
      const int64_t G = n1 - n0;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = bh * N + n0 + g;
        T m = std::numeric_limits<T>::lowest();
        for (int64_t c = 0; c < R; ++c) m = std::max(m, lse_items[i * R + c]);
        T s = 0;
        if (shared) {  // shared logits enter the softmax directly, relative to m
          const T* ls = shared_logits + i * M;
          for (int64_t j = 0; j < M; ++j) m = std::max(m, ls[j]);
          T* pr = p.template data_ptr<T>() + g * M;
#pragma omp simd reduction(+ : s)
          for (int64_t j = 0; j < M; ++j) {
            pr[j] = std::exp(ls[j] - m);
            s += pr[j];
          }
        }
        mx[g] = m;
        sum[g] = s;
      }
      T* o = out + (bh * N + n0) * d;
      if (shared) {
        auto vr = torch::from_blob(const_cast<T*>(shared_values + bh * M * d), {M, d}, opts);
        auto os = torch::mm(p.narrow(0, 0, G), vr);                   // [G, d]
        std::copy(os.template data_ptr<T>(), os.template data_ptr<T>() + G * d, o);
      } else {
        std::fill(o, o + G * d, T(0));
      }
      for (int64_t g = 0; g < G; ++g) {  // each routed partial has weight exp(lse - m)
        const int64_t i = bh * N + n0 + g;
        T s = sum[g];
        T* oi = o + g * d;
        for (int64_t c = 0; c < R; ++c) {
          const T w = std::exp(lse_items[i * R + c] - mx[g]);
          s += w;
          axpy(oi, w, o_items + (i * R + c) * d, d);
        }
        const T inv = T(1) / s;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) oi[c] *= inv;
      }
    }
  });
}

// q, k, v: [BH, N, d]; keys: [BH, M, K] int64; choice: [BH, N, R] int64 (expert ids);
// shared_logits: [BH, N, M] (already scaled); shared_values: [BH, M, d]; both ignored
// unless `shared`. Returns [BH, N, d].
torch::Tensor mita_readout(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                           torch::Tensor keys, torch::Tensor choice,
                           torch::Tensor shared_logits, torch::Tensor shared_values,
                           bool shared, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "mita_readout: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes(),
              "mita_readout: q, k, v must be [BH, N, d]");
  TORCH_CHECK(keys.scalar_type() == at::kLong && choice.scalar_type() == at::kLong,
              "mita_readout: keys and choice must be int64");
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous();
  keys = keys.contiguous(); choice = choice.contiguous();
  const int64_t BH = q.size(0), N = q.size(1), d = q.size(2);
  const int64_t M = keys.size(1), K = keys.size(2), R = choice.size(2);
  TORCH_CHECK(keys.size(0) == BH && choice.size(0) == BH && choice.size(1) == N,
              "mita_readout: keys/choice do not match q");
  if (shared) {
    shared_logits = shared_logits.to(q.scalar_type()).contiguous();
    shared_values = shared_values.to(q.scalar_type()).contiguous();
    TORCH_CHECK(shared_logits.numel() == BH * N * M && shared_values.numel() == BH * M * d,
                "mita_readout: shared expert tensors do not match");
  }
  auto out = torch::empty_like(q);
  auto o_items = torch::empty({BH, N * R, d}, q.options());
  auto lse_items = torch::empty({BH, N * R}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mita_readout", [&] {
    routed_phase<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                           v.data_ptr<scalar_t>(), keys.data_ptr<int64_t>(),
                           choice.data_ptr<int64_t>(), o_items.data_ptr<scalar_t>(),
                           lse_items.data_ptr<scalar_t>(), BH, N, d, M, K, R,
                           static_cast<scalar_t>(scale));
    merge_phase<scalar_t>(o_items.data_ptr<scalar_t>(), lse_items.data_ptr<scalar_t>(),
                          shared ? shared_logits.data_ptr<scalar_t>() : nullptr,
                          shared ? shared_values.data_ptr<scalar_t>() : nullptr,
                          out.data_ptr<scalar_t>(), BH, N, d, M, R, shared);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mita_readout", &mita_readout, "Fused MiTA read-out (CPU)");
}
