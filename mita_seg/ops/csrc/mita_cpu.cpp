// Fused MiTA read-out on CPU, forward and backward. Routing (landmarks, scores, top-k) is
// done by the caller with ATen ops; see mita_seg/ops/fused_cpu.py.
//
// Forward, two parallel phases:
//   A. expert-major: for each (batch*head, expert), gather the expert's k keys and values
//      once, and the queries routed to it (items grouped by a counting sort), then two
//      small GEMMs ([G, d] x [d, k], [G, k] x [k, d]) with the softmax in between. Writes
//      each item's normalised output and log-sum-exp. Random K/V row reads happen once per
//      expert, not once per query.
//   B. query-major, in chunks of queries: the shared expert (softmax over the M landmark
//      logits, one GEMM with V_R) merged with the r routed partials by log-sum-exp. Also
//      writes each query's log-sum-exp over all M + r k logits, for the backward.
//
// Backward (P = softmax of all logits of a query, recomputed from that log-sum-exp;
// D = rowsum(dOut * out); dlogit = P (dP - D)), three parallel phases:
//   A. per batch*head, in chunks of queries: D, and the shared expert:
//      dLs = P_s (dOut V_R^T - D), dV_R += P_s^T dOut.
//   B. expert-major, as forward phase A: five small GEMMs per expert give dQ of its items and
//      dK, dV of its k keys, written to per-expert buffers (keys are shared by experts and
//      queries by experts under router top-r: no two tasks write the same memory).
//   C. per batch*head: scatter-add the per-expert dK, dV into key rows, sum dQ over choices.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

// The small GEMMs call the BLAS that PyTorch links (Fortran sgemm_/dgemm_, 32-bit ints as
// PyTorch's own calls) directly: torch::mm costs ~3 us of dispatch per call, more than a
// [20, 64] x [64, 49] product. Weak symbols: torch::mm is used where they are absent.
// PyTorch turns MKL's dynamic threading off (mkl_set_dynamic(0)), so an MKL GEMM called
// inside at::parallel_for starts a nested team of threads on busy cores: measured 15x slower
// on 2 threads. Every parallel task that calls a GEMM holds a SerialBlas, which asks MKL
// for one thread on this thread (a no-op when PyTorch is built without MKL).
extern "C" int MKL_Set_Num_Threads_Local(int) __attribute__((weak));
extern "C" void sgemm_(const char*, const char*, const int*, const int*, const int*,
                       const float*, const float*, const int*, const float*, const int*,
                       const float*, float*, const int*) __attribute__((weak));
extern "C" void dgemm_(const char*, const char*, const int*, const int*, const int*,
                       const double*, const double*, const int*, const double*, const int*,
                       const double*, double*, const int*) __attribute__((weak));

namespace {

struct SerialBlas {
  int previous = 0;
  SerialBlas() {
    if (MKL_Set_Num_Threads_Local) previous = MKL_Set_Num_Threads_Local(1);
  }
  ~SerialBlas() {
    if (MKL_Set_Num_Threads_Local) MKL_Set_Num_Threads_Local(previous);
  }
  SerialBlas(const SerialBlas&) = delete;
  SerialBlas& operator=(const SerialBlas&) = delete;
};

template <typename T>
inline void axpy(T* __restrict__ y, T a, const T* __restrict__ x, int64_t d) {
#pragma omp simd
  for (int64_t t = 0; t < d; ++t) y[t] += a * x[t];
}

template <typename T>
inline T dot(const T* __restrict__ x, const T* __restrict__ y, int64_t d) {
  T s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t t = 0; t < d; ++t) s += x[t] * y[t];
  return s;
}

template <typename T>
torch::TensorOptions options_of() {
  return torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
}

// Row-major C[m, n] = op(A) op(B) (+ C if accumulate) with op(A) [m, k], op(B) [k, n];
// a_t: A is stored [k, m] (lda its row stride), b_t: B is stored [n, k]. (Column-major BLAS
// computes C^T.)
template <typename T>
void gemm(bool a_t, bool b_t, int64_t m, int64_t n, int64_t k, const T* A, int64_t lda,
          const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate = false) {
  constexpr bool is_float = std::is_same<T, float>::value;
#ifndef MITA_TORCH_MM_ONLY  // defined by the test of the fallback
  if ((is_float && sgemm_) || (!is_float && dgemm_)) {
    const int mi = m, ni = n, ki = k, la = lda, lb = ldb, lc = ldc;
    const char ta = a_t ? 'T' : 'N', tb = b_t ? 'T' : 'N';
    const T one = 1, beta = accumulate ? 1 : 0;
    if constexpr (is_float) {
      sgemm_(&tb, &ta, &ni, &mi, &ki, &one, B, &lb, A, &la, &beta, C, &lc);
    } else {
      dgemm_(&tb, &ta, &ni, &mi, &ki, &one, B, &lb, A, &la, &beta, C, &lc);
    }
    return;
  }
#endif
  const auto opts = options_of<T>();
  auto blob = [&](const T* x, int64_t rows, int64_t cols, int64_t ld, bool t) {
    auto x2 = torch::from_blob(const_cast<T*>(x), {t ? cols : rows, t ? rows : cols},
                               {ld, 1}, opts);
    return t ? x2.t() : x2;
  };
  auto c = torch::from_blob(C, {m, n}, {ldc, 1}, opts);
  if (accumulate) {
    c.addmm_(blob(A, m, k, lda, a_t), blob(B, k, n, ldb, b_t));
  } else {
    torch::mm_out(c, blob(A, m, k, lda, a_t), blob(B, k, n, ldb, b_t));
  }
}

// Items (query n, choice c) -> item n * R + c, grouped by expert with a counting sort:
// the items of expert m of batch*head bh are order[bh * NR + offsets[bh * (M + 1) + m] ...
// offsets[bh * (M + 1) + m + 1]), in increasing item order.
void group_items(const int64_t* choice, int64_t BH, int64_t NR, int64_t M,
                 std::vector<int64_t>& offsets, std::vector<int64_t>& order) {
  offsets.assign(BH * (M + 1), 0);
  order.resize(BH * NR);
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bh = b0; bh < b1; ++bh) {
      int64_t* off = offsets.data() + bh * (M + 1);
      const int64_t* ch = choice + bh * NR;
      for (int64_t i = 0; i < NR; ++i) ++off[ch[i] + 1];
      for (int64_t m = 0; m < M; ++m) off[m + 1] += off[m];
      std::vector<int64_t> pos(off, off + M);
      int64_t* ord = order.data() + bh * NR;
      for (int64_t i = 0; i < NR; ++i) ord[pos[ch[i]]++] = i;
    }
  });
}

// Copies the k rows idx[0..K) of x ([N, d]) to dst ([K, d]).
template <typename T>
inline void gather_rows(T* dst, const T* x, const int64_t* idx, int64_t K, int64_t d) {
  for (int64_t j = 0; j < K; ++j) std::copy(x + idx[j] * d, x + idx[j] * d + d, dst + j * d);
}

template <typename T>
void routed_phase(const T* q, const T* k, const T* v, const int64_t* keys,
                  const std::vector<int64_t>& offsets, const std::vector<int64_t>& order,
                  T* o_items, T* lse_items, int64_t BH, int64_t N, int64_t d, int64_t M,
                  int64_t K, int64_t R, T scale) {
  const int64_t NR = N * R;
  at::parallel_for(0, BH * M, 1, [&](int64_t t0, int64_t t1) {
    SerialBlas serial_blas;
    std::vector<T> kloc(K * d), vloc(K * d), lse, qbuf, lbuf, obuf;
    T* kl = kloc.data();
    T* vl = vloc.data();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / M, m = t % M;
      const int64_t* off = offsets.data() + bh * (M + 1);
      const int64_t G = off[m + 1] - off[m];
      if (G == 0) continue;
      const int64_t* idx = keys + (bh * M + m) * K;
      gather_rows(kl, k + bh * N * d, idx, K, d);
      gather_rows(vl, v + bh * N * d, idx, K, d);
      const int64_t* ord = order.data() + bh * NR + off[m];
      qbuf.resize(G * d); lbuf.resize(G * K); obuf.resize(G * d); lse.resize(G);
      T* qp = qbuf.data();
      T* lg = lbuf.data();
      for (int64_t g = 0; g < G; ++g) {
        const T* src = q + (bh * N + ord[g] / R) * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) qp[g * d + c] = src[c] * scale;
      }
      gemm(false, true, G, K, d, qp, d, kl, d, lg, K);                // logits [G, K]
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
      T* op = obuf.data();
      gemm(false, false, G, d, K, lg, K, vl, d, op, d);               // [G, d]
      for (int64_t g = 0; g < G; ++g) {
        std::copy(op + g * d, op + g * d + d, o_items + (bh * NR + ord[g]) * d);
        lse_items[bh * NR + ord[g]] = lse[g];
      }
    }
  });
}

template <typename T>
void merge_phase(const T* o_items, const T* lse_items, const T* shared_logits,
                 const T* shared_values, T* out, T* lse_out, int64_t BH, int64_t N, int64_t d,
                 int64_t M, int64_t R, bool shared) {
  constexpr int64_t CH = 128;  // queries per task
  const int64_t chunks = (N + CH - 1) / CH;
  at::parallel_for(0, BH * chunks, 1, [&](int64_t t0, int64_t t1) {
    SerialBlas serial_blas;
    std::vector<T> p(shared ? CH * M : 1), mx(CH), sum(CH);
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
          T* pr = p.data() + g * M;
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
        gemm(false, false, G, d, M, p.data(), M, shared_values + bh * M * d, d, o, d);
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
        lse_out[i] = mx[g] + std::log(s);
        const T inv = T(1) / s;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) oi[c] *= inv;
      }
    }
  });
}

// Backward phase A, per batch*head (it owns dV_R[bh]), in chunks of queries:
// delta = rowsum(dout * out); with the shared expert, P_s = exp(Ls - lse),
// dLs = P_s (dout V_R^T - delta) and dV_R += P_s^T dout.
template <typename T>
void shared_backward_phase(const T* dout, const T* out, const T* lse, const T* shared_logits,
                           const T* shared_values, T* delta, T* dls, T* dvr, int64_t BH,
                           int64_t N, int64_t d, int64_t M, bool shared) {
  constexpr int64_t CH = 128;  // queries per chunk
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    SerialBlas serial_blas;
    std::vector<T> p(shared ? CH * M : 1), dp(shared ? CH * M : 1);
    for (int64_t bh = b0; bh < b1; ++bh) {
      for (int64_t n0 = 0; n0 < N; n0 += CH) {
        const int64_t G = std::min(N, n0 + CH) - n0, i0 = bh * N + n0;
        for (int64_t i = i0; i < i0 + G; ++i) delta[i] = dot(dout + i * d, out + i * d, d);
        if (!shared) continue;
        const T* vr = shared_values + bh * M * d;
        gemm(false, true, G, M, d, dout + i0 * d, d, vr, d, dp.data(), M);  // dout V_R^T
        for (int64_t g = 0; g < G; ++g) {
          const int64_t i = i0 + g;
          const T* ls = shared_logits + i * M;
          const T* dpr = dp.data() + g * M;
          T* pr = p.data() + g * M;
          T* dl = dls + i * M;
          const T l = lse[i], D = delta[i];
#pragma omp simd
          for (int64_t j = 0; j < M; ++j) {
            pr[j] = std::exp(ls[j] - l);
            dl[j] = pr[j] * (dpr[j] - D);
          }
        }
        gemm(true, false, M, d, G, p.data(), M, dout + i0 * d, d, dvr + bh * M * d, d,
             n0 > 0);                                                 // dV_R += P_s^T dout
      }
    }
  });
}

// Backward phase B: per expert, dQ of its items (to dq_items, row = item) and dK, dV of its
// k keys (to dk_exp, dv_exp: [BH, M, K, d]).
template <typename T>
void routed_backward_phase(const T* q, const T* k, const T* v, const int64_t* keys,
                           const std::vector<int64_t>& offsets,
                           const std::vector<int64_t>& order, const T* dout, const T* lse,
                           const T* delta, T* dq_items, T* dk_exp, T* dv_exp, int64_t BH,
                           int64_t N, int64_t d, int64_t M, int64_t K, int64_t R, T scale) {
  const int64_t NR = N * R;
  at::parallel_for(0, BH * M, 1, [&](int64_t t0, int64_t t1) {
    SerialBlas serial_blas;
    std::vector<T> kloc(K * d), vloc(K * d), qbuf, dobuf, pbuf, dsbuf, dqbuf;
    T* kl = kloc.data();
    T* vl = vloc.data();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t bh = t / M, m = t % M;
      const int64_t* off = offsets.data() + bh * (M + 1);
      const int64_t G = off[m + 1] - off[m];
      if (G == 0) continue;  // phase C skips this expert
      const int64_t* idx = keys + (bh * M + m) * K;
      gather_rows(kl, k + bh * N * d, idx, K, d);
      gather_rows(vl, v + bh * N * d, idx, K, d);
      const int64_t* ord = order.data() + bh * NR + off[m];
      qbuf.resize(G * d); dobuf.resize(G * d); pbuf.resize(G * K); dsbuf.resize(G * K);
      dqbuf.resize(G * d);
      T* qp = qbuf.data();
      T* dop = dobuf.data();
      T* pp = pbuf.data();
      T* dsp = dsbuf.data();
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = bh * N + ord[g] / R;
        const T* src = q + i * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) qp[g * d + c] = src[c] * scale;
        std::copy(dout + i * d, dout + i * d + d, dop + g * d);
      }
      gemm(false, true, G, K, d, qp, d, kl, d, pp, K);                // logits [G, K]
      gemm(false, true, G, K, d, dop, d, vl, d, dsp, K);              // dP [G, K]
      for (int64_t g = 0; g < G; ++g) {
        const int64_t i = bh * N + ord[g] / R;
        const T l = lse[i], D = delta[i];
        T* pr = pp + g * K;
        T* dr = dsp + g * K;
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) {
          pr[j] = std::exp(pr[j] - l);
          dr[j] = pr[j] * (dr[j] - D);
        }
      }
      // dK = dS^T (q scale) (q already scaled), dV = P^T dout, dQ = dS K (scaled below).
      gemm(true, false, K, d, G, dsp, K, qp, d, dk_exp + (bh * M + m) * K * d, d);
      gemm(true, false, K, d, G, pp, K, dop, d, dv_exp + (bh * M + m) * K * d, d);
      T* dqp = dqbuf.data();
      gemm(false, false, G, d, K, dsp, K, kl, d, dqp, d);
      for (int64_t g = 0; g < G; ++g) {
        T* dst = dq_items + (bh * NR + ord[g]) * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) dst[c] = dqp[g * d + c] * scale;
      }
    }
  });
}

// Backward phase C: dk, dv = sum of the per-expert buffers at the experts' key rows;
// dq = sum over the r choices of dq_items (R > 1 only: with R = 1 they are the same rows).
template <typename T>
void reduce_phase(const int64_t* keys, const std::vector<int64_t>& offsets, const T* dk_exp,
                  const T* dv_exp, const T* dq_items, T* dk, T* dv, T* dq, int64_t BH,
                  int64_t N, int64_t d, int64_t M, int64_t K, int64_t R) {
  at::parallel_for(0, BH, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t bh = b0; bh < b1; ++bh) {
      const int64_t* off = offsets.data() + bh * (M + 1);
      std::fill(dk + bh * N * d, dk + (bh + 1) * N * d, T(0));
      std::fill(dv + bh * N * d, dv + (bh + 1) * N * d, T(0));
      for (int64_t m = 0; m < M; ++m) {
        if (off[m + 1] == off[m]) continue;
        const int64_t* idx = keys + (bh * M + m) * K;
        const T* dke = dk_exp + (bh * M + m) * K * d;
        const T* dve = dv_exp + (bh * M + m) * K * d;
        for (int64_t j = 0; j < K; ++j) {
          axpy(dk + (bh * N + idx[j]) * d, T(1), dke + j * d, d);
          axpy(dv + (bh * N + idx[j]) * d, T(1), dve + j * d, d);
        }
      }
      if (R == 1) continue;
      for (int64_t n = 0; n < N; ++n) {
        T* dst = dq + (bh * N + n) * d;
        const T* src = dq_items + (bh * N + n) * R * d;
        std::copy(src, src + d, dst);
        for (int64_t c = 1; c < R; ++c) axpy(dst, T(1), src + c * d, d);
      }
    }
  });
}

struct Shapes {
  int64_t BH, N, d, M, K, R;
};

Shapes check_inputs(const char* name, torch::Tensor& q, torch::Tensor& k, torch::Tensor& v,
                    torch::Tensor& keys, torch::Tensor& choice, torch::Tensor& shared_logits,
                    torch::Tensor& shared_values, bool shared) {
  TORCH_CHECK(q.device().is_cpu(), name, ": CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k.sizes() == q.sizes() && v.sizes() == q.sizes(), name,
              ": q, k, v must be [BH, N, d]");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), name,
              ": q, k, v must have the same dtype");
  TORCH_CHECK(keys.scalar_type() == at::kLong && choice.scalar_type() == at::kLong, name,
              ": keys and choice must be int64");
  TORCH_CHECK(keys.dim() == 3 && choice.dim() == 3, name,
              ": keys must be [BH, M, K] and choice [BH, N, R]");
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous();
  keys = keys.contiguous(); choice = choice.contiguous();
  const Shapes s{q.size(0), q.size(1), q.size(2), keys.size(1), keys.size(2), choice.size(2)};
  TORCH_CHECK(keys.size(0) == s.BH && choice.size(0) == s.BH && choice.size(1) == s.N, name,
              ": keys/choice do not match q");
  if (shared) {
    shared_logits = shared_logits.to(q.scalar_type()).contiguous();
    shared_values = shared_values.to(q.scalar_type()).contiguous();
    TORCH_CHECK(shared_logits.numel() == s.BH * s.N * s.M &&
                    shared_values.numel() == s.BH * s.M * s.d,
                name, ": shared expert tensors do not match");
  }
  return s;
}

// q, k, v: [BH, N, d]; keys: [BH, M, K] int64; choice: [BH, N, R] int64 (expert ids);
// shared_logits: [BH, N, M] (already scaled); shared_values: [BH, M, d]; both ignored
// unless `shared`. Returns out [BH, N, d] and lse [BH, N], the log-sum-exp of each query's
// M + R K logits (R K without the shared expert).
std::tuple<torch::Tensor, torch::Tensor> mita_readout_forward(
    torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor keys,
    torch::Tensor choice, torch::Tensor shared_logits, torch::Tensor shared_values,
    bool shared, double scale) {
  const Shapes s = check_inputs("mita_readout_forward", q, k, v, keys, choice, shared_logits,
                                shared_values, shared);
  auto out = torch::empty_like(q);
  auto lse = torch::empty({s.BH, s.N}, q.options());
  auto o_items = torch::empty({s.BH, s.N * s.R, s.d}, q.options());
  auto lse_items = torch::empty({s.BH, s.N * s.R}, q.options());
  std::vector<int64_t> offsets, order;
  group_items(choice.data_ptr<int64_t>(), s.BH, s.N * s.R, s.M, offsets, order);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mita_readout_forward", [&] {
    routed_phase<scalar_t>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                           v.data_ptr<scalar_t>(), keys.data_ptr<int64_t>(), offsets, order,
                           o_items.data_ptr<scalar_t>(), lse_items.data_ptr<scalar_t>(), s.BH,
                           s.N, s.d, s.M, s.K, s.R, static_cast<scalar_t>(scale));
    merge_phase<scalar_t>(o_items.data_ptr<scalar_t>(), lse_items.data_ptr<scalar_t>(),
                          shared ? shared_logits.data_ptr<scalar_t>() : nullptr,
                          shared ? shared_values.data_ptr<scalar_t>() : nullptr,
                          out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), s.BH, s.N, s.d,
                          s.M, s.R, shared);
  });
  return {out, lse};
}

// Gradients of mita_readout_forward: inputs as there, plus its outputs out, lse and the
// gradient dout of out. Returns dq, dk, dv (routed logits and values only), and, with the
// shared expert, d shared_logits [BH, N, M] and d shared_values [BH, M, d] (empty without).
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor>
mita_readout_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor keys,
                      torch::Tensor choice, torch::Tensor shared_logits,
                      torch::Tensor shared_values, bool shared, double scale,
                      torch::Tensor out, torch::Tensor lse, torch::Tensor dout) {
  const Shapes s = check_inputs("mita_readout_backward", q, k, v, keys, choice, shared_logits,
                                shared_values, shared);
  TORCH_CHECK(out.sizes() == q.sizes() && dout.sizes() == q.sizes() && lse.numel() == s.BH * s.N,
              "mita_readout_backward: out, dout must be [BH, N, d] and lse [BH, N]");
  out = out.to(q.scalar_type()).contiguous();
  dout = dout.to(q.scalar_type()).contiguous();
  lse = lse.to(q.scalar_type()).contiguous();
  const auto opts = q.options();
  auto dq = torch::empty_like(q), dk = torch::empty_like(q), dv = torch::empty_like(q);
  auto dq_items = s.R == 1 ? dq : torch::empty({s.BH, s.N * s.R, s.d}, opts);
  auto dk_exp = torch::empty({s.BH, s.M, s.K, s.d}, opts);
  auto dv_exp = torch::empty({s.BH, s.M, s.K, s.d}, opts);
  auto delta = torch::empty({s.BH, s.N}, opts);
  auto dls = shared ? torch::empty({s.BH, s.N, s.M}, opts) : torch::empty({0}, opts);
  auto dvr = shared ? torch::empty({s.BH, s.M, s.d}, opts) : torch::empty({0}, opts);
  std::vector<int64_t> offsets, order;
  group_items(choice.data_ptr<int64_t>(), s.BH, s.N * s.R, s.M, offsets, order);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mita_readout_backward", [&] {
    scalar_t* no = nullptr;
    shared_backward_phase<scalar_t>(
        dout.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(),
        shared ? shared_logits.data_ptr<scalar_t>() : no,
        shared ? shared_values.data_ptr<scalar_t>() : no, delta.data_ptr<scalar_t>(),
        shared ? dls.data_ptr<scalar_t>() : no, shared ? dvr.data_ptr<scalar_t>() : no, s.BH,
        s.N, s.d, s.M, shared);
    routed_backward_phase<scalar_t>(
        q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
        keys.data_ptr<int64_t>(), offsets, order, dout.data_ptr<scalar_t>(),
        lse.data_ptr<scalar_t>(), delta.data_ptr<scalar_t>(), dq_items.data_ptr<scalar_t>(),
        dk_exp.data_ptr<scalar_t>(), dv_exp.data_ptr<scalar_t>(), s.BH, s.N, s.d, s.M, s.K,
        s.R, static_cast<scalar_t>(scale));
    reduce_phase<scalar_t>(keys.data_ptr<int64_t>(), offsets, dk_exp.data_ptr<scalar_t>(),
                           dv_exp.data_ptr<scalar_t>(), dq_items.data_ptr<scalar_t>(),
                           dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
                           dq.data_ptr<scalar_t>(), s.BH, s.N, s.d, s.M, s.K, s.R);
  });
  return {dq, dk, dv, dls, dvr};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mita_readout_forward", &mita_readout_forward,
        "Fused MiTA read-out (CPU): (out, lse)");
  m.def("mita_readout_backward", &mita_readout_backward,
        "Gradients of the fused MiTA read-out (CPU): (dq, dk, dv, dshared_logits, "
        "dshared_values)");
}
