// The spyre device generator: a CPU mt19937 tagged with the spyre device.
#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#include "runtime.h"

namespace spyre {

struct SpyreGeneratorImpl : public at::CPUGeneratorImpl {
  // The card's RNG is the CPU's Philox-free mt19937, tagged with the spyre
  // device so PyTorch routes it here; kernels draw through a CPU twin.
  explicit SpyreGeneratorImpl(c10::DeviceIndex index) {
    device_ = c10::Device(c10::DeviceType::PrivateUse1, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

const at::Generator& default_generator(c10::DeviceIndex index) {
  static std::once_flag flags[kMaxCards];
  static at::Generator gens[kMaxCards];
  if (index < 0) index = static_cast<c10::DeviceIndex>(t_current_device);
  check_device(index);
  std::call_once(flags[index], [&] {
    gens[index] = at::make_generator<SpyreGeneratorImpl>(index);
    gens[index].set_current_seed(c10::detail::getNonDeterministicRandom());
  });
  return gens[index];
}

at::Generator new_generator(c10::DeviceIndex index) {
  if (index < 0) index = static_cast<c10::DeviceIndex>(t_current_device);
  check_device(index);
  return at::make_generator<SpyreGeneratorImpl>(index);
}

}  // namespace spyre
