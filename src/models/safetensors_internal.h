// Pieces of the safetensors writer shared by the single-file and the sharded
// writer (safetensors.cpp, safetensors_sharded.cpp).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "roundpipe/safetensors.h"

namespace roundpipe {

// The format's name of `dtype` ("F32", ...); nullptr when safetensors (or this
// libtorch) has no such dtype.
const char* safetensors_dtype_name(at::ScalarType dtype);

// Checks that `tensors` can be written (see save_safetensors); throws
// c10::ValueError naming `path`, the tensor and the fault otherwise.
void check_tensors_for_safetensors(const NamedTensors& tensors, const std::string& path);

// The indices of `tensors` in the writer's order: element size, largest
// first, then name.
std::vector<size_t> safetensors_write_order(const NamedTensors& tensors);

}  // namespace roundpipe
