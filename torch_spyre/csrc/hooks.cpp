// The PrivateUse1 hooks of spyre (device count, current device, generators,
// pointers, storage resize).
#include <ATen/detail/PrivateUse1HooksInterface.h>

#include "runtime.h"

namespace spyre {

struct SpyreHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return card().num_cards() > 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(card().num_cards());
  }
  void setCurrentDevice(c10::DeviceIndex d) const override {
    check_device(d);
    t_current_device = d;
  }
  c10::DeviceIndex getCurrentDevice() const override {
    return static_cast<c10::DeviceIndex>(t_current_device);
  }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex d) const override {
    auto old = getCurrentDevice();
    setCurrentDevice(d);
    return old;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex d) const override {
    if (d < 0 || d >= card().num_cards()) return getCurrentDevice();
    return exchangeDevice(d);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex d) const override {
    return default_generator(d);
  }
  at::Generator getNewGenerator(c10::DeviceIndex d) const override { return new_generator(d); }
  at::Device getDeviceFromPtr(void* data) const override {
    int d = card().block_card(data);
    if (d < 0) d = t_current_device;
    return at::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(d));
  }
  bool isPinnedPtr(const void*) const override { return false; }
  at::Allocator* getPinnedMemoryAllocator() const override { return at::getCPUAllocator(); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    resize_bytes(storage.unsafeGetStorageImpl(), newsize);
  }
};

static bool register_hooks() {
  static SpyreHooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  return true;
}
static bool g_hooks_registered = register_hooks();

}  // namespace spyre
