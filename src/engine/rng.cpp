#include "engine/rng.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <atomic>
#include <map>
#include <unordered_set>

namespace roundpipe {
namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// ---- CPU devices: a generator per thread ----
//
// CPU kernels draw from the process's one CPU generator when no generator is
// passed. A keyed run on a CPU device's worker instead draws from a
// generator of that thread's own: the run includes a dispatch key
// (CustomRNGKeyId, which sits below the autograd and autocast keys and above
// the CPU kernels) whose kernels pass that generator to every CPU operator
// taking a `Generator?` that was given none. Every other operator falls
// through to its CPU kernel (the key's fallback); those with a
// CompositeExplicitAutograd kernel, which the key would otherwise run in
// place of their CPU one, are passed on by the same kernel. Operators with a
// CompositeImplicitAutograd kernel are left alone: they decompose above this
// key into operators it handles.

thread_local at::Generator* keyed_generator = nullptr;  // the keyed run's, on this thread
thread_local bool skipping_random_fills = false;         // without_random_fills on this thread

bool is_optional_generator(const c10::Argument& a) {
  return a.type()->kind() == c10::TypeKind::OptionalType &&
         a.type()->containedType(0)->kind() == c10::TypeKind::GeneratorType;
}

// An operator that fills its first argument in place with random numbers
// (normal_, uniform_, bernoulli_, ...).
bool is_random_fill(const c10::FunctionSchema& schema) {
  const auto& args = schema.arguments();
  if (args.empty() || schema.returns().size() != 1 || schema.name().back() != '_') return false;
  const c10::AliasInfo* self = args[0].alias_info();
  if (self == nullptr || !self->isWrite()) return false;
  for (const auto& a : args) {
    if (is_optional_generator(a)) return true;
  }
  return false;
}

void pass_keyed_generator(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  if (skipping_random_fills && keys.has_backend(c10::BackendComponent::CPUBit) && is_random_fill(op.schema())) {
    c10::IValue self = (*stack)[stack->size() - op.schema().arguments().size()];
    torch::jit::drop(*stack, op.schema().arguments().size());
    stack->push_back(std::move(self));  // left as it was
    return;
  }
  if (keyed_generator != nullptr && keys.has_backend(c10::BackendComponent::CPUBit)) {
    const auto& args = op.schema().arguments();
    const size_t first = stack->size() - args.size();
    for (size_t i = 0; i < args.size(); ++i) {
      c10::IValue& value = (*stack)[first + i];
      if (value.isNone() && is_optional_generator(args[i])) value = c10::IValue(*keyed_generator);
    }
  }
  op.redispatchBoxed(keys.remove(c10::DispatchKey::CustomRNGKeyId), stack);
}

// Set when operators were registered since the last registration of the
// key's kernels (the dispatcher calls listeners under its own lock: nothing
// may be registered from there).
std::atomic<bool> operators_added{true};

struct OperatorsAdded final : c10::OpRegistrationListener {
  void onOperatorRegistered(const c10::OperatorHandle&) override { operators_added = true; }
  void onOperatorDeregistered(const c10::OperatorHandle&) override {}
};

// Registers the key's kernels for the operators not seen yet. The
// registrations live as long as the process (never undone at exit, when the
// dispatcher may already be gone).
void register_keyed_kernels() {
  static std::mutex mu;
  static std::unordered_set<c10::OperatorName> seen;
  static auto& libraries = *new std::vector<std::unique_ptr<torch::Library>>();
  static auto* listening = new c10::RegistrationHandleRAII([] {
    c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
    TORCH_CHECK(!dispatcher.hasBackendFallbackForDispatchKey(c10::DispatchKey::CustomRNGKeyId),
                "RoundPipe: another library handles the CustomRNGKeyId dispatch key; keyed random streams on CPU "
                "devices need it");
    libraries.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, "_",
                                                         c10::DispatchKey::CustomRNGKeyId, __FILE__, __LINE__));
    libraries.back()->fallback(torch::CppFunction::makeFallthrough());
    return dispatcher.addRegistrationListener(std::make_unique<OperatorsAdded>());
  }());
  (void)listening;
  std::lock_guard<std::mutex> lock(mu);
  if (!operators_added.exchange(false)) return;
  c10::Dispatcher& dispatcher = c10::Dispatcher::singleton();
  std::map<std::string, std::vector<c10::OperatorName>> by_namespace;
  for (const c10::OperatorName& name : dispatcher.getAllOpNames()) {
    if (!seen.insert(name).second) continue;
    auto op = dispatcher.findOp(name);
    const auto ns = name.getNamespace();
    if (!op || !op->hasSchema() || !ns || op->hasKernelForDispatchKey(c10::DispatchKey::CompositeImplicitAutograd) ||
        op->hasKernelForDispatchKey(c10::DispatchKey::CustomRNGKeyId)) {
      continue;
    }
    bool needed = op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutograd) ||
                  op->hasKernelForDispatchKey(c10::DispatchKey::CompositeExplicitAutogradNonFunctional);
    for (const auto& a : op->schema().arguments()) needed = needed || is_optional_generator(a);
    if (needed) by_namespace[std::string(*ns)].push_back(name);
  }
  for (auto& [ns, names] : by_namespace) {
    libraries.push_back(std::make_unique<torch::Library>(torch::Library::IMPL, ns,
                                                         c10::DispatchKey::CustomRNGKeyId, __FILE__, __LINE__));
    for (const c10::OperatorName& name : names) {
      const std::string unqualified = name.name.substr(ns.size() + 2);
      const std::string full = name.overload_name.empty() ? unqualified : unqualified + "." + name.overload_name;
      libraries.back()->impl(full.c_str(), torch::CppFunction::makeFromBoxedFunction<&pass_keyed_generator>());
    }
  }
}

// Draws of this thread's CPU operators come from `gen` while it lives.
class KeyedGeneratorScope {
 public:
  explicit KeyedGeneratorScope(at::Generator* gen)
      : previous_(keyed_generator), include_(c10::DispatchKey::CustomRNGKeyId) {
    keyed_generator = gen;
  }
  ~KeyedGeneratorScope() { keyed_generator = previous_; }

 private:
  at::Generator* previous_;
  c10::impl::IncludeDispatchKeyGuard include_;
};

std::mutex& accelerator_generator_lock(c10::Device device) {
  // One lock per generator (several pool devices may share a GPU).
  static std::mutex locks[64];
  return locks[device.index() % 64];
}

}  // namespace

// Another thread may draw from the generator while we hold only our lock (the
// generator's own mutex guards each draw): its state is read and written under
// that mutex, or a torn read fails to restore ("Invalid mt19937 state").
at::Tensor generator_state(at::Generator& gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_generator_state(at::Generator& gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

std::mutex& cpu_generator_lock() {
  static std::mutex mu;
  return mu;
}

uint64_t stream_seed(uint64_t seed, int64_t call, int64_t layer, int64_t microbatch) {
  uint64_t h = splitmix64(seed);
  h = splitmix64(h ^ static_cast<uint64_t>(call));
  h = splitmix64(h ^ static_cast<uint64_t>(layer));
  return splitmix64(h ^ static_cast<uint64_t>(microbatch)) >> 1;  // keep it positive as int64
}

void prepare_keyed_runs() { register_keyed_kernels(); }

void without_random_fills(const std::function<void()>& fn) {
  register_keyed_kernels();
  c10::impl::IncludeDispatchKeyGuard include(c10::DispatchKey::CustomRNGKeyId);
  const bool previous = skipping_random_fills;
  skipping_random_fills = true;
  try {
    fn();
  } catch (...) {
    skipping_random_fills = previous;
    throw;
  }
  skipping_random_fills = previous;
}

void run_with_random_stream(c10::Device device, uint64_t seed, const std::function<void()>& fn) {
  if (device.is_cpu()) {
    // A fresh seed makes this thread's generator the stream's start, as it
    // would the process's generator: the same draws, without a lock.
    thread_local at::Generator own = at::detail::createCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(own.mutex());
      own.set_current_seed(seed);
    }
    KeyedGeneratorScope scope(&own);
    fn();
    return;
  }
  std::lock_guard<std::mutex> lock(accelerator_generator_lock(device));
  at::Generator gen = at::globalContext().defaultGenerator(device);
  at::Tensor saved = generator_state(gen);
  {
    std::lock_guard<std::mutex> draw_lock(gen.mutex());
    gen.set_current_seed(seed);
  }
  try {
    fn();
  } catch (...) {
    set_generator_state(gen, saved);
    throw;
  }
  set_generator_state(gen, saved);
}

}  // namespace roundpipe
