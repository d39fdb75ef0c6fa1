// The spyre device guard: current card, streams and events.  The simulated
// card runs each kernel to completion when it is launched, so streams are
// always idle and events complete on record; events carry the card's
// modelled clock (card_api.h), so elapsed_time is modelled device time.
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <atomic>

#include "runtime.h"

namespace spyre {

struct Event {
  double clock_s = 0.0;  // the card's modelled clock when recorded
  bool recorded = false;
};

thread_local int64_t t_current_stream[kMaxCards] = {0};
static std::atomic<int64_t> g_next_stream_id{1};

struct SpyreGuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static constexpr c10::DeviceType static_type = c10::DeviceType::PrivateUse1;

  c10::DeviceType type() const override { return static_type; }

  c10::Device exchangeDevice(c10::Device d) const override {
    auto old = getDevice();
    if (d.index() != old.index()) setDevice(d);
    return old;
  }
  c10::Device getDevice() const override {
    return c10::Device(static_type, static_cast<c10::DeviceIndex>(t_current_device));
  }
  void setDevice(c10::Device d) const override {
    check_device(d.index());
    t_current_device = d.index();
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.index() >= 0 && d.index() < card().num_cards()) t_current_device = d.index();
  }
  // A device without an index (torch.Stream(torch.device("spyre"))) means the
  // current card, as it does for tensors.
  static c10::Device resolved(c10::Device d) {
    if (d.has_index()) return d;
    return c10::Device(static_type, static_cast<c10::DeviceIndex>(t_current_device));
  }
  c10::Stream getStream(c10::Device d) const noexcept override {
    auto r = resolved(d);
    return c10::Stream(c10::Stream::UNSAFE, r, t_current_stream[r.index()]);
  }
  c10::Stream getDefaultStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, resolved(d));
  }
  c10::Stream getNewStream(c10::Device d, int priority = 0) const override {
    auto r = resolved(d);
    check_device(r.index());
    return c10::Stream(c10::Stream::UNSAFE, r, g_next_stream_id.fetch_add(1));
  }
  c10::Stream getStreamFromGlobalPool(c10::Device d, bool = false) const override {
    return getNewStream(d);
  }
  c10::Stream exchangeStream(c10::Stream s) const noexcept override {
    auto r = resolved(s.device());
    int idx = r.index();
    if (idx < 0 || idx >= card().num_cards()) return s;
    auto old = c10::Stream(c10::Stream::UNSAFE, r, t_current_stream[idx]);
    t_current_stream[idx] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(card().num_cards());
  }
  // The simulated card runs each kernel to completion when it is launched,
  // so streams are always idle and events complete on record.  Events carry
  // the card's modelled clock, so elapsed_time is modelled device time.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag) const override {
    if (*event == nullptr) *event = new Event();
    auto* e = static_cast<Event*>(*event);
    e->clock_s = card().clock(stream.device_index());
    e->recorded = true;
  }
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void* event, const c10::DeviceIndex) const noexcept override {
    delete static_cast<Event*>(event);
  }
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const c10::DeviceIndex) const override {
    auto* a = static_cast<Event*>(start);
    auto* b = static_cast<Event*>(end);
    TORCH_CHECK(a != nullptr && b != nullptr && a->recorded && b->recorded,
                "both events must be recorded before elapsed_time is called");
    return (b->clock_s - a->clock_s) * 1e3;  // ms
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, SpyreGuardImpl);

}  // namespace spyre
