// What CUDA devices this process sees. Built from device_query.cu when the
// CUDA toolkit is present, from device_query_none.cpp otherwise.
#pragma once

#include <string>

namespace megamoe::cuda {

// Number of visible CUDA devices; 0 (and a reason in *why) when none or no CUDA build.
int device_count(std::string* why);
// Name and compute capability of device `index`, e.g. "NVIDIA H200 (sm_90)".
std::string device_description(int index);

}  // namespace megamoe::cuda
