// The companion library of the engine (CMake target roundpipe::models):
// Llama/Qwen3 decoder presets and their chunked loss, LoRA adapters (their
// frozen weights optionally kept packed), safetensors checkpoints, token
// files, packing and the resumable data order, and a small built-in corpus.
// It uses only the engine's public API (roundpipe/roundpipe.h).
#pragma once

#include <roundpipe/lora.h>
#include <roundpipe/packed_linear.h>
#include <roundpipe/presets.h>
#include <roundpipe/roundpipe.h>
#include <roundpipe/safetensors.h>
#include <roundpipe/token_data.h>
