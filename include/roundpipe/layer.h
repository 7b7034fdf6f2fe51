// How the engine calls a layer (one child of the wrapped Sequential).
//
// A layer is called with its positional arguments and keyword arguments:
// layer 0 with the call's input_args / input_kwargs, every later layer with the
// previous layer's output as its only argument (as torch::nn::Sequential does).
//
//  - A module that implements ValueLayer is called through it, so layers can
//    pass any c10::IValue (tuples of tensors, dicts, scalars, None).
//  - Any other module (torch::nn::Linear, Functional, ...) is called as
//    forward(Tensor) -> Tensor: it must receive exactly one tensor argument.
//
// Every layer must be cloneable (derive from torch::nn::Cloneable<Impl>, as
// the built-in modules do): each device runs its own structural replica, bound
// to the parameters it uploaded, so that several devices can run the same layer
// at once.
#pragma once

#include <ATen/core/ivalue.h>

#include <vector>

#include <roundpipe/microbatch.h>

namespace roundpipe {

class ValueLayer {
 public:
  virtual ~ValueLayer() = default;
  // `args`: the call's positional args for layer 0, else {previous output}.
  // `kwargs`: the call's keyword args for layer 0, else empty.
  virtual c10::IValue forward(std::vector<c10::IValue> args, Kwargs kwargs) = 0;
};

// Random numbers: every run of a layer draws from its device's generator set
// from (seed, call, layer, microbatch), so recomputation repeats whatever the
// layer draws, whenever it draws (dropout that depends on the input or the
// mode included). CPU devices share one generator, so such runs take turns.
// A module that never draws random numbers, in any mode and for any input,
// may derive from RandomFree to say so: its runs then skip the generator and
// run at the same time on CPU devices. (A RandomFree module that draws
// breaks recomputation and device-count invariance.)
class RandomFree {
 public:
  virtual ~RandomFree() = default;
};

}  // namespace roundpipe
