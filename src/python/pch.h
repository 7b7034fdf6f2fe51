// Precompiled header of the Python extension: libtorch with its Python
// bindings and pybind11.
#pragma once

#include <torch/torch.h>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
