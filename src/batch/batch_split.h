// The split of a model call's inputs: split_inputs (roundpipe/microbatch.h)
// for inputs that are one batch.
#pragma once

#include <roundpipe/microbatch.h>

#include <vector>

namespace roundpipe {

// split_inputs, and also c10::ValueError naming both when two tensors it
// splits (positional ones, or TensorChunkSpec leaves) do not have the same
// rows along their split dims: six input rows with three in another input
// are a mistake, not microbatches of uneven parts.
MicrobatchInputs split_batch_inputs(const std::vector<c10::IValue>& args, const Kwargs& kwargs, int64_t n,
                                    const InputSplit& how);

}  // namespace roundpipe
