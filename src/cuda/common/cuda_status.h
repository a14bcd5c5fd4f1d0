// A CUDA runtime result as a Status: the one place that turns cudaError_t into an error message.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "megamoe/status.h"

namespace megamoe::cuda {

// Ok for cudaSuccess, else an internal error "<what>: <CUDA's message>".
inline Status cuda_status(const std::string& what, cudaError_t err) {
  if (err == cudaSuccess) return Status::Ok();
  return internal_error(what + ": " + cudaGetErrorString(err));
}

// The status of the last kernel launch on this thread (clears the launch error).
inline Status check_launch(const std::string& what) { return cuda_status(what, cudaGetLastError()); }

}  // namespace megamoe::cuda
