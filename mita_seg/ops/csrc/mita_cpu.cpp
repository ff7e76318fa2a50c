// Fused MiTA on CPU: routing and read-out in one forward, and a backward that reuses what the
// forward saved (FlashAttention's pattern). Shapes: q, k, v [BH, N, d] (float32 or float64;
// bf16/fp16 computed in float32: the forward's phases read them a tile or a row at a time
// through rows_as_compute / widen, the backward converts them on entry; the forward also
// takes [B, H, N, d] of any row strides, views of the qkv projection read in place, and then
// writes out as [B, N, H, d], see Rows), M = Ph * Pw experts of K keys, R router choices per
// query.
//
// Forward, parallel phases (parallel_tasks; each thread holds one BLAS thread, SerialBlas):
//   1. landmarks   per (bh, m): R[m] = mean of q over the adaptive-pool bin m of the grid.
//   2. experts     per (bh, block of landmarks): S = (R / sqrt(d)) K^T, the K best keys of
//                  each row by selection (a bound from run maxima, nth_element of the few
//                  candidates above it; no sort), and with the shared expert V_R =
//                  softmax(S) V. In inference on tiles of ~1024 keys (S_t [LB, TN] in L2,
//                  an online softmax, the top-k fed tile by tile); when training on whole
//                  rows, which are the saved probabilities.
//   3. router      per (bh, chunk of queries): Ls = q (R * shared_scale)^T [CH, M] (kept
//                  only for the backward), each query's argmax (top-r for R > 1), and the
//                  shared expert's read-out: out = softmax(Ls) V_R, lse its log-sum-exp.
//   4. grouping    per bh: counting sort of the items (query n, choice c) by expert.
//   5. routed      per (bh, expert): gather the expert's K keys and values once, its queries'
//                  logits [G, K] and partial outputs [G, d]: two small GEMMs, a softmax;
//                  with R = 1 merged into out and lse by log-sum-exp at once.
//   6. merge       (R > 1) per query: its r routed partials merged into out and lse.
// Backward (P = exp(logit - lse); Dl = rowsum(dout * out) - dlse, the last term where lse
// has a gradient (an lse merge with global keys); dlogit = P (dP - Dl)):
//   A. per bh, chunks of queries: Dl, and the shared expert: dLs = P_s (dout V_R^T - Dl),
//      dV_R = P_s^T dout.
//   B. per (bh, expert), as phase 5: dQ of its items and dK, dV of its keys into per-expert
//      buffers (no two tasks write the same memory).
//   C. per bh: scatter-add the per-expert dK, dV into key rows; sum dQ over choices.
//   D-F. the routing part, through R, S, P, V_R (see scores_backward_phase).
//
// Relative position bias (BEiT; optional, see Bias): the landmark means bq, bk (computed by
// landmark_bias from the table, phase fwd.bias_means) are added to S in phase 2 and to Ls in
// phase 3; phase 5 (and B, which recomputes the routed logits) adds each routed logit's
// table entry. The backward returns d(bq) (= dS summed over the batch), d(bk) (= dLs) and
// the table's routed part (scattered in phase C); landmark_bias_backward (bwd.bias_means)
// takes d(bq), d(bk) to the table.
//
// Built for the baseline ISA (no -march=native, no -ffast-math): the GEMMs are MKL's (which
// dispatch on the CPU themselves) and the exponentials take an AVX2 path chosen at run time.
// Built with -fopenmp (setup.py): at::parallel_for's OpenMP body is inline in ATen's headers,
// so without it every phase runs on one thread, silently (parallel_threads() checks).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <numeric>
#include <string>
#include <type_traits>
#include <utility>
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

// ---- The phases' tasks [begin, end), handed out in chunks to the threads as they ask for
// them (an atomic counter), rather than in at::parallel_for's equal shares fixed up front: a
// thread that runs slower (a vCPU whose host core is busy, an efficiency core) takes fewer
// chunks instead of holding up the whole phase at its end. On the 2 vCPUs of a shared host
// the threads' busy times in one call differed by up to 25%: with equal shares 2-13% of the
// threads' time went to waiting at the ends of the phases, with chunks taken as they go
// 1.5-2.6% (N = 1025 to 16385). Chunks are of at least `grain` consecutive tasks, ~16 per
// thread. A thread walks the chunks it takes with `for (int64_t t : tasks)`; its buffers,
// set up before that loop, serve all of them. Which thread runs a task never changes a
// result: no task reads what another writes. ----
class Tasks {
 public:
  Tasks(int64_t begin, int64_t end, int64_t chunk) : next_(begin), end_(end), chunk_(chunk) {}
  struct End {};
  class Iterator {  // one thread's walk: the tasks of the chunk it holds, then the next chunk
   public:
    explicit Iterator(Tasks& tasks) : tasks_(tasks) { take(); }
    int64_t operator*() const { return t_; }
    Iterator& operator++() {
      if (++t_ == stop_) take();
      return *this;
    }
    bool operator!=(End) const { return t_ < tasks_.end_; }

   private:
    void take() {
      t_ = tasks_.next_.fetch_add(tasks_.chunk_, std::memory_order_relaxed);
      stop_ = std::min(t_ + tasks_.chunk_, tasks_.end_);
    }
    Tasks& tasks_;
    int64_t t_ = 0, stop_ = 0;
  };
  Iterator begin() { return Iterator(*this); }
  End end() const { return {}; }

 private:
  std::atomic<int64_t> next_;
  const int64_t end_, chunk_;
};

// Runs body(tasks) on each thread (once, inline, on one thread or inside a parallel region).
template <typename F>
void parallel_tasks(int64_t begin, int64_t end, int64_t grain, const F& body) {
  if (begin >= end) return;
  const int64_t threads = at::in_parallel_region() ? 1 : at::get_num_threads();
  const int64_t n = end - begin;
  const int64_t chunk = std::max<int64_t>({1, grain, n / (16 * threads)});
  Tasks tasks(begin, end, chunk);
  at::parallel_for(0, std::min(threads, (n + chunk - 1) / chunk), 1,
                   [&](int64_t, int64_t) { body(tasks); });
}

// ---- Phase profile: wall time of each phase, summed over calls (off unless enabled). ----
enum Phase { kLandmarks, kExperts, kRouter, kGrouping, kRouted, kMerge,
             kBwdShared, kBwdRouted, kBwdReduce, kBwdScores, kBwdRows, kBwdLandmarks,
             kBiasMeans, kBwdBiasMeans, kNumPhases };
const char* const kPhaseNames[kNumPhases] = {
    "fwd.landmarks", "fwd.experts", "fwd.router", "fwd.grouping", "fwd.routed", "fwd.merge",
    "bwd.shared", "bwd.routed", "bwd.reduce", "bwd.scores", "bwd.rows", "bwd.landmarks",
    "fwd.bias_means", "bwd.bias_means"};
std::atomic<bool> g_profile{false};
double g_phase_seconds[kNumPhases] = {};

struct PhaseTimer {
  Phase phase;
  std::chrono::steady_clock::time_point t0;
  explicit PhaseTimer(Phase p) : phase(p), t0(std::chrono::steady_clock::now()) {}
  ~PhaseTimer() {
    if (g_profile.load(std::memory_order_relaxed))
      g_phase_seconds[phase] +=
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
};

// ---- Vector helpers. ----
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

// Largest entry of x[0..n) (-inf if empty). NaN entries are skipped here, but reach the
// softmax's result through exp below.
__attribute__((target("avx2,fma"))) float row_max_avx2(const float* x, int64_t n) {
  __m256 acc = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) acc = _mm256_max_ps(_mm256_loadu_ps(x + j), acc);  // NaN: acc
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float m = lanes[0];
  for (int l = 1; l < 8; ++l) m = std::max(m, lanes[l]);
  for (; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// MITA_CPU_ISA=scalar turns the kernel's own AVX2/F16C code off (the exponential, the maxima,
// the conversions): the tests run the scalar code on any CPU that way. Read once, at load.
bool cpu_has_avx2() {
  const char* isa = std::getenv("MITA_CPU_ISA");
  if (isa && std::string(isa) == "scalar") return false;
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}
const bool g_has_avx2 = cpu_has_avx2();

template <typename T>
inline T row_max(const T* x, int64_t n) {
  if constexpr (std::is_same<T, float>::value) {
    if (g_has_avx2) return row_max_avx2(x, n);
  }
  T m = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < n; ++j) m = std::max(m, x[j]);
  return m;
}

// exp(x) on 8 floats, Cephes' polynomial (relative error ~2e-7), for x <= 0 as softmax
// feeds it: x below the float range gives exactly 0, NaN stays NaN, -inf gives 0.
__attribute__((target("avx2,fma"))) inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3365448f), hi = _mm256_set1_ps(88.3762626f);
  const __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);   // false for NaN
  x = _mm256_min_ps(hi, _mm256_max_ps(lo, x));                 // NaN passes through
  __m256 fx = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                              _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
  x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, y);
}

// row[j] = exp(row[j] - shift) * mul (AVX2), returning the sum of exp(row[j] - shift).
__attribute__((target("avx2,fma"))) float exp_shift_avx2(float* row, int64_t n, float shift,
                                                         float mul) {
  const __m256 s = _mm256_set1_ps(shift), f = _mm256_set1_ps(mul);
  __m256 acc = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(row + j), s));
    acc = _mm256_add_ps(acc, e);
    _mm256_storeu_ps(row + j, _mm256_mul_ps(e, f));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
              ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  for (; j < n; ++j) {
    const float e = std::exp(row[j] - shift);
    sum += e;
    row[j] = e * mul;
  }
  return sum;
}

template <typename T>
inline T exp_shift(T* row, int64_t n, T shift, T mul = 1) {
  if constexpr (std::is_same<T, float>::value) {
    if (g_has_avx2) return exp_shift_avx2(row, n, shift, mul);
  }
  T sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    const T e = std::exp(row[j] - shift);
    sum += e;
    row[j] = e * mul;
  }
  return sum;
}

// In-place softmax of a row; returns its log-sum-exp.
template <typename T>
inline T softmax_row(T* row, int64_t n) {
  const T mx = row_max(row, n);
  T sum = exp_shift(row, n, mx);
  const T inv = T(1) / sum;
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) row[j] *= inv;
  return mx + std::log(sum);
}

// Conversions between float32 and bf16/fp16 on 8 values at a time (AVX2, F16C), with the
// same results as c10's scalar ones: bf16 widening is a shift, narrowing rounds to nearest
// even (NaN -> 0x7FC0); fp16 rounds to nearest even (the F16C instructions). c10's scalar
// conversion, the fallback, is one value at a time.
bool cpu_has_f16c() {
  __builtin_cpu_init();
  return g_has_avx2 && __builtin_cpu_supports("f16c");
}
const bool g_has_f16c = cpu_has_f16c();

__attribute__((target("avx2,f16c"))) void widen_avx2(const void* src, at::ScalarType from,
                                                    float* dst, int64_t n) {
  const auto* a = static_cast<const uint16_t*>(src);
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + e));
    const __m256 y = from == at::kBFloat16
                         ? _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16))
                         : _mm256_cvtph_ps(x);
    _mm256_storeu_ps(dst + e, y);
  }
  for (; e < n; ++e)
    dst[e] = from == at::kBFloat16 ? static_cast<float>(static_cast<const c10::BFloat16*>(src)[e])
                                   : static_cast<float>(static_cast<const c10::Half*>(src)[e]);
}

__attribute__((target("avx2,f16c"))) void narrow_avx2(const float* src, void* dst,
                                                     at::ScalarType to, int64_t n) {
  auto* b = static_cast<uint16_t*>(dst);
  int64_t e = 0;
  for (; e + 8 <= n; e += 8) {
    const __m256 f = _mm256_loadu_ps(src + e);
    __m128i y;
    if (to == at::kBFloat16) {
      const __m256i u = _mm256_castps_si256(f);
      const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
      __m256i r = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
      r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0),
                             _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q)));
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
      y = _mm256_castsi256_si128(packed);
    } else {
      y = _mm256_cvtps_ph(f, _MM_FROUND_TO_NEAREST_INT);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b + e), y);
  }
  for (; e < n; ++e) {
    if (to == at::kBFloat16)
      static_cast<c10::BFloat16*>(dst)[e] = c10::BFloat16(src[e]);
    else
      static_cast<c10::Half*>(dst)[e] = c10::Half(src[e]);
  }
}

// n values of src as T in dst: a copy when In = T; bf16/fp16 widened to float32.
template <typename T, typename In>
inline void widen(T* __restrict__ dst, const In* __restrict__ src, int64_t n) {
  if constexpr (std::is_same<In, T>::value) {
    std::copy(src, src + n, dst);
  } else {
    static_assert(std::is_same<T, float>::value, "bf16/fp16 are computed in float32");
    constexpr bool bf16 = std::is_same<In, c10::BFloat16>::value;
    if (g_has_f16c) return widen_avx2(src, bf16 ? at::kBFloat16 : at::kHalf, dst, n);
    for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<float>(src[e]);
  }
}

// rows x d values of src (row stride ld) as T: src itself when In = T (*ld_out = ld), else
// widened into buf (*ld_out = d). The phases read bf16/fp16 q, k, v through it a tile or a
// row at a time (no float32 copies of the whole inputs).
// With pack, rows apart (ld > d) are copied too (*ld_out = d), for a GEMM operand of few
// rows: the router's 128 queries, rows of the qkv projection 3 C apart (9 KB at C = 768),
// span 1.2 MB and a page every other row, their copy 32 KB.
template <typename T, typename In>
inline const T* rows_as_compute(const In* src, int64_t rows, int64_t d, int64_t ld,
                                std::vector<T>& buf, int64_t* ld_out, bool pack = false) {
  if constexpr (std::is_same<In, T>::value) {
    if (!pack || ld == d) {
      *ld_out = ld;
      return src;
    }
  }
  if (static_cast<int64_t>(buf.size()) < rows * d) buf.resize(rows * d);
  // widened, or copied (packed) when In = T
  for (int64_t r = 0; r < rows; ++r) widen(buf.data() + r * d, src + r * ld, d);
  *ld_out = d;
  return buf.data();
}

// Set by the tests to run the torch::mm fallback of gemm (used where BLAS is not linked).
bool g_torch_mm_only = false;

template <typename T>
torch::TensorOptions options_of() {
  return torch::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
}

// Row-major C[m, n] = alpha op(A) op(B) (+ C if accumulate) with op(A) [m, k], op(B) [k, n];
// a_t: A is stored [k, m] (lda its row stride), b_t: B is stored [n, k]. (Column-major BLAS
// computes C^T.)
template <typename T>
void gemm(bool a_t, bool b_t, int64_t m, int64_t n, int64_t k, const T* A, int64_t lda,
          const T* B, int64_t ldb, T* C, int64_t ldc, bool accumulate = false, T alpha = 1) {
  constexpr bool is_float = std::is_same<T, float>::value;
  if (!g_torch_mm_only && ((is_float && sgemm_) || (!is_float && dgemm_))) {
    const int mi = m, ni = n, ki = k, la = lda, lb = ldb, lc = ldc;
    const char ta = a_t ? 'T' : 'N', tb = b_t ? 'T' : 'N';
    const T beta = accumulate ? 1 : 0;
    if constexpr (is_float) {
      sgemm_(&tb, &ta, &ni, &mi, &ki, &alpha, B, &lb, A, &la, &beta, C, &lc);
    } else {
      dgemm_(&tb, &ta, &ni, &mi, &ki, &alpha, B, &lb, A, &la, &beta, C, &lc);
    }
    return;
  }
  const auto opts = options_of<T>();
  auto blob = [&](const T* x, int64_t rows, int64_t cols, int64_t ld, bool t) {
    auto x2 = torch::from_blob(const_cast<T*>(x), {t ? cols : rows, t ? rows : cols},
                               {ld, 1}, opts);
    return t ? x2.t() : x2;
  };
  auto c = torch::from_blob(C, {m, n}, {ldc, 1}, opts);
  c.addmm_(blob(A, m, k, lda, a_t), blob(B, k, n, ldb, b_t), accumulate ? 1 : 0, alpha);
}

// Asks for the row x[0..d) in cache ahead of its use: rows read in a data-dependent order
// (an expert's keys, its queries) are cache misses the hardware prefetcher cannot foresee;
// the gathers below ask kAhead rows ahead.
constexpr int64_t kAhead = 8;
template <int kWrite = 0, typename T>
inline void prefetch_row(const T* x, int64_t d) {
  const char* p = reinterpret_cast<const char*>(x);
  for (int64_t c = 0; c < d * static_cast<int64_t>(sizeof(T)); c += 64)
    __builtin_prefetch(p + c, kWrite);
}

// ---- bf16/fp16 GEMMs with float32 accumulation on the matrix units (AMX): oneDNN's brgemm
// micro-kernels through at::native::cpublas::brgemm, as PyTorch's CPU flash attention calls them.
// For bf16/fp16 inputs only the read-out GEMMs take them: V_R += exp(S - max) V (phase 2) and
// the routed logits q K_e^T and read-out P V_e (phase 5), with P rounded to the inputs' dtype as
// FlashAttention does; in the backward, phase B's five routed GEMMs (q K_e^T, dout V_e^T, dS^T
// q, P^T dout, dS K_e, with P and dS rounded). The GEMMs that decide the routing (S = R K^T, Ls =
// q R^T) stay float32 (R is float32: rounding it would move the top-k and the argmax), and so do
// softmax, log-sum-exp, top-k and the merge.
//
// oneDNN's kernel reads B in the layout of the kernel it generates for this CPU, which cpublas
// does not say: pairs of rows interleaved (VNNI: bf16 on AVX512-BF16), AMX tiles (made by
// cpublas::pack where cpublas::could_pack), or plain rows (fp16 on AVX512-FP16 without
// AMX-FP16). So each layout is *probed*: a product of distinct values on an odd shape (k odd,
// so padded; a second column block of another width; two row blocks; accumulation), computed
// through pack_b and lowp_gemm exactly as the kernels call them and compared with the float32
// product, which it must equal bit for bit (small integers and halves: exact in bf16, fp16 and
// float32). A wrong layout changes almost every entry; a kernel that cannot be generated
// throws. The first layout that passes is the path (kLowpPacked, then kLowpVnni, then
// kLowpRows); none passing, oneDNN's kernel is off for that dtype. cpublas's plain GEMM
// (kLowpPlain, B in rows, is_vnni false) is probed too.
//
// MITA_CPU_BF16_GEMM=1 turns the path on: the probed oneDNN layout, else cpublas's plain GEMM
// (slow, for testing the path on any CPU; mita_seg.ops.fused_cpu warns, saying why), else
// none; unset or =0: off, the float32 GEMMs on the widened inputs. They are the faster ones
// on every CPU measured: with AVX512-BF16 and no AMX (AMD Zen 4) oneDNN's bf16 kernel ran no
// faster than MKL's float32 GEMMs at these small shapes, and on an AMX Xeon the tiles ran the
// forward 4-6% slower at N = 1025 and level at 4097, forward+backward 2-8% slower (per-call
// cost and packing eat the gain; docs/benchmark.md). A path is never chosen whose probe
// failed. _C.lowp_probe(dtype) reports each layout's result. ----
enum LowpPath : int { kLowpOff = 0, kLowpPlain = 1, kLowpPacked = 2, kLowpVnni = 3, kLowpRows = 4 };
constexpr LowpPath kLowpLayouts[] = {kLowpPlain, kLowpPacked, kLowpVnni, kLowpRows};

inline bool lowp_native(LowpPath path) { return path >= kLowpPacked; }

inline const char* lowp_name(LowpPath path) {
  switch (path) {
    case kLowpPlain: return "cpublas";
    case kLowpPacked: return "brgemm-packed";
    case kLowpVnni: return "brgemm-vnni";
    case kLowpRows: return "brgemm-rows";
    default: return "float32";
  }
}

template <typename In>
constexpr bool is_lowp = std::is_same<In, c10::BFloat16>::value ||
                         std::is_same<In, c10::Half>::value;

template <typename In>
void lowp_gemm(LowpPath path, int64_t m, int64_t n, int64_t kp, const In* A, int64_t lda,
               const In* B, float* C, int64_t ldc, bool accumulate);
template <typename In, typename Row>
void pack_b(LowpPath path, bool b_t, int64_t k, int64_t n, const Row& row, std::vector<In>& out,
            std::vector<In>& tmp);

// The probe of one path for inputs of type In: "ok", "wrong results (...)", "error: ..." or
// "not tried: ..." (see above).
template <typename In>
std::string probe_lowp(LowpPath path) {
  const at::ScalarType dtype = c10::CppTypeToScalarType<In>::value;
  if (path == kLowpPacked && !at::native::cpublas::could_pack(dtype))
    return "not tried: cpublas::could_pack is false for this dtype (no AMX for it)";
  constexpr int64_t m = 37, k = 7, n = 70, kp = 8;  // two row blocks of lowp_gemm, k odd,
  // column blocks of 64 and 6
  auto a_val = [](int64_t i, int64_t r) { return float((i * 5 + r * 3) % 9 - 4); };
  auto b_val = [](int64_t r, int64_t c) { return float((r * 7 + c * 11) % 13 - 6) * 0.5f; };
  std::vector<In> A(m * kp, In(0.f)), rows(k * n), cols(n * k), packed, tmp;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < k; ++r) A[i * kp + r] = In(a_val(i, r));
  for (int64_t r = 0; r < k; ++r)
    for (int64_t c = 0; c < n; ++c) rows[r * n + c] = cols[c * k + r] = In(b_val(r, c));
  float worst = 0;
  int64_t wrong = 0;
  try {
    for (const bool b_t : {false, true}) {  // both ways pack_b reads B
      if (b_t)
        pack_b<In>(path, true, k, n, [&](int64_t c) { return cols.data() + c * k; }, packed, tmp);
      else
        pack_b<In>(path, false, k, n, [&](int64_t r) { return rows.data() + r * n; }, packed,
                   tmp);
      std::vector<float> C(m * n, 1.f);
      lowp_gemm<In>(path, m, n, kp, A.data(), kp, packed.data(), C.data(), n, b_t);
      if (lowp_native(path)) at::native::cpublas::brgemm_release(true);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t c = 0; c < n; ++c) {
          float want = b_t ? 1.f : 0.f;  // accumulate onto ones when b_t
          for (int64_t r = 0; r < k; ++r) want += a_val(i, r) * b_val(r, c);
          const float err = std::abs(C[i * n + c] - want);
          wrong += err != 0.f;
          worst = std::max(worst, err);
        }
    }
  } catch (const std::exception& e) {  // c10::Error, or oneDNN's "could not generate a kernel"
    std::string what = e.what();
    return "error: " + what.substr(0, what.find('\n'));
  }
  if (wrong == 0) return "ok";
  return "wrong results (" + std::to_string(wrong) + " of " + std::to_string(2 * m * n) +
         " entries of a [37, 7] x [7, 70] product, max error " + std::to_string(worst) + ")";
}

template <typename In>
struct LowpProbe {
  std::vector<std::pair<LowpPath, std::string>> results;  // every path, in kLowpLayouts order
  LowpPath native = kLowpOff;  // the first oneDNN layout that passed
  bool plain = false;          // cpublas's plain GEMM passed
  LowpProbe() {
    for (LowpPath path : kLowpLayouts) {
      results.emplace_back(path, probe_lowp<In>(path));
      const bool ok = results.back().second == "ok";
      if (path == kLowpPlain) plain = ok;
      else if (ok && native == kLowpOff) native = path;
    }
  }
};

template <typename In>
const LowpProbe<In>& lowp_probe() {
  static const LowpProbe<In> probe;
  return probe;
}

// The path of this call's GEMMs for inputs of type In (read each call: tests switch it). Off,
// the probes do not run (they generate oneDNN kernels): only a path that may run is probed.
template <typename In>
LowpPath lowp_path() {
  if constexpr (!is_lowp<In>) {
    return kLowpOff;
  } else {
    const char* env = std::getenv("MITA_CPU_BF16_GEMM");
    if (!(env && *env) || std::string(env) == "0") return kLowpOff;
    const LowpProbe<In>& probe = lowp_probe<In>();
    if (probe.native != kLowpOff) return probe.native;
    return probe.plain ? kLowpPlain : kLowpOff;  // mita_seg.ops.fused_cpu says why
  }
}

// dst[0 .. n) = src[0 .. n) rounded to In (nearest even, as c10).
template <typename In>
inline void narrow(In* dst, const float* src, int64_t n) {
  if (g_has_f16c)
    return narrow_avx2(src, dst, c10::CppTypeToScalarType<In>::value, n);
  for (int64_t e = 0; e < n; ++e) dst[e] = static_cast<In>(src[e]);
}

// Rows [0, rows) of x [rows, n] (row stride ldx, float32) rounded into dst [rows, np], np = n
// rounded up to even, the padding column zero: the A operand of lowp_gemm.
template <typename In>
void narrow_rows(In* dst, const float* x, int64_t rows, int64_t n, int64_t ldx, int64_t np) {
  for (int64_t i = 0; i < rows; ++i) {
    narrow(dst + i * np, x + i * ldx, n);
    if (np > n) dst[i * np + n] = In(0.f);
  }
}

// x [rows, cols] (float32, row stride cols) transposed and rounded into dst [cols, rp], rp =
// rows rounded up to even, the padding column zero: a transposed A operand of lowp_gemm.
template <typename In>
void narrow_transposed(std::vector<In>& dst, const float* x, int64_t rows, int64_t cols,
                       int64_t rp) {
  dst.resize(cols * rp);
  for (int64_t j = 0; j < cols; ++j) {
    In* o = dst.data() + j * rp;
    for (int64_t i = 0; i < rows; ++i) o[i] = static_cast<In>(x[i * cols + j]);
    if (rp > rows) o[rows] = In(0.f);
  }
}

// lowp_gemm's B operand: blocks of kBlockN columns, each [kp][ld] (ld = its width rounded up
// to 16: the leading dimensions oneDNN's AMX packing takes, 16 to 64), block c0 at kp * c0.
constexpr int64_t kBlockN = 64;
inline int64_t packed_ld(int64_t nb) { return (nb + 15) / 16 * 16; }

// op(B) [k, n] as lowp_gemm's B operand in out: k rounded up to even (kp) with zero rows,
// each column block [kp][ld] with zero padding columns, in the path's layout: interleaved
// ([kp/2][ld][2], kLowpVnni), cpublas::pack of the row-major block (kLowpPacked, as PyTorch's
// flash attention packs whole blocks), else row-major (kLowpRows, kLowpPlain).
// b_t: row(c) is column c of op(B) (k values: an expert's key c for K_e^T); else row(r) is
// its row r (n values: a value row). Rows are read through pointers, so the experts' keys
// and values are gathered and packed in one pass.
template <typename In, typename Row>
void pack_b(LowpPath path, bool b_t, int64_t k, int64_t n, const Row& row, std::vector<In>& out,
            std::vector<In>& tmp) {
  static_assert(sizeof(In) == 2, "bf16/fp16");
  const int64_t kp = (k + 1) / 2 * 2;
  const int64_t size = kp * (n - n % kBlockN + (n % kBlockN ? packed_ld(n % kBlockN) : 0));
  if (static_cast<int64_t>(out.size()) < size) out.resize(size);
  const bool vnni = path == kLowpVnni;      // interleaved here
  const bool repack = path == kLowpPacked;  // row-major blocks in tmp, then pack
  if (repack && static_cast<int64_t>(tmp.size()) < size) tmp.resize(size);
  // the 16-bit patterns: copies, no conversions
  uint16_t* base = reinterpret_cast<uint16_t*>(repack ? tmp.data() : out.data());
  for (int64_t c0 = 0; c0 < n; c0 += kBlockN) {
    const int64_t nb = std::min(kBlockN, n - c0), ld = packed_ld(nb);
    uint16_t* o = base + kp * c0;
    if (ld > nb)  // padding columns
      for (int64_t r = 0; r < kp; ++r)
        std::fill(o + (vnni ? (r / 2) * 2 * ld + 2 * nb + r % 2 : r * ld + nb),
                  o + (vnni ? (r / 2 + 1) * 2 * ld : (r + 1) * ld), 0);
    if (b_t) {  // column c of op(B) is contiguous
      for (int64_t c = 0; c < nb; ++c) {
        if (c + kAhead < nb) prefetch_row(row(c0 + c + kAhead), k);
        const uint16_t* src = reinterpret_cast<const uint16_t*>(row(c0 + c));
        if (vnni) {  // a pair of rows is one 32-bit word of the column
          uint32_t* o32 = reinterpret_cast<uint32_t*>(o) + c;
          for (int64_t r2 = 0; r2 < k / 2; ++r2) {
            uint32_t x;
            std::memcpy(&x, src + 2 * r2, 4);
            o32[r2 * ld] = x;
          }
          if (k % 2) o32[(k / 2) * ld] = src[k - 1];  // little endian: the low half
        } else {
          for (int64_t r = 0; r < k; ++r) o[r * ld + c] = src[r];
          if (k % 2) o[k * ld + c] = 0;
        }
      }
    } else {  // row r of op(B) is contiguous
      for (int64_t r = 0; r < kp; r += vnni ? 2 : 1) {
        const uint16_t* a = r < k ? reinterpret_cast<const uint16_t*>(row(r)) + c0 : nullptr;
        if (vnni) {
          const uint16_t* b = r + 1 < k ? reinterpret_cast<const uint16_t*>(row(r + 1)) + c0
                                        : nullptr;
          uint16_t* dst = o + (r / 2) * 2 * ld;
          for (int64_t c = 0; c < nb; ++c) {
            dst[2 * c] = a ? a[c] : 0;
            dst[2 * c + 1] = b ? b[c] : 0;
          }
        } else if (a) {
          std::copy(a, a + nb, o + r * ld);
        } else {
          std::fill(o + r * ld, o + r * ld + nb, 0);
        }
      }
    }
    if (repack)
      at::native::cpublas::pack(kp, ld, ld, ld, c10::CppTypeToScalarType<In>::value,
                                c10::CppTypeToScalarType<In>::value, tmp.data() + kp * c0,
                                out.data() + kp * c0);
  }
}

// C [m, n] (row stride ldc, float32) (+)= A [m, kp] (row stride lda, In) B, B from pack_b
// (kp even): per column block, in blocks of at most 32 rows (oneDNN generates, and caches per
// thread, a kernel per shape: the shapes stay few however many queries an expert has).
template <typename In>
void lowp_gemm(LowpPath path, int64_t m, int64_t n, int64_t kp, const In* A, int64_t lda,
               const In* B, float* C, int64_t ldc, bool accumulate) {
  constexpr int64_t kRows = 32;
  for (int64_t c0 = 0; c0 < n; c0 += kBlockN) {
    const int64_t nb = std::min(kBlockN, n - c0);
    for (int64_t i = 0; i < m; i += kRows)
      at::native::cpublas::brgemm(std::min(kRows, m - i), nb, kp, lda, packed_ld(nb), ldc,
                                  accumulate, A + i * lda, B + kp * c0, C + i * ldc + c0,
                                  lowp_native(path));
  }
}

// Held by a parallel task that calls lowp_gemm: releases the thread's AMX tile state at its end.
struct BrgemmRelease {
  bool native;
  explicit BrgemmRelease(LowpPath path) : native(lowp_native(path)) {}
  ~BrgemmRelease() {
    if (native) at::native::cpublas::brgemm_release(true);
  }
  BrgemmRelease(const BrgemmRelease&) = delete;
  BrgemmRelease& operator=(const BrgemmRelease&) = delete;
};

// Where MiTA's tokens are: N = prefix + h * w + suffix; the pool is Ph x Pw.
struct Geometry {
  int64_t BH, N, d, h, w, ph, pw, prefix, M, K, R;
};

// The token rows of a [B, H, N, d] tensor whose rows are contiguous (stride 1 in d), by
// (bh, n), bh = b H + h: q, k, v as the module makes them (views of the qkv projection,
// [B, N, 3, H, d] permuted: no copies), the forward's out as [B, N, H, d] (the module's
// [B, N, C]: no transpose after), or [BH, N, d] (H = 1).
template <typename X>
struct Rows {
  X* p;
  int64_t H, sb, sh, ld;  // heads; strides of b, h and n (ld: between a head's rows)

  X* head(int64_t bh) const { return p + (bh / H) * sb + (bh % H) * sh; }
  X* row(int64_t bh, int64_t n) const { return head(bh) + n * ld; }
};

// t [B, H, N, d] or [BH, N, d] with rows_in_place(t)
template <typename X>
Rows<X> rows_of(const torch::Tensor& t) {
  X* p = static_cast<X*>(t.data_ptr());
  const int64_t ld = t.size(-2) > 1 ? t.stride(-2) : t.size(-1);
  if (t.dim() == 3) return {p, 1, t.stride(0), 0, ld};
  return {p, t.size(1), t.stride(0), t.stride(1), ld};
}

// Whether the GEMMs can read t's rows where they are: each row contiguous, rows apart by at
// least d (BLAS's leading dimension; overlapping rows, e.g. expanded, are copied).
inline bool rows_in_place(const torch::Tensor& t) {
  return t.stride(-1) == 1 && (t.size(-2) <= 1 || t.stride(-2) >= t.size(-1));
}

// ---- BEiT's relative position bias (mita_seg/ops/bias.py), never formed as N x N. Tokens
// are [cls, Wh x Ww grid] (prefix 1, grid = window, N = 1 + Wh Ww: checked on entry); the
// bias of query token i towards key token j is table[h, index(i, j)], h = bh % H, with
// (NT = (2Wh - 1)(2Ww - 1) + 3 entries per head; mmseg's relative_position_index)
//   both grid, i at (yi, xi), j at (yj, xj): (yi - yj + Wh - 1)(2Ww - 1) + xi - xj + Ww - 1,
//   cls query: NT - 3, cls key: NT - 2, both: NT - 1.
// The grid case is qpart(i) + kpart(j) (in [0, NT - 3) for all tokens of such a geometry),
// so the keys of an expert are decoded once, not once per query. The landmark means:
// bq [H, M, N] is added to the scores S (before the top-k and softmax(S)), bk [H, N, M] to
// the shared logits (before the router's argmax and the merge).
template <typename T>
struct Bias {
  const T* bq = nullptr;     // [H, M, N] (forward only)
  const T* bk = nullptr;     // [H, N, M] (forward only)
  const T* table = nullptr;  // [H, NT]; null: no bias
  int64_t H = 1, Wh = 0, Ww = 0, NT = 0;

  bool on() const { return table != nullptr; }
  int64_t head(int64_t bh) const { return bh % H; }
  int64_t qpart(int64_t i) const {  // grid query token i >= 1
    const int64_t t = i - 1;
    return (t / Ww + Wh - 1) * (2 * Ww - 1) + t % Ww + Ww - 1;
  }
  int64_t kpart(int64_t j) const {  // grid key token j >= 1 (0 for the cls key: unused)
    const int64_t t = j - 1;
    return j == 0 ? 0 : -((t / Ww) * (2 * Ww - 1) + t % Ww);
  }
  // kp[t] = kpart(keys[t]) for t < K: an expert's keys, decoded once.
  void key_parts(const int64_t* keys, int64_t K, int64_t* kp) const {
    for (int64_t t = 0; t < K; ++t) kp[t] = kpart(keys[t]);
  }
  // f(t, index(i, keys[t])) for t < K, with kp from key_parts.
  template <typename F>
  void for_keys(int64_t i, const int64_t* keys, const int64_t* kp, int64_t K, F&& f) const {
    if (i == 0) {
      for (int64_t t = 0; t < K; ++t) f(t, keys[t] == 0 ? NT - 1 : NT - 3);
      return;
    }
    const int64_t qo = qpart(i);
    for (int64_t t = 0; t < K; ++t) f(t, keys[t] == 0 ? NT - 2 : qo + kp[t]);
  }
  // row[t] += table[h, index(i, keys[t])]: the routed logits of query i.
  void add_routed(T* row, int64_t bh, int64_t i, const int64_t* keys, const int64_t* kp,
                  int64_t K) const {
    const T* tab = table + head(bh) * NT;
    for_keys(i, keys, kp, K, [&](int64_t t, int64_t e) { row[t] += tab[e]; });
  }
};

// ---- Forward phase 1: R[bh, m] = mean of q over the grid bin of landmark m. The bins of
// adaptive_avg_pool2d: rows [floor(i h / Ph), ceil((i + 1) h / Ph)), columns likewise.
// Summed in row-major order and divided by the count, as ATen does.
template <typename T, typename In>
void landmarks_phase(const Rows<const In>& q, T* R, const Geometry& g) {
  PhaseTimer timer(kLandmarks);
  parallel_tasks(0, g.BH * g.M, 4, [&](Tasks& tasks) {
    std::vector<T> row;
    for (int64_t t : tasks) {
      const int64_t bh = t / g.M, m = t % g.M, i = m / g.pw, j = m % g.pw;
      const int64_t r0 = i * g.h / g.ph, r1 = ((i + 1) * g.h + g.ph - 1) / g.ph;
      const int64_t c0 = j * g.w / g.pw, c1 = ((j + 1) * g.w + g.pw - 1) / g.pw;
      T* out = R + t * g.d;
      std::fill(out, out + g.d, T(0));
      for (int64_t r = r0; r < r1; ++r) {  // the bin's tokens of grid row r
        int64_t ld;
        const T* x = rows_as_compute(q.row(bh, g.prefix + r * g.w + c0), c1 - c0, g.d, q.ld,
                                     row, &ld);
        for (int64_t c = 0; c < c1 - c0; ++c) axpy(out, T(1), x + c * ld, g.d);
      }
      const T count = static_cast<T>((r1 - r0) * (c1 - c0));
      for (int64_t c = 0; c < g.d; ++c) out[c] /= count;
    }
  });
}

// Appends (s[j], j0 + j) to cand for the entries s[j] >= t (never NaN); in a tile after
// the first, few entries are. AVX2: 16 compared at a time.
__attribute__((target("avx2"))) void append_at_least_avx2(
    const float* s, int64_t n, float t, int64_t j0, std::vector<std::pair<float, int64_t>>& cand) {
  const __m256 tv = _mm256_set1_ps(t);
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m256 a = _mm256_cmp_ps(_mm256_loadu_ps(s + j), tv, _CMP_GE_OQ);  // NaN: false
    const __m256 b = _mm256_cmp_ps(_mm256_loadu_ps(s + j + 8), tv, _CMP_GE_OQ);
    unsigned mask = _mm256_movemask_ps(a) | (_mm256_movemask_ps(b) << 8);
    for (; mask; mask &= mask - 1) {
      const int64_t i = j + __builtin_ctz(mask);
      cand.emplace_back(s[i], j0 + i);
    }
  }
  for (; j < n; ++j)
    if (s[j] >= t) cand.emplace_back(s[j], j0 + j);
}

template <typename T>
inline void append_at_least(const T* s, int64_t n, T t, int64_t j0,
                            std::vector<std::pair<T, int64_t>>& cand) {
  if constexpr (std::is_same<T, float>::value) {
    if (g_has_avx2) return append_at_least_avx2(s, n, t, j0, cand);
  }
  for (int64_t j = 0; j < n; ++j)
    if (s[j] >= t) cand.emplace_back(s[j], j0 + j);
}

// The K largest entries of a row s[0..n), fed in tiles (their indices, ascending), by
// selection, not sorting. Each tile's entries >= the bound go to the candidates; the bound
// is the K-th largest candidate once K are kept (an entry below it cannot be among the K
// largest). Before that, a tile gets a bound of its own: the maxima of 2K disjoint runs of
// the tile have K of their number >= their K-th largest t, so the tile's K largest entries
// (all an entry of the tile can be) are >= t; typically ~2K candidates pass. Candidates are
// pruned to the K largest (nth_element) after the first tile that brings K, and whenever
// they reach 4K. NaN scores are never selected while K others are available (a tile that
// leaves fewer than K candidates adds all its entries, NaN as -inf).
template <typename T>
struct TopK {
  std::vector<std::pair<T, int64_t>> cand;
  std::vector<T> maxima;
  T bound;
  bool bounded;
  int64_t K;

  void start(int64_t k) {
    cand.clear();
    bound = -std::numeric_limits<T>::infinity();
    bounded = false;
    K = k;
  }

  void feed(const T* s, int64_t n, int64_t j0) {  // entries s[0..n) are j0 .. j0 + n
    const size_t before = cand.size();
    T t = bound;
    const int64_t runs = 2 * K;
    if (!bounded && runs * 4 <= n) {
      maxima.resize(runs);
      for (int64_t r = 0; r < runs; ++r)
        maxima[r] = row_max(s + r * n / runs, (r + 1) * n / runs - r * n / runs);
      std::nth_element(maxima.begin(), maxima.begin() + (K - 1), maxima.end(),
                       std::greater<T>());
      t = std::max(t, maxima[K - 1]);
    }
    append_at_least(s, n, t, j0, cand);
    if (static_cast<int64_t>(cand.size()) < K) {  // small tile, or NaNs / -inf everywhere
      cand.resize(before);
      for (int64_t j = 0; j < n; ++j)
        cand.emplace_back(std::isnan(s[j]) ? -std::numeric_limits<T>::infinity() : s[j],
                          j0 + j);
    }
    const int64_t c = cand.size();
    if (c >= 4 * K || (!bounded && c >= K)) prune();
  }

  void prune() {  // keep the K largest; the K-th of them is the bound from now on
    std::nth_element(cand.begin(), cand.begin() + (K - 1), cand.end(),
                     [](const std::pair<T, int64_t>& a, const std::pair<T, int64_t>& b) {
                       return a.first > b.first;
                     });
    cand.resize(K);
    bound = cand[K - 1].first;
    bounded = true;
  }

  void finish(int64_t* out) {  // the K indices, ascending (at least K entries were fed)
    if (static_cast<int64_t>(cand.size()) > K) prune();
    for (int64_t j = 0; j < K; ++j) out[j] = cand[j].second;
    std::sort(out, out + K);  // the same for any tiling; and the gathers read keys in order
  }
};

// Tasks over landmarks (forward phase 2, backward D): (blocks per bh, landmarks per block).
// Blocks of at most `most` landmarks, of equal size; smaller blocks only when there are too
// few tasks for the threads. Each block streams K and V once (and MKL packs K^T once per
// block): the forward, whose scores are tiled, takes all M = 49 landmarks in one block (at
// N = 16385 its GEMMs ran at half their in-cache speed with two blocks of 25 reading K, V
// from memory twice); the backward's untiled [LB, N] rows take blocks of up to 32 (25 + 24).
std::pair<int64_t, int64_t> landmark_blocks(const Geometry& g, int64_t most) {
  int64_t blocks = (g.M + most - 1) / most;
  while (blocks < g.M && g.BH * blocks < 2 * at::get_num_threads()) ++blocks;
  const int64_t LB = (g.M + blocks - 1) / blocks;
  return {(g.M + LB - 1) / LB, LB};  // none empty
}

// ---- Forward phase 2: per (bh, block of LB landmarks): scores, top-k, shared values, in
// tiles of TN keys so that the block's scores stay in L2 (and K, V are read from memory once
// per head: all 49 landmarks in one block): S_t = (R / sqrt(d)) K_t^T [LB, TN],
// each row's top-k fed tile by tile, and V_R = softmax(S) V by an online softmax (running
// max and sum per row, the accumulator rescaled when the max grows; FlashAttention's).
// probs: [BH, M, N] softmax(S) saved for the backward (one tile: the whole row, normalised
// at the end), or null. With a bias, S += bq[h] (the landmarks' mean bias) before the top-k
// and the softmax.
template <typename T, typename In>
void experts_phase(const Rows<const In>& k, const Rows<const In>& v, const T* R, int64_t* keys,
                   T* probs, T* vr,
                   bool shared, const Bias<T>& bias, const Geometry& g, LowpPath lp) {
  PhaseTimer timer(kExperts);
  const auto [blocks, LB] = landmark_blocks(g, probs ? 32 : 64);
  // tiles of about 1024 keys, of equal size ([49, 1024] scores: 200 KB; N = 1025 one tile)
  const int64_t tiles = probs ? 1 : std::max<int64_t>(1, (g.N + 512) / 1024);
  const int64_t TN = (g.N + tiles - 1) / tiles, d = g.d;
  const T scale = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
  const T neg_inf = -std::numeric_limits<T>::infinity();
  parallel_tasks(0, g.BH * blocks, 1, [&](Tasks& tasks) {
    SerialBlas serial_blas;
    std::vector<T> rc(LB * d), local(probs ? 0 : LB * TN), mx(LB), sum(LB), acc(LB * d), kv;
    std::vector<TopK<T>> top(LB);
    std::vector<In> pb, vpk, tmp;  // bf16/fp16 GEMM: exp(S_t - max) rounded, V_t packed
    BrgemmRelease release(lp);
    for (int64_t t : tasks) {
      const int64_t bh = t / blocks, m0 = (t % blocks) * LB, L = std::min(g.M, m0 + LB) - m0;
      const T* r = R + (bh * g.M + m0) * d;
      const In* kb = k.head(bh);
      const In* vb = v.head(bh);
      for (int64_t c = 0; c < L * d; ++c) rc[c] = r[c] * scale;  // (R / sqrt(d)) as ATen
      for (int64_t l = 0; l < L; ++l) top[l].start(g.K);
      std::fill(mx.begin(), mx.end(), neg_inf);
      std::fill(sum.begin(), sum.end(), T(0));
      for (int64_t j0 = 0; j0 < g.N; j0 += TN) {
        const int64_t n = std::min(g.N, j0 + TN) - j0;
        T* s = probs ? probs + (bh * g.M + m0) * g.N : local.data();  // [L, n], row stride n
        int64_t ld;
        const T* kt = rows_as_compute(kb + j0 * k.ld, n, d, k.ld, kv, &ld);
        gemm(false, true, L, n, d, rc.data(), d, kt, ld, s, n);
        if (bias.on())  // S [L, n] += bq[h, m0 .. m0 + L, j0 .. j0 + n]
          for (int64_t l = 0; l < L; ++l)
            axpy(s + l * n, T(1), bias.bq + (bias.head(bh) * g.M + m0 + l) * g.N + j0, n);
        for (int64_t l = 0; l < L; ++l) {
          T* row = s + l * n;
          top[l].feed(row, n, j0);
          if (!shared) continue;
          const T m = std::max(mx[l], row_max(row, n));
          if (m == neg_inf) {  // no finite score yet: this tile weighs nothing
            std::fill(row, row + n, T(0));
            continue;
          }
          if (m > mx[l] && j0 > 0) {  // rescale what the earlier tiles summed
            const T f = std::exp(mx[l] - m);
            sum[l] *= f;
            for (int64_t c = 0; c < d; ++c) acc[l * d + c] *= f;
          }
          mx[l] = m;
          sum[l] += exp_shift(row, n, m);
        }
        if (!shared) continue;  // acc [L, d] (+)= exp(S_t - max) V_t
        if constexpr (is_lowp<In>) {
          if (lp != kLowpOff) {
            const int64_t np = (n + 1) / 2 * 2;
            pb.resize(L * np);
            narrow_rows(pb.data(), s, L, n, n, np);
            pack_b(lp, false, n, d, [&](int64_t r) { return vb + (j0 + r) * v.ld; }, vpk, tmp);
            lowp_gemm(lp, L, d, np, pb.data(), np, vpk.data(), acc.data(), d, j0 > 0);
            continue;
          }
        }
        const T* vt = rows_as_compute(vb + j0 * v.ld, n, d, v.ld, kv, &ld);
        gemm(false, false, L, d, n, s, n, vt, ld, acc.data(), d, j0 > 0);
      }
      for (int64_t l = 0; l < L; ++l) {
        top[l].finish(keys + (bh * g.M + m0 + l) * g.K);
        if (!shared) continue;
        const T inv = T(1) / sum[l];
        T* o = vr + (bh * g.M + m0 + l) * d;
        for (int64_t c = 0; c < d; ++c) o[c] = acc[l * d + c] * inv;
        if (probs) {  // the saved softmax(S), normalised
          T* p = probs + (bh * g.M + m0 + l) * g.N;
#pragma omp simd
          for (int64_t j = 0; j < g.N; ++j) p[j] *= inv;
        }
      }
    }
  });
}

// ---- Forward phase 3: per (bh, chunk of CH queries): the shared logits Ls = q (R *
// shared_scale)^T (+ bk[h] with a bias) [CH, M] (into ls where the backward needs them,
// else a local buffer), each query's choices, and the shared expert's read-out: out =
// softmax(Ls) V_R, lse = its log-sum-exp (-inf without the shared expert, or where every
// shared logit is -inf: out is then not written). Phase 5 (R = 1) or 6 merges the routed
// partials into out and lse.
template <typename T, typename In>
void router_phase(const Rows<const In>& q, const T* R, const T* vr, T* ls, int64_t* choice,
                  const Rows<T>& out, T* lse,
                  T shared_scale, bool shared, const Bias<T>& bias, const Geometry& g) {
  PhaseTimer timer(kRouter);
  constexpr int64_t CH = 128;
  const int64_t chunks = (g.N + CH - 1) / CH, M = g.M, d = g.d;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  parallel_tasks(0, g.BH * chunks, 1, [&](Tasks& tasks) {
    SerialBlas serial_blas;
    std::vector<T> rs(M * d), local(ls ? 0 : CH * M), p(shared ? CH * M : 0), inv(CH), qc;
    std::vector<int64_t> ids(M);
    int64_t rs_of = -1;
    for (int64_t t : tasks) {
      const int64_t bh = t / chunks, n0 = (t % chunks) * CH, G = std::min(g.N, n0 + CH) - n0;
      if (rs_of != bh) {  // R * shared_scale, as ATen computes it
        const T* r = R + bh * M * d;
        for (int64_t c = 0; c < M * d; ++c) rs[c] = r[c] * shared_scale;
        rs_of = bh;
      }
      T* lg = ls ? ls + (bh * g.N + n0) * M : local.data();
      int64_t ldq;
      const T* qt = rows_as_compute(q.row(bh, n0), G, d, q.ld, qc, &ldq, true);
      gemm(false, true, G, M, d, qt, ldq, rs.data(), d, lg, M);
      if (bias.on())  // Ls [G, M] += bk[h, n0 .. n0 + G] (contiguous rows)
        axpy(lg, T(1), bias.bk + (bias.head(bh) * g.N + n0) * M, G * M);
      for (int64_t n = 0; n < G; ++n) {
        const T* row = lg + n * M;
        int64_t* ch = choice + (bh * g.N + n0 + n) * g.R;
        if (g.R == 1) {  // first maximum, as torch.argmax
          int64_t best = 0;
          for (int64_t m = 1; m < M; ++m)
            if (row[m] > row[best]) best = m;
          ch[0] = best;
        } else {
          std::iota(ids.begin(), ids.end(), 0);
          std::partial_sort(ids.begin(), ids.begin() + g.R, ids.end(),
                            [&](int64_t a, int64_t b) { return row[a] > row[b]; });
          std::copy(ids.begin(), ids.begin() + g.R, ch);
        }
      }
      T* ln = lse + bh * g.N + n0;
      if (!shared) {
        std::fill(ln, ln + G, neg_inf);
        continue;
      }
      for (int64_t n = 0; n < G; ++n) {  // P_s = softmax(Ls) (unnormalised; inv = 1 / sum)
        T* pr = p.data() + n * M;
        std::copy(lg + n * M, lg + (n + 1) * M, pr);
        const T m = row_max(pr, M);
        if (m == neg_inf) {  // no shared logit counts: weight 0 in the merge
          std::fill(pr, pr + M, T(0));
          ln[n] = neg_inf;
          inv[n] = 0;
          continue;
        }
        const T s = exp_shift(pr, M, m);
        ln[n] = m + std::log(s);
        inv[n] = T(1) / s;
      }
      T* o = out.row(bh, n0);
      gemm(false, false, G, d, M, p.data(), M, vr + bh * M * d, d, o, out.ld);
      for (int64_t n = 0; n < G; ++n) {
        const T f = inv[n];
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) o[n * out.ld + c] *= f;
      }
    }
  });
}

// ---- Forward phase 4: items (query n, choice c) -> item n * R + c, grouped by expert with
// a counting sort: the items of expert m of batch*head bh are order[bh, offsets[bh, m] ...
// offsets[bh, m + 1]), in increasing item order. offsets: [BH, M + 1], order: [BH, N R].
void group_items(const int64_t* choice, int64_t BH, int64_t NR, int64_t M, int64_t* offsets,
                 int64_t* order) {
  PhaseTimer timer(kGrouping);
  parallel_tasks(0, BH, 1, [&](Tasks& tasks) {
    std::vector<int64_t> pos(M);
    for (int64_t bh : tasks) {
      int64_t* off = offsets + bh * (M + 1);
      const int64_t* ch = choice + bh * NR;
      std::fill(off, off + M + 1, 0);
      for (int64_t i = 0; i < NR; ++i) ++off[ch[i] + 1];
      for (int64_t m = 0; m < M; ++m) off[m + 1] += off[m];
      std::copy(off, off + M, pos.begin());
      int64_t* ord = order + bh * NR;
      for (int64_t i = 0; i < NR; ++i) ord[pos[ch[i]]++] = i;
    }
  });
}

// Copies the rows idx[0..K) of x ([N, d], row stride ld) to dst ([K, d]), as T.
template <typename T, typename In>
inline void gather_rows(T* dst, const In* x, int64_t ld, const int64_t* idx, int64_t K,
                        int64_t d) {
  for (int64_t j = 0; j < std::min(K, kAhead); ++j) prefetch_row(x + idx[j] * ld, d);
  for (int64_t j = 0; j < K; ++j) {
    if (j + kAhead < K) prefetch_row(x + idx[j + kAhead] * ld, d);
    widen(dst + j * d, x + idx[j] * ld, d);
  }
}

// Merges R routed partials (rows part[c * d ...], normalised, log-sum-exp part_lse[c]) into
// a query's output o (normalised, log-sum-exp lse; not read where it weighs nothing: lse =
// -inf): the softmax over all their logits at once. With every logit -inf, NaN as softmax.
template <typename T>
inline void merge_partials(T* o, T* lse, const T* part, const T* part_lse, int64_t R,
                           int64_t d) {
  T m = *lse;
  for (int64_t c = 0; c < R; ++c) m = std::max(m, part_lse[c]);
  const T w0 = std::exp(*lse - m);
  T s = w0;
  if (w0 != 0) {
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) o[c] *= w0;
  } else {
    std::fill(o, o + d, T(0));
  }
  for (int64_t c = 0; c < R; ++c) {
    const T w = std::exp(part_lse[c] - m);
    s += w;
    axpy(o, w, part + c * d, d);
  }
  *lse = m + std::log(s);
  const T inv = T(1) / s;
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) o[c] *= inv;
}

// ---- Forward phase 5: per expert, the softmax over its K keys of each of its items: a
// normalised partial output and its log-sum-exp. With R = 1 merged into the query's out and
// lse at once (each query has one item); with R > 1 written to o_items [BH, N R, d] and
// lse_items [BH, N R] for phase 6. With a bias, each logit gets table[h, index(query, key)].
template <typename T, typename In>
void routed_phase(const Rows<const In>& q, const Rows<const In>& k, const Rows<const In>& v,
                  const int64_t* keys, const int64_t* offsets, const int64_t* order,
                  T* o_items, T* lse_items, const Rows<T>& out, T* lse, T scale,
                  const Bias<T>& bias, const Geometry& g, LowpPath lp) {
  PhaseTimer timer(kRouted);
  const int64_t NR = g.N * g.R, K = g.K, d = g.d, R = g.R;
  parallel_tasks(0, g.BH * g.M, 1, [&](Tasks& tasks) {
    SerialBlas serial_blas;
    const bool lowp = lp != kLowpOff;
    std::vector<T> kloc(lowp ? 0 : K * d), vloc(lowp ? 0 : K * d), qbuf, lbuf, obuf, lsebuf;
    std::vector<int64_t> kp(bias.on() ? K : 0);
    // bf16/fp16 GEMMs: the expert's keys and values as In, packed; its queries; P rounded
    const int64_t dp = (d + 1) / 2 * 2, Kp = (K + 1) / 2 * 2;
    std::vector<In> kpk, vpk, tmp, qb, pb;
    BrgemmRelease release(lp);
    for (int64_t t : tasks) {
      const int64_t bh = t / g.M, m = t % g.M;
      const int64_t* off = offsets + bh * (g.M + 1);
      const int64_t G = off[m + 1] - off[m];
      if (G == 0) continue;
      const int64_t* idx = keys + t * K;
      if (lowp) {
        if constexpr (is_lowp<In>) {  // gathered and packed in one pass: K_e^T, V_e
          const In* kh = k.head(bh);
          const In* vh = v.head(bh);
          pack_b(lp, true, d, K, [&](int64_t c) { return kh + idx[c] * k.ld; }, kpk, tmp);
          pack_b(lp, false, K, d, [&](int64_t r) { return vh + idx[r] * v.ld; }, vpk, tmp);
        }
      } else {
        gather_rows(kloc.data(), k.head(bh), k.ld, idx, K, d);
        gather_rows(vloc.data(), v.head(bh), v.ld, idx, K, d);
      }
      const int64_t* ord = order + bh * NR + off[m];
      qbuf.resize(lowp ? 0 : G * d); lbuf.resize(G * K); obuf.resize(G * d); lsebuf.resize(G);
      T* qp = qbuf.data();
      T* lg = lbuf.data();
      const In* qs = q.head(bh);
      const int64_t lq = q.ld;
      for (int64_t i = 0; i < std::min(G, kAhead); ++i) prefetch_row(qs + ord[i] / R * lq, d);
      if (lowp) {  // the queries' rows as they are (d padded to even), the scale after
        qb.resize(G * dp);
        for (int64_t i = 0; i < G; ++i) {
          if (i + kAhead < G) prefetch_row(qs + ord[i + kAhead] / R * lq, d);
          std::copy(qs + ord[i] / R * lq, qs + ord[i] / R * lq + d, qb.data() + i * dp);
          if (dp > d) qb[i * dp + d] = In(0.f);
        }
        if constexpr (is_lowp<In>) {
          lowp_gemm(lp, G, K, dp, qb.data(), dp, kpk.data(), lg, K, false);  // logits [G, K]
#pragma omp simd
          for (int64_t e = 0; e < G * K; ++e) lg[e] *= scale;
        }
      } else {
        for (int64_t i = 0; i < G; ++i) {
          if (i + kAhead < G) prefetch_row(qs + ord[i + kAhead] / R * lq, d);
          T* row = qp + i * d;
          widen(row, qs + ord[i] / R * lq, d);
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) row[c] *= scale;
        }
        gemm(false, true, G, K, d, qp, d, kloc.data(), d, lg, K);         // logits [G, K]
      }
      if (bias.on()) {
        bias.key_parts(idx, K, kp.data());
        for (int64_t i = 0; i < G; ++i)
          bias.add_routed(lg + i * K, bh, ord[i] / R, idx, kp.data(), K);
      }
      for (int64_t i = 0; i < G; ++i) lsebuf[i] = softmax_row(lg + i * K, K);
      T* op = obuf.data();
      if constexpr (is_lowp<In>) {
        if (lowp) {  // P rounded to In
          pb.resize(G * Kp);
          narrow_rows(pb.data(), lg, G, K, K, Kp);
          lowp_gemm(lp, G, d, Kp, pb.data(), Kp, vpk.data(), op, d, false);  // [G, d]
        }
      }
      if (!lowp) gemm(false, false, G, d, K, lg, K, vloc.data(), d, op, d);  // [G, d]
      if (R == 1)  // item = query
        for (int64_t i = 0; i < std::min(G, kAhead); ++i)
          prefetch_row<1>(out.row(bh, ord[i]), d);
      for (int64_t i = 0; i < G; ++i) {
        const int64_t item = bh * NR + ord[i];
        if (R == 1) {
          if (i + kAhead < G) prefetch_row<1>(out.row(bh, ord[i + kAhead]), d);
          merge_partials(out.row(bh, ord[i]), lse + item, op + i * d, &lsebuf[i], 1, d);
        } else {
          std::copy(op + i * d, op + i * d + d, o_items + item * d);
          lse_items[item] = lsebuf[i];
        }
      }
    }
  });
}

// ---- Forward phase 6 (R > 1): each query's R routed partials merged into its output.
template <typename T>
void merge_phase(const T* o_items, const T* lse_items, const Rows<T>& out, T* lse,
                 const Geometry& g) {
  PhaseTimer timer(kMerge);
  const int64_t R = g.R, d = g.d;
  parallel_tasks(0, g.BH * g.N, 256, [&](Tasks& tasks) {
    for (int64_t i : tasks)
      merge_partials(out.row(i / g.N, i % g.N), lse + i, o_items + i * R * d,
                     lse_items + i * R, R, d);
  });
}

// ---- Backward phase A, per bh (it owns dV_R[bh]), in chunks of queries:
// delta = rowsum(dout * out) - dlse (dlse: the gradient of lse, or null for none; d lse /
// d logit = P, so it enters every logit's gradient P (dP - delta) through delta, as in
// FlashAttention's backward); with the shared expert, P_s = exp(Ls - lse),
// dLs = P_s (dout V_R^T - delta) and dV_R = P_s^T dout.
template <typename T>
void shared_backward_phase(const T* dout, const T* out, const T* lse, const T* dlse,
                           const T* ls, const T* vr, T* delta, T* dls, T* dvr, bool shared,
                           const Geometry& g) {
  PhaseTimer timer(kBwdShared);
  constexpr int64_t CH = 128;  // queries per chunk
  const int64_t N = g.N, M = g.M, d = g.d;
  parallel_tasks(0, g.BH, 1, [&](Tasks& tasks) {
    SerialBlas serial_blas;
    std::vector<T> p(shared ? CH * M : 1), dp(shared ? CH * M : 1);
    for (int64_t bh : tasks) {
      for (int64_t n0 = 0; n0 < N; n0 += CH) {
        const int64_t G = std::min(N, n0 + CH) - n0, i0 = bh * N + n0;
        for (int64_t i = i0; i < i0 + G; ++i)
          delta[i] = dot(dout + i * d, out + i * d, d) - (dlse ? dlse[i] : T(0));
        if (!shared) continue;
        gemm(false, true, G, M, d, dout + i0 * d, d, vr + bh * M * d, d, dp.data(), M);
        for (int64_t n = 0; n < G; ++n) {
          const int64_t i = i0 + n;
          T* pr = p.data() + n * M;
          const T* dpr = dp.data() + n * M;
          T* dl = dls + i * M;
          std::copy(ls + i * M, ls + (i + 1) * M, pr);
          exp_shift(pr, M, lse[i]);
          const T D = delta[i];
#pragma omp simd
          for (int64_t j = 0; j < M; ++j) dl[j] = pr[j] * (dpr[j] - D);
        }
        gemm(true, false, M, d, G, p.data(), M, dout + i0 * d, d, dvr + bh * M * d, d,
             n0 > 0);                                                  // dV_R += P_s^T dout
      }
    }
  });
}

// ---- Backward phase B: per expert, dQ of its items (dq_items, row = item) and dK, dV of
// its K keys (dk_exp, dv_exp: [BH, M, K, d]). With a bias, the recomputed logits get it
// too, and the logits' gradients are kept for phase C in dl_sorted ([BH, N R, K], row =
// the item's position in order: expert m's rows are offsets[m] .. offsets[m + 1]).
// With bf16/fp16 inputs and lp on, the five GEMMs run on lowp_gemm as the forward's
// read-out does (FlashAttention's backward: In operands, float32 accumulation): q, dout and
// the expert's keys and values as they came in (q_in, k_in, v_in, dout_in), P and dS rounded
// to In; exp, dS = P (dP - delta) and the scaling in float32. Otherwise float32 GEMMs on the
// widened q, k, v, dout.
template <typename T, typename In>
void routed_backward_phase(const T* q, const T* k, const T* v, const In* q_in, const In* k_in,
                           const In* v_in, const In* dout_in, const int64_t* keys,
                           const int64_t* offsets, const int64_t* order, const T* dout,
                           const T* lse, const T* delta, T* dq_items, T* dk_exp, T* dv_exp,
                           T* dl_sorted, T scale, const Bias<T>& bias, const Geometry& g,
                           LowpPath lp) {
  PhaseTimer timer(kBwdRouted);
  const int64_t NR = g.N * g.R, K = g.K, d = g.d, R = g.R;
  parallel_tasks(0, g.BH * g.M, 1, [&](Tasks& tasks) {
    SerialBlas serial_blas;
    const bool lowp = lp != kLowpOff;
    std::vector<T> kloc(lowp ? 0 : K * d), vloc(lowp ? 0 : K * d), qbuf, dobuf, pbuf, dsbuf,
        dqbuf;
    std::vector<int64_t> kp(bias.on() ? K : 0);
    // bf16/fp16: K_e^T, V_e^T, K_e, the items' q and dout rows packed as B operands; the
    // items' q and dout rows as A operands; P, dS (and their transposes) rounded
    const int64_t dp = (d + 1) / 2 * 2, Kp = (K + 1) / 2 * 2;
    std::vector<In> kt_pk, vt_pk, k_pk, q_pk, do_pk, tmp, qa, doa, pa, dsa;
    BrgemmRelease release(lp);
    for (int64_t t : tasks) {
      const int64_t bh = t / g.M, m = t % g.M;
      const int64_t* off = offsets + bh * (g.M + 1);
      const int64_t G = off[m + 1] - off[m];
      if (G == 0) continue;  // phase C skips this expert
      const int64_t* idx = keys + t * K;
      const int64_t* ord = order + bh * NR + off[m];
      auto item_row = [&](int64_t i) { return bh * g.N + ord[i] / R; };
      pbuf.resize(G * K); dsbuf.resize(G * K); dqbuf.resize(G * d);
      T *pp = pbuf.data(), *dsp = dsbuf.data(), *dqp = dqbuf.data();
      T* dke = dk_exp + t * K * d;
      T* dve = dv_exp + t * K * d;
      if (lowp) {
        if constexpr (is_lowp<In> && std::is_same<T, float>::value) {
          const In* kh = k_in + bh * g.N * d;
          const In* vh = v_in + bh * g.N * d;
          auto key = [&](int64_t c) { return kh + idx[c] * d; };
          pack_b(lp, true, d, K, key, kt_pk, tmp);                                // K_e^T
          pack_b(lp, true, d, K, [&](int64_t c) { return vh + idx[c] * d; }, vt_pk, tmp);
          pack_b(lp, false, K, d, key, k_pk, tmp);                                // K_e
          qa.resize(G * dp); doa.resize(G * dp);
          for (int64_t i = 0; i < G; ++i) {
            const int64_t row = item_row(i);
            std::copy(q_in + row * d, q_in + row * d + d, qa.data() + i * dp);
            std::copy(dout_in + row * d, dout_in + row * d + d, doa.data() + i * dp);
            if (dp > d) qa[i * dp + d] = doa[i * dp + d] = In(0.f);
          }
          pack_b(lp, false, G, d, [&](int64_t r) { return q_in + item_row(r) * d; }, q_pk,
                 tmp);
          pack_b(lp, false, G, d, [&](int64_t r) { return dout_in + item_row(r) * d; },
                 do_pk, tmp);
          lowp_gemm(lp, G, K, dp, qa.data(), dp, kt_pk.data(), pp, K, false);   // q K_e^T
#pragma omp simd
          for (int64_t e = 0; e < G * K; ++e) pp[e] *= scale;
          lowp_gemm(lp, G, K, dp, doa.data(), dp, vt_pk.data(), dsp, K, false);  // dP
        }
      } else {
        gather_rows(kloc.data(), k + bh * g.N * d, d, idx, K, d);
        gather_rows(vloc.data(), v + bh * g.N * d, d, idx, K, d);
        qbuf.resize(G * d); dobuf.resize(G * d);
        for (int64_t i = 0; i < G; ++i) {
          const int64_t row = item_row(i);
          const T* src = q + row * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) qbuf[i * d + c] = src[c] * scale;
          std::copy(dout + row * d, dout + row * d + d, dobuf.data() + i * d);
        }
        gemm(false, true, G, K, d, qbuf.data(), d, kloc.data(), d, pp, K);   // logits [G, K]
        gemm(false, true, G, K, d, dobuf.data(), d, vloc.data(), d, dsp, K);  // dP [G, K]
      }
      if (bias.on()) {  // the forward's logits: + table[h, index(query, key)]
        bias.key_parts(idx, K, kp.data());
        for (int64_t i = 0; i < G; ++i)
          bias.add_routed(pp + i * K, bh, ord[i] / R, idx, kp.data(), K);
      }
      for (int64_t i = 0; i < G; ++i) {
        const int64_t row = item_row(i);
        T* pr = pp + i * K;
        T* dr = dsp + i * K;
        exp_shift(pr, K, lse[row]);
        const T D = delta[row];
#pragma omp simd
        for (int64_t j = 0; j < K; ++j) dr[j] = pr[j] * (dr[j] - D);
      }
      if (bias.on())  // d(logits) [G, K]: the gradient of each bias entry read
        std::copy(dsp, dsp + G * K, dl_sorted + (bh * NR + off[m]) * K);
      // dK = dS^T (q scale), dV = P^T dout, dQ = dS K (scaled below).
      if (lowp) {
        if constexpr (is_lowp<In> && std::is_same<T, float>::value) {
          const int64_t Gp = (G + 1) / 2 * 2;
          narrow_transposed(pa, pp, G, K, Gp);                           // P^T [K, Gp]
          lowp_gemm(lp, K, d, Gp, pa.data(), Gp, do_pk.data(), dve, d, false);
          narrow_transposed(pa, dsp, G, K, Gp);                          // dS^T [K, Gp]
          lowp_gemm(lp, K, d, Gp, pa.data(), Gp, q_pk.data(), dke, d, false);
#pragma omp simd
          for (int64_t e = 0; e < K * d; ++e) dke[e] *= scale;
          dsa.resize(G * Kp);
          narrow_rows(dsa.data(), dsp, G, K, K, Kp);                     // dS [G, Kp]
          lowp_gemm(lp, G, d, Kp, dsa.data(), Kp, k_pk.data(), dqp, d, false);
        }
      } else {
        gemm(true, false, K, d, G, dsp, K, qbuf.data(), d, dke, d);
        gemm(true, false, K, d, G, pp, K, dobuf.data(), d, dve, d);
        gemm(false, false, G, d, K, dsp, K, kloc.data(), d, dqp, d);
      }
      for (int64_t i = 0; i < G; ++i) {
        T* dst = dq_items + (bh * NR + ord[i]) * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) dst[c] = dqp[i * d + c] * scale;
      }
    }
  });
}

// ---- Backward phase C: dk, dv = sum of the per-expert buffers at the experts' key rows;
// dq = sum over the r choices of dq_items (R > 1 only: with R = 1 they are the same rows).
// With a bias, dtab [BH, NT] = the routed logits' gradients (dl_sorted) scatter-added at
// their table entries, per bh (summed over the batch by the caller): one task per bh and
// a fixed order, so the sums do not depend on the threads.
template <typename T>
void reduce_phase(const int64_t* keys, const int64_t* offsets, const int64_t* order,
                  const T* dk_exp, const T* dv_exp, const T* dq_items, const T* dl_sorted,
                  T* dk, T* dv, T* dq, T* dtab, const Bias<T>& bias, const Geometry& g) {
  PhaseTimer timer(kBwdReduce);
  const int64_t N = g.N, d = g.d, K = g.K, M = g.M, R = g.R, NR = g.N * g.R;
  parallel_tasks(0, g.BH, 1, [&](Tasks& tasks) {
    std::vector<int64_t> kp(bias.on() ? K : 0);
    for (int64_t bh : tasks) {
      if (bias.on()) {
        T* dt = dtab + bh * bias.NT;
        std::fill(dt, dt + bias.NT, T(0));
        const int64_t* off = offsets + bh * (M + 1);
        for (int64_t m = 0; m < M; ++m) {
          if (off[m + 1] == off[m]) continue;
          const int64_t* idx = keys + (bh * M + m) * K;
          bias.key_parts(idx, K, kp.data());
          for (int64_t i = off[m]; i < off[m + 1]; ++i) {
            const T* gr = dl_sorted + (bh * NR + i) * K;
            bias.for_keys(order[bh * NR + i] / R, idx, kp.data(), K,
                          [&](int64_t t, int64_t e) { dt[e] += gr[t]; });
          }
        }
      }
      const int64_t* off = offsets + bh * (M + 1);
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

// ---- Backward, routing part (shared expert only): Ls = s q R^T (s = shared_scale),
// S = c R K^T (c = 1 / sqrt(d)), P = softmax(S), V_R = P V. Given dLs and dV_R:
//   D. per (bh, block of landmarks): dS = c P (dP - rowsum(P dP)) with dP = dV_R V^T
//      ([LB, N], c folded in) and dR = dS K [LB, d]; per bh: dR += s dLs^T q.
//   E. per (bh, chunk of rows): dq += s dLs R, dv += P^T dV_R, dk += dS^T R.
//   F. per (bh, grid row): the grid rows of dq += the adjoint of the pooling of dR.
// With a bias (unscaled_ds), ds holds P (dP - rowsum(P dP)) itself, the gradient of the
// biased scores (that is, of bq: the caller sums it over the batch), and c enters the GEMMs
// that read ds (here and in rows_backward_phase).
template <typename T>
void scores_backward_phase(const T* q, const T* v, const T* k, const T* probs, const T* dvr,
                           const T* dls, T* ds, T* dR, T shared_scale, bool unscaled_ds,
                           const Geometry& g) {
  PhaseTimer timer(kBwdScores);
  const auto [blocks, LB] = landmark_blocks(g, 32);
  const int64_t N = g.N, M = g.M, d = g.d;
  const T c = static_cast<T>(1.0 / std::sqrt(static_cast<double>(d)));
  const T c_in = unscaled_ds ? T(1) : c, c_gemm = unscaled_ds ? c : T(1);
  parallel_tasks(0, g.BH * blocks, 1, [&](Tasks& tasks) {
    SerialBlas serial_blas;
    for (int64_t t : tasks) {
      const int64_t bh = t / blocks, m0 = (t % blocks) * LB, L = std::min(M, m0 + LB) - m0;
      T* dsb = ds + (bh * M + m0) * N;
      gemm(false, true, L, N, d, dvr + (bh * M + m0) * d, d, v + bh * N * d, d, dsb, N);
      for (int64_t l = 0; l < L; ++l) {
        const T* p = probs + (bh * M + m0 + l) * N;
        T* r = dsb + l * N;
        const T D = dot(p, r, N);
#pragma omp simd
        for (int64_t j = 0; j < N; ++j) r[j] = c_in * p[j] * (r[j] - D);
      }
      gemm(false, false, L, d, N, dsb, N, k + bh * N * d, d, dR + (bh * M + m0) * d, d,
           false, c_gemm);
    }
  });
  parallel_tasks(0, g.BH, 1, [&](Tasks& tasks) {
    SerialBlas serial_blas;
    for (int64_t bh : tasks)  // dR += s dLs^T q
      gemm(true, false, M, d, N, dls + bh * N * M, M, q + bh * N * d, d, dR + bh * M * d, d,
           true, shared_scale);
  });
}

template <typename T>
void rows_backward_phase(const T* R, const T* probs, const T* dvr, const T* dls, const T* ds,
                         T* dq, T* dk, T* dv, T shared_scale, bool unscaled_ds,
                         const Geometry& g) {
  PhaseTimer timer(kBwdRows);
  constexpr int64_t CH = 128;
  const int64_t chunks = (g.N + CH - 1) / CH, N = g.N, M = g.M, d = g.d;
  parallel_tasks(0, g.BH * chunks, 1, [&](Tasks& tasks) {
    SerialBlas serial_blas;
    for (int64_t t : tasks) {
      const int64_t bh = t / chunks, n0 = (t % chunks) * CH, G = std::min(N, n0 + CH) - n0;
      const int64_t rows = (bh * N + n0) * d;
      const T* r = R + bh * M * d;
      gemm(false, false, G, d, M, dls + (bh * N + n0) * M, M, r, d, dq + rows, d, true,
           shared_scale);                                              // dq += s dLs R
      gemm(true, false, G, d, M, probs + bh * M * N + n0, N, dvr + bh * M * d, d, dv + rows,
           d, true);                                                   // dv += P^T dV_R
      const T c = unscaled_ds ? static_cast<T>(1.0 / std::sqrt(static_cast<double>(d))) : 1;
      gemm(true, false, G, d, M, ds + bh * M * N + n0, N, r, d, dk + rows, d, true, c);
    }
  });
}

template <typename T>
void landmarks_backward_phase(const T* dR, T* dq, const Geometry& g) {
  PhaseTimer timer(kBwdLandmarks);
  parallel_tasks(0, g.BH * g.h, 8, [&](Tasks& tasks) {
    for (int64_t t : tasks) {
      const int64_t bh = t / g.h, r = t % g.h;
      for (int64_t i = 0; i < g.ph; ++i) {
        const int64_t r0 = i * g.h / g.ph, r1 = ((i + 1) * g.h + g.ph - 1) / g.ph;
        if (r < r0 || r >= r1) continue;
        for (int64_t j = 0; j < g.pw; ++j) {
          const int64_t c0 = j * g.w / g.pw, c1 = ((j + 1) * g.w + g.pw - 1) / g.pw;
          const T inv = T(1) / static_cast<T>((r1 - r0) * (c1 - c0));
          const T* src = dR + (bh * g.M + i * g.pw + j) * g.d;
          for (int64_t c = c0; c < c1; ++c)
            axpy(dq + (bh * g.N + g.prefix + r * g.w + c) * g.d, inv, src, g.d);
        }
      }
    }
  });
}

// ---- The landmarks' mean biases (mita_seg.ops.bias.landmark_bias, the same maths), for
// the relative position bias of the fused backend. Per head, the grid part of the table,
// t2 [2Wh - 1, 2Ww - 1] = table[:T - 3], gets a float64 integral image ii [2Wh, 2Ww]
// (ii[a, b] = sum of t2[< a, < b]); each mean is four reads of it over its area: O(T + M N)
// per head, never N x N. Landmark m = (i, j) covers grid rows [r0, r1) x columns [c0, c1)
// (adaptive_avg_pool2d's regions); tokens are [cls, Wh x Ww grid]:
//   bq [H, M, N]: bq[m, 0] = table[T - 2] (token-to-cls); bq[m, 1 + y Ww + x] = mean of t2
//     over rows [r0 - y, r1 - y) + Wh - 1, columns [c0 - x, c1 - x) + Ww - 1 (landmark m's
//     queries towards the key at (y, x));
//   bk [H, N, M]: bk[0, m] = table[T - 3] (cls-to-token); bk[1 + y Ww + x, m] = mean over
//     rows [y - r1, y - r0) + Wh, columns [x - c1, x - c0) + Ww (the query at (y, x)
//     towards landmark m's keys).
// f(row0, row1, col0, col1, area, bq_slot, bk_slot) for every grid mean, both kinds: the
// forward reads the box, the backward spreads the mean's gradient over its four corners.
template <typename F>
void for_each_grid_mean(int64_t Wh, int64_t Ww, int64_t ph, int64_t pw, F&& f) {
  const int64_t M = ph * pw, N = 1 + Wh * Ww;
  for (int64_t i = 0; i < ph; ++i) {
    const int64_t r0 = i * Wh / ph, r1 = ((i + 1) * Wh + ph - 1) / ph;
    for (int64_t j = 0; j < pw; ++j) {
      const int64_t c0 = j * Ww / pw, c1 = ((j + 1) * Ww + pw - 1) / pw, m = i * pw + j;
      const double area = static_cast<double>((r1 - r0) * (c1 - c0));
      for (int64_t y = 0; y < Wh; ++y)
        for (int64_t x = 0; x < Ww; ++x) {
          const int64_t t = 1 + y * Ww + x;
          f(r0 - y + Wh - 1, r1 - y + Wh - 1, c0 - x + Ww - 1, c1 - x + Ww - 1, area,
            m * N + t, int64_t(-1));                                     // bq[m, t]
          f(y - r1 + Wh, y - r0 + Wh, x - c1 + Ww, x - c0 + Ww, area, int64_t(-1),
            t * M + m);                                                  // bk[t, m]
        }
    }
  }
}

template <typename T>
void bias_means_phase(const T* table, T* bq, T* bk, int64_t H, int64_t Wh, int64_t Ww,
                      int64_t ph, int64_t pw) {
  PhaseTimer timer(kBiasMeans);
  const int64_t NT = (2 * Wh - 1) * (2 * Ww - 1) + 3, M = ph * pw, N = 1 + Wh * Ww;
  const int64_t W2 = 2 * Ww;  // row stride of ii
  parallel_tasks(0, H, 1, [&](Tasks& tasks) {
    std::vector<double> ii(2 * Wh * W2);
    for (int64_t h : tasks) {
      const T* tab = table + h * NT;
      T* q = bq + h * M * N;
      T* k = bk + h * N * M;
      std::fill(ii.begin(), ii.begin() + W2, 0.0);
      for (int64_t a = 0; a < 2 * Wh - 1; ++a) {
        double run = 0;  // ii[a + 1, b + 1] = ii[a, b + 1] + sum of t2[a, <= b]
        ii[(a + 1) * W2] = 0;
        for (int64_t b = 0; b < 2 * Ww - 1; ++b) {
          run += static_cast<double>(tab[a * (2 * Ww - 1) + b]);
          ii[(a + 1) * W2 + b + 1] = ii[a * W2 + b + 1] + run;
        }
      }
      for_each_grid_mean(Wh, Ww, ph, pw, [&](int64_t a0, int64_t a1, int64_t b0, int64_t b1,
                                             double area, int64_t sq, int64_t sk) {
        const double box = ii[a1 * W2 + b1] - ii[a0 * W2 + b1] - ii[a1 * W2 + b0] +
                           ii[a0 * W2 + b0];
        (sq >= 0 ? q[sq] : k[sk]) = static_cast<T>(box / area);
      });
      for (int64_t m = 0; m < M; ++m) {
        q[m * N] = tab[NT - 2];
        k[m] = tab[NT - 3];
      }
    }
  });
}

// The adjoint: dtable [H, T] from the gradients gq [H, M, N], gk [H, N, M] of bq, bk.
template <typename T>
void bias_means_backward_phase(const T* gq, const T* gk, T* dtable, int64_t H, int64_t Wh,
                               int64_t Ww, int64_t ph, int64_t pw) {
  PhaseTimer timer(kBwdBiasMeans);
  const int64_t NT = (2 * Wh - 1) * (2 * Ww - 1) + 3, M = ph * pw, N = 1 + Wh * Ww;
  const int64_t W2 = 2 * Ww, Ws = 2 * Ww + 1;  // row strides of dii and of its suffix sums
  parallel_tasks(0, H, 1, [&](Tasks& tasks) {
    std::vector<double> dii(2 * Wh * W2), suf((2 * Wh + 1) * Ws);
    for (int64_t h : tasks) {
      const T* q = gq + h * M * N;
      const T* k = gk + h * N * M;
      T* dt = dtable + h * NT;
      std::fill(dii.begin(), dii.end(), 0.0);
      for_each_grid_mean(Wh, Ww, ph, pw, [&](int64_t a0, int64_t a1, int64_t b0, int64_t b1,
                                             double area, int64_t sq, int64_t sk) {
        const double g = static_cast<double>(sq >= 0 ? q[sq] : k[sk]) / area;
        dii[a1 * W2 + b1] += g;
        dii[a0 * W2 + b1] -= g;
        dii[a1 * W2 + b0] -= g;
        dii[a0 * W2 + b0] += g;
      });
      // t2[a, b] enters ii[a', b'] for every a' > a, b' > b: dt2[a, b] = suf[a + 1, b + 1]
      // with suf[a, b] = sum of dii[>= a, >= b].
      std::fill(suf.begin(), suf.end(), 0.0);
      for (int64_t a = 2 * Wh - 1; a >= 0; --a)
        for (int64_t b = 2 * Ww - 1; b >= 0; --b)
          suf[a * Ws + b] = dii[a * W2 + b] + suf[(a + 1) * Ws + b] + suf[a * Ws + b + 1] -
                            suf[(a + 1) * Ws + b + 1];
      for (int64_t a = 0; a < 2 * Wh - 1; ++a)
        for (int64_t b = 0; b < 2 * Ww - 1; ++b)
          dt[a * (2 * Ww - 1) + b] = static_cast<T>(suf[(a + 1) * Ws + b + 1]);
      double cls_key = 0, cls_query = 0;  // the cls entries: summed over the landmarks
      for (int64_t m = 0; m < M; ++m) {
        cls_key += static_cast<double>(q[m * N]);
        cls_query += static_cast<double>(k[m]);
      }
      dt[NT - 3] = static_cast<T>(cls_query);
      dt[NT - 2] = static_cast<T>(cls_key);
      dt[NT - 1] = 0;
    }
  });
}

// ---- Entry points: checks (every index read from a tensor is range-checked before it
// addresses memory), allocation, dispatch on float32 / float64.
void check_dtypes(const char* name, const torch::Tensor& q, const torch::Tensor& k,
                  const torch::Tensor& v) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), name,
              ": CPU tensors only");
  const auto t = q.scalar_type();
  TORCH_CHECK(t == at::kFloat || t == at::kDouble || t == at::kBFloat16 || t == at::kHalf,
              name, ": q must be float32, float64, bfloat16 or float16, got ", t);
  TORCH_CHECK(k.scalar_type() == t && v.scalar_type() == t, name,
              ": q, k, v must have the same dtype");
}

// q, k, v: [BH, N, d] (the backward), or [B, H, N, d] too (the forward, heads forward:
// whose rows it reads in place).
void check_qkv(const char* name, const torch::Tensor& q, const torch::Tensor& k,
               const torch::Tensor& v, bool heads = false) {
  TORCH_CHECK((q.dim() == 3 || (heads && q.dim() == 4)) && k.sizes() == q.sizes() &&
                  v.sizes() == q.sizes(), name, ": q, k, v must be [BH, N, d]",
              heads ? " or [B, H, N, d]" : "", ", got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  check_dtypes(name, q, k, v);
}

// Elements [e0, e1) of src converted into dst (both contiguous).
void convert_range(const torch::Tensor& src, torch::Tensor& dst, int64_t e0, int64_t e1) {
  const auto from = src.scalar_type(), to = dst.scalar_type();
  const bool half = from == at::kBFloat16 || from == at::kHalf;
  if (g_has_f16c && half && to == at::kFloat) {
    widen_avx2(static_cast<const uint16_t*>(src.data_ptr()) + e0, from,
               dst.data_ptr<float>() + e0, e1 - e0);
    return;
  }
  if (g_has_f16c && from == at::kFloat && (to == at::kBFloat16 || to == at::kHalf)) {
    narrow_avx2(src.data_ptr<float>() + e0, static_cast<uint16_t*>(dst.data_ptr()) + e0, to,
                e1 - e0);
    return;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, from, "convert", [&] {
    using S = scalar_t;
    const S* a = src.data_ptr<S>();
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, to, "convert", [&] {
      scalar_t* b = dst.data_ptr<scalar_t>();
      for (int64_t e = e0; e < e1; ++e) b[e] = static_cast<scalar_t>(static_cast<float>(a[e]));
    });
  });
}

// bf16/fp16 tensors converted to `to` (float32), or float32 to bf16/fp16, in one parallel
// pass over all of them (ATen's copy_ is one parallel region per tensor); tensors already
// of dtype `to` are returned as they are (contiguous).
std::vector<torch::Tensor> convert(std::vector<torch::Tensor> ts, at::ScalarType to) {
  constexpr int64_t CHUNK = 1 << 15;
  std::vector<torch::Tensor> out;
  std::vector<std::pair<size_t, int64_t>> pieces;  // (tensor, first element)
  for (size_t i = 0; i < ts.size(); ++i) {
    ts[i] = ts[i].contiguous();
    if (ts[i].scalar_type() == to) {
      out.push_back(ts[i]);
      continue;
    }
    out.push_back(torch::empty_like(ts[i], ts[i].options().dtype(to)));
    for (int64_t e = 0; e < ts[i].numel(); e += CHUNK) pieces.emplace_back(i, e);
  }
  parallel_tasks(0, static_cast<int64_t>(pieces.size()), 1, [&](Tasks& tasks) {
    for (int64_t t : tasks) {
      const auto [i, e0] = pieces[t];
      convert_range(ts[i], out[i], e0, std::min(ts[i].numel(), e0 + CHUNK));
    }
  });
  return out;
}

// Checks that every value of the int64 tensor t lies in [0, hi).
void check_index_range(const char* name, const char* what, const torch::Tensor& t,
                       int64_t hi) {
  const int64_t* p = t.data_ptr<int64_t>();
  const int64_t n = t.numel();
  int64_t bad = -1;
  for (int64_t i = 0; i < n && bad < 0; ++i)
    if (p[i] < 0 || p[i] >= hi) bad = i;
  TORCH_CHECK(bad < 0, name, ": ", what, " holds ", bad < 0 ? 0 : p[bad], " at flat index ",
              bad, ", outside [0, ", hi, ")");
}

torch::Tensor index_tensor(const char* name, const char* what, torch::Tensor t,
                           std::vector<int64_t> shape) {
  TORCH_CHECK(t.scalar_type() == at::kLong, name, ": ", what, " must be int64, got ",
              t.scalar_type());
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(shape), name, ": ", what, " must have shape ",
              c10::IntArrayRef(shape), ", got ", t.sizes());
  return t.contiguous();
}

torch::Tensor float_tensor(const char* name, const char* what, torch::Tensor t,
                           std::vector<int64_t> shape, const torch::Tensor& like) {
  TORCH_CHECK(t.sizes() == c10::IntArrayRef(shape), name, ": ", what, " must have shape ",
              c10::IntArrayRef(shape), ", got ", t.sizes());
  return convert({t}, like.scalar_type())[0];
}

Geometry geometry(const char* name, const torch::Tensor& q, int64_t h, int64_t w, int64_t ph,
                  int64_t pw, int64_t prefix, int64_t topk, int64_t router_topk) {
  const int64_t BH = q.dim() == 4 ? q.size(0) * q.size(1) : q.size(0);  // [B, H, N, d]
  const Geometry g{BH, q.size(-2), q.size(-1), h, w, ph, pw, prefix, ph * pw, topk,
                   router_topk};
  TORCH_CHECK(h >= 1 && w >= 1 && prefix >= 0 && prefix + h * w <= g.N, name,
              ": grid ", h, "x", w, " after ", prefix, " prefix tokens does not fit N = ", g.N);
  TORCH_CHECK(ph >= 1 && pw >= 1 && ph <= h && pw <= w, name, ": pool ", ph, "x", pw,
              " must be within the grid ", h, "x", w);
  TORCH_CHECK(topk >= 1 && topk <= g.N, name, ": topk must be in [1, N], got ", topk);
  TORCH_CHECK(router_topk >= 1 && router_topk <= g.M, name,
              ": router_topk must be in [1, M], got ", router_topk);
  return g;
}

// The bias operands of a call, checked against the geometry and converted to the compute
// dtype of `like` (contiguous): window_h = window_w = 0 means no bias (and no tensors);
// otherwise table [H, NT] with NT = (2 Wh - 1)(2 Ww - 1) + 3, H dividing BH, tokens
// [cls, Wh x Ww grid] (so that every table index the kernels compute is in [0, NT)), and,
// in the forward (landmark_means), bq [H, M, N] and bk [H, N, M].
struct BiasTensors {
  torch::Tensor bq, bk, table;
  int64_t H = 1, Wh = 0, Ww = 0, NT = 0;
  template <typename T>
  Bias<T> view() const {
    Bias<T> b;
    if (!table.defined()) return b;
    b.table = table.data_ptr<T>();
    b.bq = bq.defined() ? bq.data_ptr<T>() : nullptr;
    b.bk = bk.defined() ? bk.data_ptr<T>() : nullptr;
    b.H = H; b.Wh = Wh; b.Ww = Ww; b.NT = NT;
    return b;
  }
};

// heads: q's H where q is [B, H, N, d] (the table must have that many rows), 0 for
// [BH, N, d] (H rows, H dividing BH: row bh % H)
BiasTensors bias_tensors(const char* name, const Geometry& g, const torch::Tensor& like,
                         int64_t heads, const c10::optional<torch::Tensor>& table,
                         int64_t window_h,
                         int64_t window_w, bool landmark_means,
                         const c10::optional<torch::Tensor>& bq = c10::nullopt,
                         const c10::optional<torch::Tensor>& bk = c10::nullopt) {
  BiasTensors b;
  const bool given = table.has_value() || bq.has_value() || bk.has_value();
  if (window_h == 0 && window_w == 0) {
    TORCH_CHECK(!given, name, ": bias tensors given without a window: pass the grid the "
                "table was built for as window_h, window_w");
    return b;
  }
  TORCH_CHECK(window_h >= 1 && window_w >= 1, name, ": the bias window must be positive, got ",
              window_h, "x", window_w);
  TORCH_CHECK(table.has_value() && (!landmark_means || (bq.has_value() && bk.has_value())),
              name, ": a ", window_h, "x", window_w, " bias window needs the table",
              landmark_means ? " and the landmark means bias_q, bias_k" : "");
  TORCH_CHECK(g.prefix == 1 && g.h == window_h && g.w == window_w &&
                  g.N == 1 + window_h * window_w, name,
              ": the relative position bias needs tokens [cls, ", window_h, "x", window_w,
              " grid] (prefix 1, that grid, N = ", 1 + window_h * window_w, "), got prefix ",
              g.prefix, ", grid ", g.h, "x", g.w, ", N = ", g.N);
  b.Wh = window_h;
  b.Ww = window_w;
  b.NT = (2 * window_h - 1) * (2 * window_w - 1) + 3;
  auto floating = [&](const char* what, const torch::Tensor& t, std::vector<int64_t> shape) {
    TORCH_CHECK(t.device().is_cpu() && t.is_floating_point(), name, ": ", what,
                " must be a floating point CPU tensor, got ", t.scalar_type(), " on ",
                t.device());
    return float_tensor(name, what, t, shape, like);
  };
  const torch::Tensor& tab = *table;
  TORCH_CHECK(tab.dim() == 2 && tab.size(0) >= 1 && g.BH % tab.size(0) == 0, name,
              ": the bias table must be [H, T] with H dividing BH = ", g.BH, ", got ",
              tab.sizes());
  TORCH_CHECK(heads == 0 || tab.size(0) == heads, name, ": the bias table must have a row "
              "per head, [H = ", heads, ", T], got ", tab.sizes());
  b.H = tab.size(0);
  b.table = floating("the bias table", tab, {b.H, b.NT});
  if (landmark_means) {
    b.bq = floating("bias_q", *bq, {b.H, g.M, g.N});
    b.bk = floating("bias_k", *bk, {b.H, g.N, g.M});
  }
  return b;
}

// What mita_forward returns and mita_backward reads: the fields of
// mita_seg.ops.fused_cpu.FusedState, in the same order (shapes there).
struct FusedState {
  static constexpr size_t kSize = 11;
  torch::Tensor out, lse, keys, choice, offsets, order, landmarks, probs, shared_logits,
      shared_values, out_float;

  std::vector<torch::Tensor> list() const {
    return {out,       lse,   keys,          choice,        offsets,  order,
            landmarks, probs, shared_logits, shared_values, out_float};
  }
  static FusedState from(const char* name, const std::vector<torch::Tensor>& t) {
    TORCH_CHECK(t.size() == kSize, name, ": the state must be the ", kSize,
                " tensors mita_forward returned, got ", t.size());
    return {t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8], t[9], t[10]};
  }
};

// q, k, v: [BH, N, d], or [B, H, N, d] with any strides (views of the qkv projection: read
// in place; rows with stride 1 in d, else copied); the grid is tokens prefix .. prefix + h w,
// pooled to ph x pw;
// topk keys per expert, router_topk experts per query; with a relative position bias
// (window_h, window_w > 0): bias_q [H, M, N] and bias_k [H, N, M] (the landmarks' mean bias,
// mita_seg.ops.bias.landmark_bias) and the table [H, T] (see bias_tensors). Returns the
// FusedState as a list: out [BH, N, d] ([B, N, H, d] for [B, H, N, d] inputs: the module's
// [B, N, C], out.transpose(1, 2) the result), lse [BH, N] (over all M + r K logits of each query),
// keys [BH, M, K], choice [BH, N, r], offsets [BH, M + 1], order [BH, N r] (grouping),
// landmarks R [BH, M, d], probs [BH, M, N] (softmax(S); empty unless shared and save_probs),
// shared_logits Ls [BH, N, M] (empty unless shared and save_probs), shared_values V_R
// [BH, M, d] (empty without shared), and out_float: for bf16/fp16 inputs out in float32
// (what the backward reads; empty otherwise).
// bf16/fp16 inputs are computed in float32, read by the phases a tile or a row at a time
// (routing identical to float32 on the same values); the first out has the inputs' dtype,
// every other tensor float32/float64.
std::vector<torch::Tensor> mita_forward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                        int64_t h, int64_t w, int64_t ph, int64_t pw,
                                        int64_t prefix, int64_t topk, int64_t router_topk,
                                        bool shared, double shared_scale, bool save_probs,
                                        const c10::optional<torch::Tensor>& bias_q,
                                        const c10::optional<torch::Tensor>& bias_k,
                                        const c10::optional<torch::Tensor>& table,
                                        int64_t window_h, int64_t window_w) {
  const char* name = "mita_forward";
  check_qkv(name, q, k, v, true);
  for (auto* t : {&q, &k, &v})
    if (!rows_in_place(*t)) *t = t->contiguous();
  const auto in_dtype = q.scalar_type();
  const auto opts = q.options().dtype(in_dtype == at::kDouble ? at::kDouble : at::kFloat);
  const auto lopts = opts.dtype(at::kLong);
  const Geometry g = geometry(name, q, h, w, ph, pw, prefix, topk, router_topk);
  const int64_t H = q.dim() == 4 ? q.size(1) : 1;
  auto out = q.dim() == 4 ? torch::empty({q.size(0), g.N, H, g.d}, opts)  // [B, N, H, d]
                          : torch::empty(q.sizes(), opts);  // in the compute dtype
  const BiasTensors bt = bias_tensors(name, g, out, q.dim() == 4 ? H : 0, table, window_h,
                                      window_w, true, bias_q, bias_k);
  auto lse = torch::empty({g.BH, g.N}, opts);
  auto keys = torch::empty({g.BH, g.M, g.K}, lopts);
  auto choice = torch::empty({g.BH, g.N, g.R}, lopts);
  auto offsets = torch::empty({g.BH, g.M + 1}, lopts);
  auto order = torch::empty({g.BH, g.N * g.R}, lopts);
  auto R = torch::empty({g.BH, g.M, g.d}, opts);
  auto probs = torch::empty({shared && save_probs ? g.BH : 0, g.M, g.N}, opts);
  auto ls = torch::empty({shared && save_probs ? g.BH : 0, g.N, g.M}, opts);
  auto vr = torch::empty({shared ? g.BH : 0, g.M, g.d}, opts);
  const int64_t items = g.R > 1 ? g.BH : 0;  // the routed partials, merged in phase 6
  auto o_items = torch::empty({items, g.N * g.R, g.d}, opts);
  auto lse_items = torch::empty({items, g.N * g.R}, opts);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, in_dtype, "mita_forward", [&] {
    using In = scalar_t;  // q, k, v; bf16/fp16 read as float32 a tile or a row at a time
    using T = std::conditional_t<std::is_same<In, double>::value, double, float>;
    const Rows<const In> qp = rows_of<const In>(q), kp = rows_of<const In>(k),
                         vp = rows_of<const In>(v);
    // out's rows as the phases write them: (bh, n) -> out[b, n, h] (or out[bh, n])
    const Rows<T> orows{out.data_ptr<T>(), H, g.N * H * g.d, g.d, H * g.d};
    const Bias<T> bias = bt.view<T>();
    const LowpPath lp = lowp_path<In>();  // bf16/fp16 read-out GEMMs (see lowp_gemm)
    auto opt = [](torch::Tensor& t) { return t.numel() ? t.data_ptr<T>() : nullptr; };
    landmarks_phase<T>(qp, R.data_ptr<T>(), g);
    experts_phase<T>(kp, vp, R.data_ptr<T>(), keys.data_ptr<int64_t>(), opt(probs), opt(vr),
                     shared, bias, g, lp);
    router_phase<T>(qp, R.data_ptr<T>(), opt(vr), opt(ls), choice.data_ptr<int64_t>(), orows,
                    lse.data_ptr<T>(), static_cast<T>(shared_scale), shared,
                    bias, g);
    group_items(choice.data_ptr<int64_t>(), g.BH, g.N * g.R, g.M,
                offsets.data_ptr<int64_t>(), order.data_ptr<int64_t>());
    routed_phase<T>(qp, kp, vp, keys.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
                    order.data_ptr<int64_t>(), opt(o_items), opt(lse_items), orows,
                    lse.data_ptr<T>(),
                    static_cast<T>(1.0 / std::sqrt(static_cast<double>(g.d))), bias, g, lp);
    if (g.R > 1)
      merge_phase<T>(o_items.data_ptr<T>(), lse_items.data_ptr<T>(), orows, lse.data_ptr<T>(),
                     g);
  });
  const bool wide = in_dtype == out.scalar_type();
  return FusedState{wide ? out : convert({out}, in_dtype)[0], lse, keys, choice, offsets, order,
                    R, probs, ls, vr, wide ? torch::empty({0}, opts) : out}  // no aliases
      .list();
}

// Gradients of mita_forward: q, k, v and the geometry as it takes them; the state it
// returned (the routing; landmarks, probs, shared logits, shared values: ignored unless
// shared; lse and the out in the compute dtype: out_float where it is not empty, else out,
// which may then be empty); dout; the bias table and window as the forward took them (the
// backward recomputes the routed logits, bias included; the scores and shared logits it
// reads from probs and Ls). Returns dq, dk, dv in the dtype of q and, with a bias, in the
// compute dtype (float32, float64 for float64 inputs): dbias_q [H, M, N] and dbias_k
// [H, N, M] (the scores' and the shared logits' gradients summed over the batch; empty
// without the shared expert) and dtable [H, T] (the routed logits' gradients scatter-added
// at their entries); empty tensors without a bias. dlse [BH, N] (optional): the gradient of
// the forward's lse, where it was used (an lse merge).
std::vector<torch::Tensor> mita_backward(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                                         int64_t h, int64_t w, int64_t ph, int64_t pw,
                                         int64_t prefix, bool shared, double shared_scale,
                                         const std::vector<torch::Tensor>& state,
                                         torch::Tensor dout,
                                         const c10::optional<torch::Tensor>& table,
                                         int64_t window_h, int64_t window_w,
                                         const c10::optional<torch::Tensor>& dlse) {
  const char* name = "mita_backward";
  check_qkv(name, q, k, v);
  const FusedState s = FusedState::from(name, state);
  torch::Tensor keys = s.keys, choice = s.choice, offsets = s.offsets, order = s.order;
  torch::Tensor R = s.landmarks, probs = s.probs, ls = s.shared_logits, vr = s.shared_values;
  torch::Tensor out = s.out_float.numel() ? s.out_float : s.out, lse = s.lse;
  const auto in_dtype = q.scalar_type();
  // bf16/fp16 with lowp GEMMs: phase B's GEMMs read q, k, v (and dout) as they came in
  const LowpPath lp = in_dtype == at::kBFloat16 ? lowp_path<c10::BFloat16>()
                      : in_dtype == at::kHalf   ? lowp_path<c10::Half>()
                                                : kLowpOff;
  const torch::Tensor q_in = q.contiguous(), k_in = k.contiguous(), v_in = v.contiguous();
  {
    auto wide = convert({q, k, v}, in_dtype == at::kDouble ? at::kDouble : at::kFloat);
    q = wide[0]; k = wide[1]; v = wide[2];
  }
  TORCH_CHECK(keys.dim() == 3 && choice.dim() == 3, name,
              ": keys must be [BH, M, K] and choice [BH, N, r], got ", keys.sizes(), ", ",
              choice.sizes());
  const Geometry g = geometry(name, q, h, w, ph, pw, prefix, keys.size(2), choice.size(2));
  const int64_t BH = g.BH, N = g.N, d = g.d, M = g.M, K = g.K, NR = g.N * g.R;
  keys = index_tensor(name, "keys", keys, {BH, M, K});
  choice = index_tensor(name, "choice", choice, {BH, N, g.R});
  offsets = index_tensor(name, "offsets", offsets, {BH, M + 1});
  order = index_tensor(name, "order", order, {BH, NR});
  check_index_range(name, "keys", keys, N);
  check_index_range(name, "choice", choice, M);
  check_index_range(name, "order", order, NR);
  {  // offsets: 0 = offsets[bh, 0] <= ... <= offsets[bh, M] = N r
    const int64_t* off = offsets.data_ptr<int64_t>();
    for (int64_t bh = 0; bh < BH; ++bh) {
      const int64_t* o = off + bh * (M + 1);
      TORCH_CHECK(o[0] == 0 && o[M] == NR, name, ": offsets[", bh,
                  "] must run from 0 to N r = ", NR);
      for (int64_t m = 0; m < M; ++m)
        TORCH_CHECK(o[m] <= o[m + 1], name, ": offsets[", bh, "] must be non-decreasing");
    }
  }
  out = float_tensor(name, "out", out, {BH, N, d}, q);
  // phase B's In operand: dout as it came in (already In from autograd; no round trip)
  const torch::Tensor dout_in =
      lp != kLowpOff ? dout.to(in_dtype).contiguous() : torch::Tensor();
  dout = float_tensor(name, "dout", dout, {BH, N, d}, q);
  lse = float_tensor(name, "lse", lse, {BH, N}, q);
  const torch::Tensor dlse_t =
      dlse.has_value() ? float_tensor(name, "dlse", *dlse, {BH, N}, q) : torch::Tensor();
  if (shared) {
    R = float_tensor(name, "landmarks", R, {BH, M, d}, q);
    probs = float_tensor(name, "probs", probs, {BH, M, N}, q);
    ls = float_tensor(name, "shared logits", ls, {BH, N, M}, q);
    vr = float_tensor(name, "shared values", vr, {BH, M, d}, q);
  }
  const BiasTensors bt = bias_tensors(name, g, q, q.dim() == 4 ? q.size(1) : 0, table,
                                      window_h, window_w, false);
  const bool has_bias = bt.table.defined();
  const auto opts = q.options();
  auto dq = torch::empty_like(q), dk = torch::empty_like(q), dv = torch::empty_like(q);
  auto dq_items = g.R == 1 ? dq : torch::empty({BH, NR, d}, opts);
  // with a bias: the routed logits' gradients by position in order, dtable per bh
  auto dl_sorted = torch::empty({has_bias ? BH : 0, NR, K}, opts);
  auto dtab = torch::empty({has_bias ? BH : 0, bt.NT}, opts);
  auto dk_exp = torch::empty({BH, M, K, d}, opts);
  auto dv_exp = torch::empty({BH, M, K, d}, opts);
  auto delta = torch::empty({BH, N}, opts);
  const int64_t S = shared ? BH : 0;  // the shared expert's buffers
  auto dls = torch::empty({S, N, M}, opts), dvr = torch::empty({S, M, d}, opts);
  auto ds = torch::empty({S, M, N}, opts), dR = torch::empty({S, M, d}, opts);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "mita_backward", [&] {
    using T = scalar_t;
    const Bias<T> bias = bt.view<T>();
    auto ptr = [&](torch::Tensor& t) { return shared ? t.data_ptr<T>() : nullptr; };
    auto bptr = [&](torch::Tensor& t) { return has_bias ? t.data_ptr<T>() : nullptr; };
    shared_backward_phase<T>(dout.data_ptr<T>(), out.data_ptr<T>(), lse.data_ptr<T>(),
                             dlse_t.defined() ? dlse_t.data_ptr<T>() : nullptr, ptr(ls),
                             ptr(vr), delta.data_ptr<T>(), ptr(dls), ptr(dvr), shared, g);
    auto routed = [&](auto in_type) {  // In: the inputs' dtype with lowp GEMMs, else T
      using In = decltype(in_type);
      auto in = [&](const torch::Tensor& t) {
        return lp != kLowpOff ? t.data_ptr<In>() : nullptr;
      };
      routed_backward_phase<T, In>(
          q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), in(q_in), in(k_in), in(v_in),
          in(dout_in), keys.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
          order.data_ptr<int64_t>(), dout.data_ptr<T>(), lse.data_ptr<T>(),
          delta.data_ptr<T>(), dq_items.data_ptr<T>(), dk_exp.data_ptr<T>(),
          dv_exp.data_ptr<T>(), bptr(dl_sorted),
          static_cast<T>(1.0 / std::sqrt(static_cast<double>(d))), bias, g,
          std::is_same<In, T>::value ? kLowpOff : lp);
    };
    if (lp != kLowpOff && in_dtype == at::kBFloat16)  // (T is float then)
      routed(c10::BFloat16(0.f));
    else if (lp != kLowpOff && in_dtype == at::kHalf)
      routed(c10::Half(0.f));
    else
      routed(T(0));
    reduce_phase<T>(keys.data_ptr<int64_t>(), offsets.data_ptr<int64_t>(),
                    order.data_ptr<int64_t>(), dk_exp.data_ptr<T>(), dv_exp.data_ptr<T>(),
                    dq_items.data_ptr<T>(), bptr(dl_sorted), dk.data_ptr<T>(),
                    dv.data_ptr<T>(), dq.data_ptr<T>(), bptr(dtab), bias, g);
    if (!shared) return;
    scores_backward_phase<T>(q.data_ptr<T>(), v.data_ptr<T>(), k.data_ptr<T>(),
                             probs.data_ptr<T>(), dvr.data_ptr<T>(), dls.data_ptr<T>(),
                             ds.data_ptr<T>(), dR.data_ptr<T>(), static_cast<T>(shared_scale),
                             has_bias, g);
    rows_backward_phase<T>(R.data_ptr<T>(), probs.data_ptr<T>(), dvr.data_ptr<T>(),
                           dls.data_ptr<T>(), ds.data_ptr<T>(), dq.data_ptr<T>(),
                           dk.data_ptr<T>(), dv.data_ptr<T>(), static_cast<T>(shared_scale),
                           has_bias, g);
    landmarks_backward_phase<T>(dR.data_ptr<T>(), dq.data_ptr<T>(), g);
  });
  auto grads = convert({dq, dk, dv}, in_dtype);
  if (!has_bias) {
    for (int i = 0; i < 3; ++i) grads.push_back(torch::empty({0}, opts));
    return grads;
  }
  // Sums over the batch (bh = b H + head): the per-bh buffers themselves when B = 1.
  const int64_t B = BH / bt.H;
  auto batch_sum = [&](const torch::Tensor& t) {
    return B == 1 ? t : t.view([&] {
      std::vector<int64_t> s{B, bt.H};
      for (int64_t i = 1; i < t.dim(); ++i) s.push_back(t.size(i));
      return s;
    }()).sum(0);
  };
  grads.push_back(shared ? batch_sum(ds) : torch::empty({0}, opts));   // dbias_q [H, M, N]
  grads.push_back(shared ? batch_sum(dls) : torch::empty({0}, opts));  // dbias_k [H, N, M]
  grads.push_back(batch_sum(dtab));                                    // dtable [H, T]
  return grads;
}

void check_means_geometry(const char* name, int64_t window_h, int64_t window_w, int64_t ph,
                          int64_t pw) {
  TORCH_CHECK(window_h >= 1 && window_w >= 1, name, ": the bias window must be positive, got ",
              window_h, "x", window_w);
  TORCH_CHECK(ph >= 1 && pw >= 1 && ph <= window_h && pw <= window_w, name, ": pool ", ph, "x",
              pw, " must be within the grid ", window_h, "x", window_w);
}

// table [H, T] (float32 or float64; T = (2 Wh - 1)(2 Ww - 1) + 3) -> bias_q [H, M, N],
// bias_k [H, N, M] in its dtype (see bias_means_phase).
std::vector<torch::Tensor> landmark_bias(torch::Tensor table, int64_t window_h,
                                         int64_t window_w, int64_t ph, int64_t pw) {
  const char* name = "landmark_bias";
  check_means_geometry(name, window_h, window_w, ph, pw);
  const int64_t NT = (2 * window_h - 1) * (2 * window_w - 1) + 3, M = ph * pw;
  const int64_t N = 1 + window_h * window_w;
  TORCH_CHECK(table.device().is_cpu() && (table.scalar_type() == at::kFloat ||
                                          table.scalar_type() == at::kDouble),
              name, ": the table must be a float32 or float64 CPU tensor, got ",
              table.scalar_type(), " on ", table.device());
  TORCH_CHECK(table.dim() == 2 && table.size(0) >= 1 && table.size(1) == NT, name,
              ": the table must be [H, ", NT, "] for a ", window_h, "x", window_w,
              " window, got ", table.sizes());
  table = table.contiguous();
  const int64_t H = table.size(0);
  auto bq = torch::empty({H, M, N}, table.options()), bk = torch::empty({H, N, M},
                                                                         table.options());
  AT_DISPATCH_FLOATING_TYPES(table.scalar_type(), "landmark_bias", [&] {
    bias_means_phase<scalar_t>(table.data_ptr<scalar_t>(), bq.data_ptr<scalar_t>(),
                               bk.data_ptr<scalar_t>(), H, window_h, window_w, ph, pw);
  });
  return {bq, bk};
}

// Gradient of landmark_bias: grad_q [H, M, N], grad_k [H, N, M] -> dtable [H, T] in the
// dtype of grad_q (grad_k is converted to it).
torch::Tensor landmark_bias_backward(torch::Tensor grad_q, torch::Tensor grad_k,
                                     int64_t window_h, int64_t window_w, int64_t ph,
                                     int64_t pw) {
  const char* name = "landmark_bias_backward";
  check_means_geometry(name, window_h, window_w, ph, pw);
  const int64_t NT = (2 * window_h - 1) * (2 * window_w - 1) + 3, M = ph * pw;
  const int64_t N = 1 + window_h * window_w;
  TORCH_CHECK(grad_q.device().is_cpu() && (grad_q.scalar_type() == at::kFloat ||
                                           grad_q.scalar_type() == at::kDouble),
              name, ": grad_q must be a float32 or float64 CPU tensor, got ",
              grad_q.scalar_type(), " on ", grad_q.device());
  TORCH_CHECK(grad_q.dim() == 3 && grad_q.size(0) >= 1, name, ": grad_q must be [H, ", M,
              ", ", N, "], got ", grad_q.sizes());
  const int64_t H = grad_q.size(0);
  grad_q = float_tensor(name, "grad_q", grad_q, {H, M, N}, grad_q);
  TORCH_CHECK(grad_k.device().is_cpu() && grad_k.is_floating_point(), name,
              ": grad_k must be a floating point CPU tensor");
  grad_k = float_tensor(name, "grad_k", grad_k, {H, N, M}, grad_q);
  auto dtable = torch::empty({H, NT}, grad_q.options());
  AT_DISPATCH_FLOATING_TYPES(grad_q.scalar_type(), "landmark_bias_backward", [&] {
    bias_means_backward_phase<scalar_t>(grad_q.data_ptr<scalar_t>(),
                                        grad_k.data_ptr<scalar_t>(),
                                        dtable.data_ptr<scalar_t>(), H, window_h, window_w, ph,
                                        pw);
  });
  return dtable;
}

// Phase profile: profile(true) zeroes the counters and starts counting, profile(false)
// stops; both return {phase: seconds summed since the last reset}.
std::vector<std::pair<std::string, double>> profile(bool enable) {
  std::vector<std::pair<std::string, double>> res;
  for (int i = 0; i < kNumPhases; ++i) res.emplace_back(kPhaseNames[i], g_phase_seconds[i]);
  if (enable) std::fill(g_phase_seconds, g_phase_seconds + kNumPhases, 0.0);
  g_profile.store(enable);
  return res;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("mita_forward", &mita_forward,
        "Fused MiTA forward on CPU, routing included: the state (out, lse, keys, choice, "
        "offsets, order, landmarks, probs, shared_logits, shared_values, out_float); optional "
        "relative position bias: bias_q [H, M, N], bias_k [H, N, M], table [H, T], window",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("h"), py::arg("w"), py::arg("ph"),
        py::arg("pw"), py::arg("prefix"), py::arg("topk"), py::arg("router_topk"),
        py::arg("shared"), py::arg("shared_scale"), py::arg("save_probs"),
        py::arg("bias_q") = py::none(), py::arg("bias_k") = py::none(),
        py::arg("table") = py::none(), py::arg("window_h") = 0, py::arg("window_w") = 0);
  m.def("mita_backward", &mita_backward,
        "Gradients of mita_forward from the state it returned (CPU): (dq, dk, dv, dbias_q, "
        "dbias_k, dtable), the last three empty without a bias; dlse: the gradient of lse",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("h"), py::arg("w"), py::arg("ph"),
        py::arg("pw"), py::arg("prefix"), py::arg("shared"), py::arg("shared_scale"),
        py::arg("state"), py::arg("dout"), py::arg("table") = py::none(),
        py::arg("window_h") = 0, py::arg("window_w") = 0, py::arg("dlse") = py::none());
  m.def("landmark_bias", &landmark_bias,
        "The landmarks' mean biases (mita_seg.ops.bias.landmark_bias) from the table [H, T]: "
        "(bias_q [H, M, N], bias_k [H, N, M])",
        py::arg("table"), py::arg("window_h"), py::arg("window_w"), py::arg("ph"),
        py::arg("pw"));
  m.def("landmark_bias_backward", &landmark_bias_backward,
        "Gradient of landmark_bias: (grad_q, grad_k) -> dtable [H, T]", py::arg("grad_q"),
        py::arg("grad_k"), py::arg("window_h"), py::arg("window_w"), py::arg("ph"),
        py::arg("pw"));
  m.def("parallel_threads",
        [] {
          std::vector<int> used(at::get_num_threads(), 0);
          at::parallel_for(0, 64 * at::get_num_threads(), 1, [&](int64_t, int64_t) {
            used[at::get_thread_num()] = 1;
          });
          return std::accumulate(used.begin(), used.end(), 0);
        },
        "How many threads an at::parallel_for of the kernels runs on (torch's thread count "
        "when the extension is built with OpenMP, 1 otherwise)");
  m.def("profile", &profile, "Per-phase wall time of the kernels: profile(enable)");
  m.def("_set_torch_mm_only", [](bool on) { g_torch_mm_only = on; },
        "Tests: make the kernels' GEMMs use torch::mm (the fallback where BLAS is absent)");
  m.def("has_avx2", [] { return g_has_avx2; },
        "Whether the kernel's AVX2 code (exponential, maxima) runs (the CPU, MITA_CPU_ISA)");
  m.def("has_f16c", [] { return g_has_f16c; },
        "Whether the kernel's F16C conversions run (the CPU, MITA_CPU_ISA)");
  m.def("lowp_gemm_path",
        [](at::ScalarType dtype) -> std::string {
          return lowp_name(dtype == at::kBFloat16 ? lowp_path<c10::BFloat16>()
                           : dtype == at::kHalf   ? lowp_path<c10::Half>()
                                                  : kLowpOff);
        },
        "The read-out GEMMs (forward) and routed GEMMs (backward) for inputs of this dtype now "
        "(MITA_CPU_BF16_GEMM, the CPU, the probes): 'brgemm-packed', 'brgemm-vnni' or "
        "'brgemm-rows' (oneDNN's bf16/fp16 kernel, B in AMX tiles, interleaved pairs of rows "
        "or plain rows), 'cpublas' (its plain GEMM: forced where no oneDNN layout passed), "
        "'float32'");
  m.def("lowp_probe",
        [](at::ScalarType dtype) {
          std::vector<std::pair<std::string, std::string>> out;
          if (dtype != at::kBFloat16 && dtype != at::kHalf) return out;
          const auto& results = dtype == at::kBFloat16 ? lowp_probe<c10::BFloat16>().results
                                                       : lowp_probe<c10::Half>().results;
          for (const auto& r : results) out.emplace_back(lowp_name(r.first), r.second);
          return out;
        },
        "Each bf16/fp16 GEMM path's probe on this CPU (run once per dtype): [(path, 'ok' | "
        "'wrong results (...)' | 'error: ...' | 'not tried: ...')]; a path runs only if 'ok'");
  m.def("_convert", [](torch::Tensor t, at::ScalarType to) { return convert({t}, to)[0]; },
        "Tests: the kernel's float32 <-> bf16/fp16 conversion (as Tensor.to)");
}
