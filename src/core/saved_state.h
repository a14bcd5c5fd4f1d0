// The backend-specific state a forward leaves for its backward.
#pragma once

#include "megamoe/moe.h"

namespace megamoe {

struct MoeSaved::Impl {
  explicit Impl(Backend b) : backend(b) {}
  virtual ~Impl() = default;
  Backend backend;
};

}  // namespace megamoe
