// Whether a layer's forward wrote its buffers, told exactly rather than
// guessed from the layer's type (docs/design/engine.md, "Iteration overlap"):
// a buffer no layer writes needs no write-back, and nothing waits for one.
//
// Each buffer is bound as a copy-on-write clone that alone owns its memory
// (c10/core/impl/COW.h). Reads leave it so. The first write through any
// alias, in place, through `.data`, `out=` or a view, takes the memory over
// without a copy and leaves an ordinary storage: that is the flag. A forward
// that replaces a buffer (`self.b = ...`), or changes its shape, strides or
// offset in place, leaves another storage or other metadata, which counts as
// a write too. A read through a kernel that asks for writable memory counts
// as a write: it costs a write-back, never a wrong value.
//
// Thread-safety: used by the device worker running one job, which binds the
// watched tensors and later reads what the layer holds.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace roundpipe {

class BufferWatch {
 public:
  // The tensors to bind instead of `uploaded` (one layer's buffers on the
  // device, complete for compute issued from now): clones made on the
  // device's current stream, watched for writes.
  std::vector<at::Tensor> watch(const std::vector<at::Tensor>& uploaded);

  // [buffer]: `now` (what the layer holds after its runs, in the order
  // watch() was given) differs from what watch() returned or was written.
  std::vector<char> written(const std::vector<at::Tensor>& now) const;

 private:
  std::vector<at::Tensor> bound_;  // [buffer] what watch() returned (keeps its storage alive)
};

}  // namespace roundpipe
