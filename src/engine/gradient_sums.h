// The gradients a model's calls leave for its next step: one fp32 sum per
// parameter, on the host. This is the one place gradients are accumulated;
// its transitions are named:
//   add(call)           a successful call's gradients, in job order (so a sum
//                       does not depend on which devices ran the jobs)
//   take(store)         a step takes the sums of the parameters that have an
//                       optimizer copy; the calls after it sum afresh (the
//                       others stay, for synchronize)
//   take_model_grads()  a step also takes what synchronize() left in the
//                       parameters' .grad (add(other) sums them in)
//   move_to_model_grads()  synchronize(): the sums move to the parameters'
//                       .grad (model dtype), where a later step finds them
//
// Thread-safety: none. The model's instance belongs to its user thread; an
// instance taken by a step belongs to the optimizer thread from then on.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace roundpipe {

class Call;
class HostStore;

class GradientSums {
 public:
  explicit GradientSums(size_t num_params = 0) : sums_(num_params) {}
  // From saved sums (checkpoints), indexed by parameter id.
  explicit GradientSums(std::vector<at::Tensor> sums) : sums_(std::move(sums)) {}

  void add(const Call& call);
  // Out of place: `other`'s tensors may be the user's.
  void add(const GradientSums& other);
  GradientSums take(const HostStore& store);
  // The .grad of the parameters that have an optimizer copy, moved out of them.
  static GradientSums take_model_grads(HostStore& store);
  void move_to_model_grads(HostStore& store);

  bool empty() const;
  size_t size() const { return sums_.size(); }
  // [parameter id]: the fp32 sum, undefined where no gradient arrived.
  const std::vector<at::Tensor>& by_id() const { return sums_; }
  std::vector<at::Tensor>& by_id() { return sums_; }

 private:
  void add(int64_t id, const at::Tensor& grad);
  std::vector<at::Tensor> sums_;
};

}  // namespace roundpipe
