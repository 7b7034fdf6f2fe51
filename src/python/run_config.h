// roundpipe.RoundPipeRunConfig (Python) -> roundpipe::RunConfig.
#pragma once

#include "python/python_common.h"
#include "roundpipe/run_config.h"

namespace roundpipe {
namespace python {

// `config`: a RoundPipeRunConfig or None (GIL held). Fields left None stay
// unset (inherit). TypeError / ValueError naming the field for bad values.
RunConfig to_run_config(const py::handle& config);

// A Python ModelExecutePlan (fwd_plan, bwd_plan: lists of range) and back.
ModelExecutePlan to_plan(const py::handle& plan);
py::object plan_to_python(const ModelExecutePlan& plan);

}  // namespace python
}  // namespace roundpipe
