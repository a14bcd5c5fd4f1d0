// Backend cuda in a build without the CUDA toolkit: every entry says so.
#include "api/backends.h"

namespace megamoe {

struct MoeWorkspace::Impl {};
MoeWorkspace::MoeWorkspace(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
MoeWorkspace::~MoeWorkspace() = default;
size_t MoeWorkspace::size_bytes() const { return 0; }
int64_t MoeWorkspace::max_tokens() const { return 0; }
size_t MoeWorkspace::bytes_for(const MoeProblem&) { return 0; }

namespace {
Status no_cuda() { return unavailable("backend cuda: megamoe was built without CUDA"); }
}  // namespace

Status MoeWorkspace::create(const MoeProblem&, const MoeOptions&, int, std::unique_ptr<MoeWorkspace>*) {
  return no_cuda();
}
Status MoeWorkspace::check_device_errors(const MoeOptions&) const { return no_cuda(); }

namespace detail {
bool cuda_layer_available(std::string* why) {
  *why = "megamoe was built without CUDA";
  return false;
}
Status cuda_forward(const MoeProblem&, const MoeOptions&, const MoeInputs&, const TensorView&, MoeSaved*,
                    MoeWorkspace*) {
  return no_cuda();
}
Status cuda_backward(const MoeProblem&, const MoeOptions&, const MoeInputs&, const TensorView&, const MoeSaved&,
                     const MoeGrads&, MoeWorkspace*) {
  return no_cuda();
}
}  // namespace detail
}  // namespace megamoe
