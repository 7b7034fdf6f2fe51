// roundpipe: training models larger than device memory from host-resident
// state, on a round-robin pool of devices. Include this header for the whole
// engine (CMake target roundpipe::roundpipe); the model presets, LoRA,
// safetensors and token data are a companion library: roundpipe/models.h
// (roundpipe::models).
#pragma once

#include <roundpipe/auto_plan.h>
#include <roundpipe/checkpoint.h>
#include <roundpipe/devices.h>
#include <roundpipe/grad_scaler.h>
#include <roundpipe/layer.h>
#include <roundpipe/microbatch.h>
#include <roundpipe/model.h>
#include <roundpipe/optimizer.h>
#include <roundpipe/plan.h>
#include <roundpipe/recompute.h>
#include <roundpipe/run_config.h>
#include <roundpipe/timer.h>
#include <roundpipe/trace.h>
