// Backend cuda in a build without the CUDA toolkit: every entry says so.
#include "api/backends.h"

namespace megamoe::detail {
namespace {
Status no_cuda() { return unavailable("backend cuda: megamoe was built without CUDA"); }
}  // namespace

bool cuda_layer_available(std::string* why) {
  *why = "megamoe was built without CUDA";
  return false;
}
Status cuda_forward(const MoeProblem&, const MoeOptions&, const MoeInputs&, const TensorView&, const MoeBuffers&) {
  return no_cuda();
}
Status cuda_backward(const MoeProblem&, const MoeOptions&, const MoeInputs&, const TensorView&, const MoeGrads&,
                     const MoeBuffers&) {
  return no_cuda();
}
Status cuda_check_device_errors(int, void*) { return no_cuda(); }
Status cuda_fill_fp8_weights(const MoeProblem&, const MoeOptions&, const TensorView&, const TensorView&,
                             const MoeBuffers&) {
  return no_cuda();
}
Status cuda_peer_check(int, const PeerViewArgs&, void*, int64_t*) { return no_cuda(); }
Status cuda_ep_sizes(const MoeProblem&, const MoeOptions&, int64_t, bool, EpSizes*) { return no_cuda(); }
Status cuda_ep_forward(const MoeProblem&, const MoeOptions&, const MoeInputs&, const TensorView&, const EpArgs&,
                       const MoeBuffers&) {
  return no_cuda();
}
Status cuda_ep_backward(const MoeProblem&, const MoeOptions&, const MoeInputs&, const TensorView&, const MoeGrads&,
                        const EpArgs&, const MoeBuffers&) {
  return no_cuda();
}

}  // namespace megamoe::detail
