// roundpipe: training models larger than device memory from host-resident
// state, on a round-robin pool of devices. Include this header for the whole
// public API.
#pragma once

#include <roundpipe/auto_plan.h>
#include <roundpipe/checkpoint.h>
#include <roundpipe/devices.h>
#include <roundpipe/grad_scaler.h>
#include <roundpipe/layer.h>
#include <roundpipe/lora.h>
#include <roundpipe/microbatch.h>
#include <roundpipe/model.h>
#include <roundpipe/optimizer.h>
#include <roundpipe/plan.h>
#include <roundpipe/presets.h>
#include <roundpipe/recompute.h>
#include <roundpipe/run_config.h>
#include <roundpipe/safetensors.h>
#include <roundpipe/timer.h>
#include <roundpipe/token_data.h>
#include <roundpipe/trace.h>
