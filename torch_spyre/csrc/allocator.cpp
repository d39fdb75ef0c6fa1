// The c10 allocator of spyre device memory, over the card's memory
// (card_api.h: blocks of whole sticks against each card's capacity), and the
// host allocator torch.accelerator's host-memory API talks to.
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <ATen/core/CachingHostAllocator.h>

#include <cstring>

#include "runtime.h"

namespace spyre {

static std::string fmt_bytes(int64_t b) {
  char buf[64];
  double v = static_cast<double>(b);
  if (v >= 1024.0 * 1024 * 1024) snprintf(buf, sizeof buf, "%.2f GiB", v / (1024.0 * 1024 * 1024));
  else if (v >= 1024.0 * 1024) snprintf(buf, sizeof buf, "%.2f MiB", v / (1024.0 * 1024));
  else if (v >= 1024.0) snprintf(buf, sizeof buf, "%.2f KiB", v / 1024.0);
  else snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(b));
  return buf;
}

static void free_block(void* ptr) {
  if (ptr == nullptr) return;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_layouts.erase(ptr);
    g_layout_of_ptr.erase(ptr);
  }
  card().free(ptr);
}

// A DeviceAllocator, so torch.accelerator's memory API (empty_cache,
// memory_stats, get_memory_info, ...) works on spyre as on CUDA.  Nothing is
// cached: a freed block goes back at once, so emptyCache has nothing to do,
// and launches are synchronous, so recordStream has nothing to track.
struct SpyreAllocator final : public c10::DeviceAllocator {
  // Device memory is host memory of the simulating process; calloc keeps
  // padding zero and, for large blocks, only touches pages really written.
  c10::DataPtr allocate_on(size_t nbytes, int device) {
    check_device(device);
    TORCH_CHECK(static_cast<int64_t>(nbytes) >= 0, "cannot allocate a negative number of bytes (",
                static_cast<int64_t>(nbytes), ") on spyre:", device);
    int64_t rounded = spyre_card::round_to_stick(static_cast<int64_t>(nbytes));
    void* ptr = nullptr;
    auto got = card().malloc(device, static_cast<int64_t>(nbytes), &ptr);
    if (got == spyre_card::kMallocOverCapacity) {
      spyre_card::MemStats s;
      card().mem_stats(device, &s);
      TORCH_CHECK_WITH(OutOfMemoryError, false, "spyre:", device,
                       " is out of device memory: tried to allocate ", fmt_bytes(rounded),
                       "; the card holds ", fmt_bytes(s.capacity), " of which ",
                       fmt_bytes(s.allocated), " are in use by live tensors and ",
                       fmt_bytes(s.capacity - s.allocated),
                       " are free. Free tensors you no longer need (del, or let them go "
                       "out of scope), use smaller batches, or configure a larger card "
                       "(TORCH_SPYRE_DEVICE_MEMORY).");
    }
    TORCH_CHECK_WITH(OutOfMemoryError, got == spyre_card::kMallocOk,
                     "the host ran out of memory simulating ", fmt_bytes(rounded),
                     " of spyre device memory");
    return {ptr, ptr, &free_block,
            c10::Device(c10::DeviceType::PrivateUse1, static_cast<c10::DeviceIndex>(device))};
  }

  c10::DataPtr allocate(size_t nbytes) override {
    return allocate_on(nbytes, t_current_device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return &free_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    // storage clones copy raw device bytes: layout travels with the bytes
    std::memcpy(dest, src, count);
  }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}
  void recordStream(const c10::DataPtr&, c10::Stream) override {}

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex device) override {
    check_device(device);
    spyre_card::MemStats s;
    card().mem_stats(device, &s);
    c10::CachingDeviceAllocator::DeviceStats out;
    auto fill = [&](c10::CachingDeviceAllocator::StatArray& a, int64_t cur, int64_t peak,
                    int64_t in, int64_t freed) {
      auto& st = a[static_cast<size_t>(c10::CachingDeviceAllocator::StatType::AGGREGATE)];
      st.current = cur;
      st.peak = peak;
      st.allocated = in;
      st.freed = freed;
    };
    int64_t live = s.num_allocs - s.num_frees;
    fill(out.allocation, live, live, s.num_allocs, s.num_frees);
    fill(out.segment, live, live, s.num_allocs, s.num_frees);
    fill(out.active, live, live, s.num_allocs, s.num_frees);
    // bytes: every block is its own segment, held exactly while in use
    for (auto* a : {&out.allocated_bytes, &out.reserved_bytes, &out.active_bytes,
                    &out.requested_bytes}) {
      fill(*a, s.allocated, s.peak, s.bytes_in, s.bytes_out);
    }
    out.num_ooms = s.num_ooms;
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device);
    card().reset_accumulated(device);
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    card().reset_peak(device);
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_device(device);
    spyre_card::MemStats s;
    card().mem_stats(device, &s);
    return {static_cast<size_t>(s.capacity - s.allocated), static_cast<size_t>(s.capacity)};
  }
};

static SpyreAllocator g_allocator;
REGISTER_ALLOCATOR(c10::DeviceType::PrivateUse1, &g_allocator);

// The host side of copies is ordinary CPU memory (the simulated card reads
// it directly, there is no pinning); this allocator exists so that
// torch.accelerator's host-memory API (empty_host_cache, host_memory_stats)
// has something to talk to for spyre instead of a null pointer.
struct SpyreHostAllocator final : public at::HostAllocator {
  c10::DataPtr allocate(size_t nbytes) override { return c10::GetCPUAllocator()->allocate(nbytes); }
  c10::DeleterFnPtr raw_deleter() const override { return c10::GetCPUAllocator()->raw_deleter(); }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override { return at::HostStats(); }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};

static SpyreHostAllocator g_host_allocator;
REGISTER_HOST_ALLOCATOR(at::kPrivateUse1, &g_host_allocator);

c10::DataPtr allocate_on(size_t nbytes, int device) { return g_allocator.allocate_on(nbytes, device); }
c10::Allocator* device_allocator() { return &g_allocator; }

}  // namespace spyre
