// The entry points of kernels.h: ISA selection and multithreading. This file is
// compiled with the project's ordinary flags; the ISA-specific code lives in
// kernels/{scalar,avx2,avx512}.cpp and is reached only through their tables,
// after the CPU was checked.
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

#include "optim/kernels/isa_kernels.h"
#include "optim/kernels/kernels.h"

namespace roundpipe {
namespace optim {
namespace kernels {
namespace {

// Threads split the arrays at 64-byte lines (16 floats), so no two threads
// write the same cache line; arrays below the grain run on the caller.
constexpr int64_t kLineFloats = 16;
constexpr int64_t kGrain = 32768;  // elements: 128 KiB per array
static_assert(kBlockwise8BlockSize % kLineFloats == 0, "blocks are whole cache lines");

constexpr int kUnselected = -1;
std::atomic<int> g_active{kUnselected};  // an Isa, once selected
std::atomic<int> g_max_for_testing{static_cast<int>(Isa::kAvx512)};

bool cpu_has(Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return avx2;
    case Isa::kAvx512:
      // The file is compiled with -mavx512bw too; require everything it may use.
      return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  }
  return false;
#else
  return isa == Isa::kScalar;
#endif
}

// Only called for supported ISAs: the table getters live in files compiled
// with that ISA's flags.
const detail::KernelTable* table_of(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return detail::scalar_kernels();
    case Isa::kAvx2:
      return detail::avx2_kernels();
    case Isa::kAvx512:
      return detail::avx512_kernels();
  }
  return nullptr;
}

Isa active() {
  int isa = g_active.load();
  if (isa == kUnselected) {
    select_isa_from_env();
    isa = g_active.load();
  }
  return static_cast<Isa>(isa);
}

const detail::KernelTable& table() { return *table_of(active()); }

// Rounds a chunk boundary up to a multiple of `align` (never past n). Applied
// to every boundary, it keeps the chunks disjoint and covering.
int64_t aligned_boundary(int64_t i, int64_t n, int64_t align) {
  return std::min(n, (i + align - 1) / align * align);
}

// The parallel region's fork and join happen inside libgomp or libtorch's
// pool, uninstrumented, so ThreadSanitizer is told about them: the caller's
// accesses before the region happen before every chunk, and every chunk's
// before the caller's after it. No-ops in other builds.
// (One token for every region: a chunk must acquire before it reads anything
// of its region, its closure included.)
#if defined(__SANITIZE_THREAD__)
char region_fork, region_join;
void tsan_fork() { __tsan_release(&region_fork); }
void tsan_chunk_begins() { __tsan_acquire(&region_fork); }
void tsan_chunk_ends() { __tsan_release(&region_join); }
void tsan_join() { __tsan_acquire(&region_join); }
#else
void tsan_fork() {}
void tsan_chunk_begins() {}
void tsan_chunk_ends() {}
void tsan_join() {}
#endif

// Runs f(begin, end) over [0, n) in chunks on libtorch's intra-op pool
// (at::get_num_threads() threads), with chunk boundaries at multiples of
// `align` elements (a multiple of kLineFloats).
//
// Why not at::parallel_for directly: it is a header template whose OpenMP
// version runs in parallel only in translation units compiled with -fopenmp.
// libtorch's own are; ours are not (and -fopenmp here could load a second
// OpenMP runtime beside the one a PyTorch wheel bundles). TensorIterator's
// for_each calls at::parallel_for inside libtorch, so we borrow it: it walks
// a flat float view of `base`, and each chunk's data pointer tells which
// element range the chunk covers. Nothing is read through the view.
template <typename F>
void parallel_ranges(const float* base, int64_t n, const F& f, int64_t align = kLineFloats) {
  if (n <= 0) return;
  if (n < kGrain || at::get_num_threads() == 1 || at::in_parallel_region()) {
    f(0, n);
    return;
  }
  const at::Tensor flat = at::from_blob(const_cast<float*>(base), {n}, at::kFloat);
  at::TensorIterator iter = at::TensorIteratorConfig().add_input(flat).build();
  const char* const origin = reinterpret_cast<const char*>(base);
  auto loop = [&](char** data, const int64_t* strides, int64_t size0, int64_t size1) {
    tsan_chunk_begins();
    TORCH_INTERNAL_ASSERT(size1 == 1 && strides[0] == sizeof(float));
    const int64_t begin = (data[0] - origin) / static_cast<int64_t>(sizeof(float));
    const int64_t begin_aligned = aligned_boundary(begin, n, align);
    const int64_t end_aligned = aligned_boundary(begin + size0, n, align);
    if (begin_aligned < end_aligned) f(begin_aligned, end_aligned);
    tsan_chunk_ends();
  };
  tsan_fork();
  iter.for_each(loop, kGrain);
  tsan_join();
}

}  // namespace

AdamHyper make_adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                          bool amsgrad, bool maximize, bool decoupled_weight_decay, int64_t step) {
  // Computed in double and rounded once, as libtorch passes these scalars.
  const double bias_correction1 = 1 - std::pow(beta1, static_cast<double>(step));
  const double bias_correction2 = 1 - std::pow(beta2, static_cast<double>(step));
  AdamHyper h;
  h.beta1 = static_cast<float>(beta1);
  h.one_minus_beta1 = static_cast<float>(1 - beta1);
  h.beta2 = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1 - beta2);
  h.weight_decay = static_cast<float>(weight_decay);
  h.decay_factor = static_cast<float>(1 - lr * weight_decay);
  h.bias_correction2_sqrt = static_cast<float>(std::sqrt(bias_correction2));
  h.eps = static_cast<float>(eps);
  h.neg_step_size = static_cast<float>(-(lr / bias_correction1));
  h.maximize = maximize;
  h.coupled_weight_decay = weight_decay != 0 && !decoupled_weight_decay;
  h.decoupled_weight_decay = weight_decay != 0 && decoupled_weight_decay;
  h.amsgrad = amsgrad;
  return h;
}

SgdHyper make_sgd_hyper(double lr, double momentum, double dampening, double weight_decay,
                        bool nesterov, bool maximize, bool first_step) {
  SgdHyper h;
  h.weight_decay = static_cast<float>(weight_decay);
  h.momentum = static_cast<float>(momentum);
  h.one_minus_dampening = static_cast<float>(1 - dampening);
  h.neg_lr = static_cast<float>(-lr);
  h.maximize = maximize;
  h.has_weight_decay = weight_decay != 0;
  h.has_momentum = momentum != 0;
  h.nesterov = nesterov;
  h.first_step = first_step;
  return h;
}

void adam_update(const AdamHyper& hyper, const AdamBuffers& buffers, int64_t n) {
  TORCH_INTERNAL_ASSERT(!hyper.amsgrad || n == 0 || buffers.max_exp_avg_sq != nullptr);
  const detail::KernelTable& t = table();
  parallel_ranges(buffers.param, n,
                  [&](int64_t begin, int64_t end) { t.adam(hyper, buffers, begin, end); });
}

void adam_update_compact(const AdamHyper& hyper, const CompactAdamBuffers& buffers, int64_t n) {
  if (n <= 0) return;
  const CompactAdamBuffers& b = buffers;
  TORCH_INTERNAL_ASSERT(b.grad != nullptr || b.grad_bf16 != nullptr);
  if (b.param_format == ParamFormat::kFp32) {
    TORCH_INTERNAL_ASSERT(b.param != nullptr);
    TORCH_INTERNAL_ASSERT(b.lowp_kind == LowpKind::kNone || b.lowp != nullptr);
  } else {
    TORCH_INTERNAL_ASSERT(b.param_bf16 != nullptr && b.lowp_kind == LowpKind::kNone);
  }
  switch (b.state_format) {
    case StateFormat::kFp32:
      TORCH_INTERNAL_ASSERT(b.exp_avg.fp32 != nullptr && b.exp_avg_sq.fp32 != nullptr);
      TORCH_INTERNAL_ASSERT(!hyper.amsgrad || b.max_exp_avg_sq.fp32 != nullptr);
      break;
    case StateFormat::kBFloat16:
      TORCH_INTERNAL_ASSERT(b.exp_avg.bf16 != nullptr && b.exp_avg_sq.bf16 != nullptr);
      TORCH_INTERNAL_ASSERT(!hyper.amsgrad || b.max_exp_avg_sq.bf16 != nullptr);
      break;
    case StateFormat::kBlockwise8:
      TORCH_INTERNAL_ASSERT(b.exp_avg.codes != nullptr && b.exp_avg.absmax != nullptr);
      TORCH_INTERNAL_ASSERT(b.exp_avg_sq.codes != nullptr && b.exp_avg_sq.absmax != nullptr);
      TORCH_INTERNAL_ASSERT(!hyper.amsgrad, "blockwise-8 Adam states have no amsgrad");
      break;
  }
  const detail::KernelTable& t = table();
  // Block-aligned chunks: a quantization block is never split between threads
  // (and neither is a cache line of any of the arrays).
  // parallel_ranges only does address arithmetic on its base (it reads
  // nothing through it), so a bf16 gradient's address serves as well.
  const float* base = b.grad != nullptr ? b.grad : reinterpret_cast<const float*>(b.grad_bf16);
  parallel_ranges(
      base, n, [&](int64_t begin, int64_t end) { t.adam_compact(hyper, buffers, begin, end); },
      kBlockwise8BlockSize);
}

void blockwise8_quantize(const float* src, uint8_t* codes, float* absmax, int64_t n,
                         bool is_signed) {
  const detail::KernelTable& t = table();
  parallel_ranges(
      src, n,
      [&](int64_t begin, int64_t end) {
        t.quantize_blockwise8(src, codes, absmax, begin, end, is_signed);
      },
      kBlockwise8BlockSize);
}

void blockwise8_dequantize(const uint8_t* codes, const float* absmax, float* dst, int64_t n,
                           bool is_signed) {
  const detail::KernelTable& t = table();
  parallel_ranges(
      dst, n,
      [&](int64_t begin, int64_t end) {
        t.dequantize_blockwise8(codes, absmax, dst, begin, end, is_signed);
      },
      kBlockwise8BlockSize);
}

void sgd_update(const SgdHyper& hyper, const SgdBuffers& buffers, int64_t n) {
  TORCH_INTERNAL_ASSERT(!hyper.has_momentum || n == 0 || buffers.momentum_buffer != nullptr);
  const detail::KernelTable& t = table();
  parallel_ranges(buffers.param, n,
                  [&](int64_t begin, int64_t end) { t.sgd(hyper, buffers, begin, end); });
}

bool unscale_and_check(float* grad, int64_t n, float inv_scale) {
  const detail::KernelTable& t = table();
  std::atomic<bool> found{false};
  parallel_ranges(grad, n, [&](int64_t begin, int64_t end) {
    if (t.unscale_and_check(grad, begin, end, inv_scale)) found.store(true);
  });
  return found.load();
}

void convert_to_lowp(const float* src, uint16_t* dst, int64_t n, LowpKind kind) {
  TORCH_INTERNAL_ASSERT(kind != LowpKind::kNone);
  const detail::KernelTable& t = table();
  parallel_ranges(
      src, n, [&](int64_t begin, int64_t end) { t.convert_to_lowp(src, dst, begin, end, kind); });
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

bool isa_supported(Isa isa) {
  return static_cast<int>(isa) <= g_max_for_testing.load() && cpu_has(isa) &&
         table_of(isa) != nullptr;
}

Isa best_isa() {
  for (Isa isa : {Isa::kAvx512, Isa::kAvx2}) {
    if (isa_supported(isa)) return isa;
  }
  return Isa::kScalar;
}

Isa active_isa() { return active(); }

void select_isa(Isa isa) {
  TORCH_CHECK_VALUE(isa_supported(isa), "roundpipe: SIMD kernels '", isa_name(isa),
                    "' are not supported by this CPU or build (best supported: '",
                    isa_name(best_isa()), "')");
  g_active.store(static_cast<int>(isa));
}

Isa select_isa(const std::string& name) {
  Isa isa = Isa::kScalar;
  if (name.empty()) {
    isa = best_isa();
  } else if (name == "scalar") {
    isa = Isa::kScalar;
  } else if (name == "avx2") {
    isa = Isa::kAvx2;
  } else if (name == "avx512") {
    isa = Isa::kAvx512;
  } else {
    TORCH_CHECK_VALUE(false, "roundpipe: unknown SIMD kernel set '", name,
                      "' (ROUNDPIPE_SIMD accepts scalar, avx2, avx512)");
  }
  select_isa(isa);
  return isa;
}

Isa select_isa_from_env() {
  const char* env = std::getenv("ROUNDPIPE_SIMD");
  return select_isa(std::string(env == nullptr ? "" : env));
}

ChunksForTesting chunks_for_testing(int64_t n) {
  const std::vector<float> data(static_cast<size_t>(n));
  std::mutex mu;
  ChunksForTesting out;
  std::set<std::thread::id> threads;
  parallel_ranges(data.data(), n, [&](int64_t begin, int64_t end) {
    std::lock_guard<std::mutex> lock(mu);
    out.chunks.emplace_back(begin, end);
    threads.insert(std::this_thread::get_id());
  });
  std::sort(out.chunks.begin(), out.chunks.end());
  out.num_threads = static_cast<int>(threads.size());
  return out;
}

void set_max_isa_for_testing(Isa max_isa) { g_max_for_testing.store(static_cast<int>(max_isa)); }

}  // namespace kernels
}  // namespace optim
}  // namespace roundpipe
