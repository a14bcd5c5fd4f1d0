#include "cuda/device_query.h"

namespace megamoe::cuda {

int device_count(std::string* why) {
  if (why) *why = "megamoe was built without CUDA";
  return 0;
}

std::string device_description(int) { return "none"; }

}  // namespace megamoe::cuda
