// The one precompiled header: libtorch's frontend, parsed once per build.
#pragma once
#include <torch/torch.h>
