// The thin C++ part of the spyre device: what PyTorch only accepts from C++.
//
//  * a c10 Allocator over the simulated card's device memory (capacity per
//    card, statistics, OOM as torch.OutOfMemoryError), which also records the
//    stick layout of every storage made by empty/empty_strided;
//  * the device guard (current card, streams, events) and PrivateUse1 hooks;
//  * the device generator;
//  * the metadata-only aten kernels (empty, views, set_, resize_) that must not
//    go through Python;
//  * the card state (card.h) that warm.cpp's warm launch of the commonest
//    elementwise ops reads; gemm.cpp and dl16.cpp are the executor's.
//    Everything else that touches values is in Python.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/core/GeneratorForPrivateuseone.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#include <torch/csrc/Generator.h>
#include <torch/library.h>

#include <sys/mman.h>
#include <immintrin.h>

#include <ATen/Parallel.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "card.h"

namespace spyre {

// ---------------------------------------------------------------- card state
struct CardStats {
  int64_t allocated = 0;      // bytes held by live storages (whole sticks)
  int64_t peak = 0;
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
  int64_t num_ooms = 0;
  int64_t capacity = 0;       // usable device memory
  int64_t bytes_in = 0;       // cumulative bytes allocated / freed
  int64_t bytes_out = 0;
};


struct Block {
  int64_t nbytes;
  int device;
  int64_t id;  // unique over the process's life: a reused address is a new block
};

std::mutex g_mutex;
static int g_num_cards = 1;
static CardStats g_stats[kMaxCards];
// ordered, so the block holding any address inside it is found (block_of)
static std::map<void*, Block> g_blocks;
static int64_t g_next_block_id = 0;
std::unordered_map<void*, Layout> g_layouts;
// Distinct layouts get small ids, so Python can cache its layout objects by
// id instead of rebuilding them from sizes on every op.
static std::unordered_map<std::string, int64_t> g_layout_ids;
static std::unordered_map<void*, int64_t> g_layout_of_ptr;

int64_t intern_layout(const Layout& l) {
  std::string key = std::to_string(static_cast<int>(l.dtype));
  for (auto v : l.host_size) key += "," + std::to_string(v);
  key += "|";
  for (auto v : l.device_size) key += "," + std::to_string(v);
  key += "|";
  for (auto v : l.dim_map) key += "," + std::to_string(v);
  auto it = g_layout_ids.find(key);
  if (it != g_layout_ids.end()) return it->second;
  int64_t id = static_cast<int64_t>(g_layout_ids.size());
  g_layout_ids.emplace(std::move(key), id);
  return id;
}
std::atomic<int64_t> g_clock_ps[kMaxCards];  // modelled device time
thread_local int t_current_device = 0;

// Host memory behind large device blocks: anonymous mappings are zero and
// lazily backed like calloc's, and transparent huge pages make first touch
// (loading weights) ~4x cheaper than 4 KiB page faults.
constexpr size_t kHugeBytes = size_t(2) << 20;

static void* host_alloc_zeroed(size_t nbytes) {
  if (nbytes < kHugeBytes) return std::calloc(1, nbytes);
  void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  madvise(p, nbytes, MADV_HUGEPAGE);  // advisory: ignored where THP is off
  return p;
}

static void host_free(void* p, size_t nbytes) {
  if (p == nullptr) return;
  if (nbytes < kHugeBytes) std::free(p);
  else munmap(p, nbytes);
}

static int64_t round_to_stick(int64_t n) {
  return (n + kStickBytes - 1) / kStickBytes * kStickBytes;
}

void check_device(int d) {
  TORCH_CHECK(d >= 0 && d < g_num_cards, "spyre:", d, " does not exist: this process has ",
              g_num_cards, " spyre card(s) (set TORCH_SPYRE_NUM_CARDS, 1..", kMaxCards,
              ", before importing torch_spyre)");
}

static std::string fmt_bytes(int64_t b) {
  char buf[64];
  double v = static_cast<double>(b);
  if (v >= 1024.0 * 1024 * 1024) snprintf(buf, sizeof buf, "%.2f GiB", v / (1024.0 * 1024 * 1024));
  else if (v >= 1024.0 * 1024) snprintf(buf, sizeof buf, "%.2f MiB", v / (1024.0 * 1024));
  else if (v >= 1024.0) snprintf(buf, sizeof buf, "%.2f KiB", v / 1024.0);
  else snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(b));
  return buf;
}

// ------------------------------------------------------------------ allocator
static void free_block(void* ptr) {
  if (ptr == nullptr) return;
  size_t nbytes = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_blocks.find(ptr);
    if (it != g_blocks.end()) {
      nbytes = static_cast<size_t>(it->second.nbytes);
      auto& s = g_stats[it->second.device];
      s.allocated -= it->second.nbytes;
      s.bytes_out += it->second.nbytes;
      s.num_frees += 1;
      g_blocks.erase(it);
    }
    g_layouts.erase(ptr);
    g_layout_of_ptr.erase(ptr);
  }
  host_free(ptr, nbytes);
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
    int64_t rounded = round_to_stick(static_cast<int64_t>(nbytes));
    void* ptr = nullptr;
    {
      std::lock_guard<std::mutex> lock(g_mutex);
      auto& s = g_stats[device];
      if (s.allocated + rounded > s.capacity) {
        s.num_ooms += 1;
        TORCH_CHECK_WITH(OutOfMemoryError, false, "spyre:", device,
                         " is out of device memory: tried to allocate ", fmt_bytes(rounded),
                         "; the card holds ", fmt_bytes(s.capacity), " of which ",
                         fmt_bytes(s.allocated), " are in use by live tensors and ",
                         fmt_bytes(s.capacity - s.allocated),
                         " are free. Free tensors you no longer need (del, or let them go "
                         "out of scope), use smaller batches, or configure a larger card "
                         "(TORCH_SPYRE_DEVICE_MEMORY).");
      }
      if (rounded > 0) {
        ptr = host_alloc_zeroed(static_cast<size_t>(rounded));
        TORCH_CHECK_WITH(OutOfMemoryError, ptr != nullptr,
                         "the host ran out of memory simulating ", fmt_bytes(rounded),
                         " of spyre device memory");
        g_blocks[ptr] = Block{rounded, device, g_next_block_id++};
        s.allocated += rounded;
        s.bytes_in += rounded;
        s.peak = std::max(s.peak, s.allocated);
      }
      s.num_allocs += 1;
    }
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
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto& s = g_stats[device];
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
    std::lock_guard<std::mutex> lock(g_mutex);
    auto& s = g_stats[device];
    int64_t live = s.num_allocs - s.num_frees;
    s.num_allocs = live;
    s.num_frees = 0;
    s.num_ooms = 0;
    s.bytes_in = s.allocated;
    s.bytes_out = 0;
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(g_mutex);
    g_stats[device].peak = g_stats[device].allocated;
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    check_device(device);
    std::lock_guard<std::mutex> lock(g_mutex);
    const auto& s = g_stats[device];
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

// ------------------------------------------------------------------- layouts
// The default stick layout (hardware.md): [d0..dn-1] ->
// [d1..d(n-2), ceil(dn-1/stick), d0, stick]; 1-D -> [ceil(d0/stick), stick];
// scalar -> [1, stick].  Must match torch_spyre/layout.py (tested).
Layout default_layout(c10::IntArrayRef size, c10::ScalarType dtype) {
  Layout l;
  l.host_size = size.vec();
  l.dtype = dtype;
  int64_t se = kStickBytes / static_cast<int64_t>(c10::elementSize(dtype));
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  int64_t n = static_cast<int64_t>(size.size());
  if (n == 0) {
    l.device_size = {1, se};
    l.dim_map = {-1, -1};
  } else if (n == 1) {
    l.device_size = {cdiv(size[0], se), se};
    l.dim_map = {0, 0};
  } else {
    for (int64_t k = 1; k < n - 1; ++k) {
      l.device_size.push_back(size[k]);
      l.dim_map.push_back(k);
    }
    l.device_size.push_back(cdiv(size[n - 1], se));
    l.dim_map.push_back(n - 1);
    l.device_size.push_back(size[0]);
    l.dim_map.push_back(0);
    l.device_size.push_back(se);
    l.dim_map.push_back(n - 1);
  }
  return l;
}

static int64_t layout_nbytes(const Layout& l) {
  int64_t n = 1;
  for (auto s : l.device_size) n *= s;
  return n * static_cast<int64_t>(c10::elementSize(l.dtype));
}

std::vector<int64_t> host_strides(c10::IntArrayRef size) {
  std::vector<int64_t> strides(size.size());
  int64_t acc = 1;
  for (int64_t i = static_cast<int64_t>(size.size()) - 1; i >= 0; --i) {
    strides[i] = acc;
    acc *= std::max<int64_t>(size[i], 1);
  }
  return strides;
}

static int device_of(std::optional<c10::Device> device_opt) {
  if (device_opt.has_value() && device_opt->has_index()) return device_opt->index();
  return t_current_device;
}

static void check_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: case at::kBFloat16: case at::kFloat: case at::kChar: case at::kByte:
    case at::kShort: case at::kInt: case at::kLong: case at::kBool:
    case at::kFloat8_e4m3fn: case at::kFloat8_e5m2:
      return;
    default:
      break;
  }
  C10_THROW_ERROR(TypeError, std::string("spyre does not store ") + c10::toString(dtype) +
                                 "; supported dtypes are float16, bfloat16, float32, "
                                 "float8_e4m3fn, float8_e5m2, int8, uint8, int16, int32, int64, "
                                 "bool. Cast first, e.g. "
                                 "tensor.to(torch.float32) or tensor.to(torch.float16).");
}

// A tensor whose storage holds `layout` in device memory.  The storage's
// nbytes stay the *logical* size PyTorch expects; the block behind it is the
// padded device size.
// `layout_id`: its interned id when the caller has it (-1: intern it here).
at::Tensor empty_with_layout(Layout layout, c10::IntArrayRef size, c10::IntArrayRef stride,
                             int device, int64_t logical_nbytes, int64_t layout_id) {
  auto dtype = layout.dtype;
  auto data = g_allocator.allocate_on(static_cast<size_t>(layout_nbytes(layout)), device);
  void* ptr = data.get();
  if (ptr != nullptr) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_layout_of_ptr[ptr] = layout_id >= 0 ? layout_id : intern_layout(layout);
    g_layouts[ptr] = std::move(layout);
  }
  auto storage = c10::Storage(c10::Storage::use_byte_size_t(), logical_nbytes, std::move(data),
                              &g_allocator, /*resizable=*/true);
  auto t = at::detail::make_tensor<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::scalarTypeToTypeMeta(dtype));
  t.unsafeGetTensorImpl()->set_sizes_and_strides(size, stride);
  return t;
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype_opt,
                               std::optional<c10::Layout> layout_opt,
                               std::optional<c10::Device> device_opt,
                               std::optional<bool> pin_memory_opt,
                               std::optional<c10::MemoryFormat> memory_format_opt) {
  auto dtype = c10::dtype_or_default(dtype_opt);
  check_dtype(dtype);
  for (auto s : size) TORCH_CHECK(s >= 0, "negative dimension ", s, " in size ", size);
  int device = device_of(device_opt);
  check_device(device);
  auto mf = memory_format_opt.value_or(c10::MemoryFormat::Contiguous);
  if (mf == c10::MemoryFormat::Contiguous || mf == c10::MemoryFormat::Preserve) {
    auto nbytes = at::detail::computeStorageNbytesContiguous(size, c10::elementSize(dtype));
    return empty_with_layout(default_layout(size, dtype), size, host_strides(size), device,
                             static_cast<int64_t>(nbytes));
  }
  // channels_last & co: the default layout of the logical sizes, restrided.
  // Any bijection between storage elements and the layout's host elements is
  // consistent, since every access goes through the same mapping.
  auto nbytes = at::detail::computeStorageNbytesContiguous(size, c10::elementSize(dtype));
  auto t = empty_with_layout(default_layout(size, dtype), size, host_strides(size),
                             device, static_cast<int64_t>(nbytes));
  t.unsafeGetTensorImpl()->empty_tensor_restride(mf);
  return t;
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype_opt,
                         std::optional<c10::Layout> layout_opt,
                         std::optional<c10::Device> device_opt,
                         std::optional<bool> pin_memory_opt) {
  auto dtype = c10::dtype_or_default(dtype_opt);
  check_dtype(dtype);
  for (auto s : size) TORCH_CHECK(s >= 0, "negative dimension ", s, " in size ", size);
  int device = device_of(device_opt);
  check_device(device);
  auto itemsize = c10::elementSize(dtype);
  auto nbytes = static_cast<int64_t>(at::detail::computeStorageNbytes(size, stride, itemsize));
  if (stride.vec() == host_strides(size)) {
    return empty_with_layout(default_layout(size, dtype), size, stride, device, nbytes);
  }
  // Arbitrary strides: the storage elements in a 1-D (linear) stick layout.
  int64_t storage_numel = nbytes / static_cast<int64_t>(itemsize);
  return empty_with_layout(default_layout({storage_numel}, dtype), size, stride, device, nbytes);
}

// ------------------------------------------------------- metadata-only ops
at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Tensor view(const at::Tensor& self, c10::IntArrayRef size) {
  return at::native::view(self, size);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride) {
  return at::native::as_strided_tensorimpl(self, size, stride, std::nullopt);
}

// Grows a storage to `newsize` bytes.  Contents are kept byte for byte, so
// the storage keeps its layout only when it has none (linear) or stays the
// same size; a laid-out storage that grows is re-laid as linear by Python
// (torch_spyre.runtime.resize) before it gets here.
static void resize_bytes(c10::StorageImpl* storage, size_t newsize) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  int device = storage->device().has_index() ? storage->device().index() : t_current_device;
  auto old_ptr = storage->data_ptr().get();
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    TORCH_CHECK(old_ptr == nullptr || g_layouts.find(old_ptr) == g_layouts.end() ||
                    newsize == storage->nbytes(),
                "internal error: a spyre storage with a stick layout cannot be resized in place");
  }
  auto data = g_allocator.allocate_on(newsize, device);
  size_t keep = std::min(newsize, storage->nbytes());
  if (keep > 0 && old_ptr != nullptr) std::memcpy(data.get(), old_ptr, keep);
  storage->set_data_ptr_noswap(std::move(data));
  storage->set_nbytes(newsize);
}

static void ensure_storage_fits(const at::Tensor& self) {
  auto impl = self.unsafeGetTensorImpl();
  if (self.numel() == 0) return;
  size_t needed = at::detail::computeStorageNbytes(self.sizes(), self.strides(),
                                                   self.dtype().itemsize(),
                                                   impl->storage_offset());
  if (needed <= impl->storage().nbytes()) return;
  void* ptr = impl->storage().data_ptr().get();
  bool laid_out;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    laid_out = ptr != nullptr && g_layouts.count(ptr) > 0;
  }
  TORCH_CHECK(!laid_out, "sizes ", self.sizes(), ", strides ", self.strides(), " and storage offset ",
              impl->storage_offset(), " need ", needed, " bytes of storage but this spyre storage "
              "holds ", impl->storage().nbytes(), " and, being laid out in sticks, cannot grow in "
              "place. Use tensor.resize_(...) (which re-lays it) or allocate a larger tensor.");
  resize_bytes(impl->storage().unsafeGetStorageImpl(), needed);
}

at::Tensor& set_storage(at::Tensor& self, c10::Storage source, int64_t storage_offset,
                        c10::IntArrayRef size, c10::IntArrayRef stride) {
  at::native::checkSetStorage(self, source, storage_offset, size, stride);
  auto impl = self.unsafeGetTensorImpl();
  impl->set_storage_offset(storage_offset);
  std::vector<int64_t> strides = stride.data() ? stride.vec() : host_strides(size);
  impl->set_sizes_and_strides(size, strides);
  ensure_storage_fits(self);
  return self;
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  int64_t n = static_cast<int64_t>(source.nbytes() / self.dtype().itemsize());
  return set_storage(self, source, 0, {n}, {1});
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  if (!self.is_same(source)) {
    set_storage(self, source.storage(), source.storage_offset(), source.sizes(), source.strides());
  }
  return self;
}

at::Tensor& set_empty(at::Tensor& self) {
  auto fresh = empty_with_layout(default_layout({0}, self.scalar_type()), {0}, {1},
                                 self.device().index(), 0);
  return set_storage(self, fresh.storage(), 0, {0}, {1});
}

// resize_ of a tensor whose storage is large enough only changes metadata;
// growth goes through Python (which moves laid-out contents correctly).
const at::Tensor& resize_metadata_(const at::Tensor& self, c10::IntArrayRef size,
                                   std::optional<c10::MemoryFormat> memory_format) {
  auto impl = self.unsafeGetTensorImpl();
  impl->set_sizes_contiguous(size);
  if (memory_format.has_value() && *memory_format != c10::MemoryFormat::Preserve) {
    impl->empty_tensor_restride(*memory_format);
  }
  ensure_storage_fits(self);
  return self;
}

// Module.to("spyre") swaps each Parameter's data in place (param.data = new)
// when the two tensor types are shallow-copy compatible; PyTorch's default
// says no for PrivateUse1, which would make new Parameter objects and untie
// shared weights (embeddings tied to the LM head).  Dense CPU and spyre
// tensors are both plain TensorImpls.
static bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto plain = [](const at::Tensor& t) {
    auto d = t.device().type();
    return t.layout() == at::kStrided &&
           (d == c10::DeviceType::CPU || d == c10::DeviceType::PrivateUse1);
  };
  return plain(self) && plain(from);
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", view);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("set_.source_Storage_storage_offset", set_storage);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_", set_empty);
}

// ----------------------------------------------------------------- autocast
// torch.autocast("spyre"): the same op lists CUDA uses (matmuls and convs in
// the lower-precision dtype, reductions and losses in fp32); everything else
// falls through.  Only C++ can register autocast wrappers.
#define SPYRE_LOWER(op, ...) KERNEL_PRIVATEUSEONE(op, ##__VA_ARGS__, lower_precision_fp)
#define SPYRE_FP32(op, ...) KERNEL_PRIVATEUSEONE(op, ##__VA_ARGS__, fp32)

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  AT_FORALL_LOWER_PRECISION_FP(SPYRE_LOWER)
  AT_FORALL_FP32(SPYRE_FP32)
}

// -------------------------------------------------------------- generators
struct SpyreGeneratorImpl : public at::CPUGeneratorImpl {
  // The card's RNG is the CPU's Philox-free mt19937, tagged with the spyre
  // device so PyTorch routes it here; kernels draw through a CPU twin.
  explicit SpyreGeneratorImpl(c10::DeviceIndex index) {
    device_ = c10::Device(c10::DeviceType::PrivateUse1, index);
    key_set_ = c10::DispatchKeySet(c10::DispatchKey::PrivateUse1);
  }
};

static const at::Generator& default_generator(c10::DeviceIndex index) {
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

static at::Generator new_generator(c10::DeviceIndex index) {
  if (index < 0) index = static_cast<c10::DeviceIndex>(t_current_device);
  check_device(index);
  return at::make_generator<SpyreGeneratorImpl>(index);
}



// ------------------------------------------------------------ device guard
struct Event {
  int64_t clock_ps = 0;
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
    if (d.index() >= 0 && d.index() < g_num_cards) t_current_device = d.index();
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
    if (idx < 0 || idx >= g_num_cards) return s;
    auto old = c10::Stream(c10::Stream::UNSAFE, r, t_current_stream[idx]);
    t_current_stream[idx] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(g_num_cards);
  }
  // The simulated card runs each kernel to completion when it is launched,
  // so streams are always idle and events complete on record.  Events carry
  // the card's modelled clock, so elapsed_time is modelled device time.
  void record(void** event, const c10::Stream& stream, const c10::DeviceIndex device_index,
              const c10::EventFlag) const override {
    if (*event == nullptr) *event = new Event();
    auto* e = static_cast<Event*>(*event);
    e->clock_ps = g_clock_ps[stream.device_index()].load();
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
    return static_cast<double>(b->clock_ps - a->clock_ps) * 1e-9;  // ms
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, SpyreGuardImpl);

// ------------------------------------------------------------------- hooks
struct SpyreHooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_num_cards > 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(g_num_cards);
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
    if (d < 0 || d >= g_num_cards) return getCurrentDevice();
    return exchangeDevice(d);
  }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex d) const override {
    return default_generator(d);
  }
  at::Generator getNewGenerator(c10::DeviceIndex d) const override { return new_generator(d); }
  at::Device getDeviceFromPtr(void* data) const override {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_blocks.find(data);
    int d = it != g_blocks.end() ? it->second.device : t_current_device;
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

// ------------------------------------------------------- Python-side access
static void init_cards(int num_cards, std::vector<int64_t> capacities) {
  std::lock_guard<std::mutex> lock(g_mutex);
  TORCH_CHECK(num_cards >= 1 && num_cards <= kMaxCards, "TORCH_SPYRE_NUM_CARDS must be 1..",
              kMaxCards, ", got ", num_cards);
  TORCH_CHECK(static_cast<int>(capacities.size()) == num_cards, "one capacity per card");
  for (int i = 0; i < num_cards; ++i) {
    TORCH_CHECK(capacities[i] >= g_stats[i].allocated, "spyre:", i, " capacity ",
                fmt_bytes(capacities[i]), " is below what is in use (",
                fmt_bytes(g_stats[i].allocated), ")");
    g_stats[i].capacity = capacities[i];
  }
  g_num_cards = num_cards;
}

static py::dict stats(int device) {
  check_device(device);
  std::lock_guard<std::mutex> lock(g_mutex);
  const auto& s = g_stats[device];
  py::dict d;
  d["allocated_bytes"] = s.allocated;
  d["peak_allocated_bytes"] = s.peak;
  d["num_allocs"] = s.num_allocs;
  d["num_frees"] = s.num_frees;
  d["num_ooms"] = s.num_ooms;
  d["capacity_bytes"] = s.capacity;
  int64_t live = 0;
  for (const auto& kv : g_blocks) live += kv.second.device == device;
  d["live_blocks"] = live;
  return d;
}

static void reset_peak(int device) {
  check_device(device);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_stats[device].peak = g_stats[device].allocated;
}

// (host_size, device_size, dim_map) of the storage behind `t`, or None when
// the storage is linear (made by the allocator directly, e.g. torch.load).
static py::object layout_of(const at::Tensor& t) {
  void* ptr = t.storage().data_ptr().get();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_layouts.find(ptr);
  if (it == g_layouts.end()) return py::none();
  const auto& l = it->second;
  return py::make_tuple(py::cast(l.host_size), py::cast(l.device_size), py::cast(l.dim_map),
                        py::cast(c10::toString(l.dtype)));
}

// The interned id of the layout behind `t`, or -1 for a linear storage.
static int64_t layout_id(const at::Tensor& t) {
  void* ptr = t.storage().data_ptr().get();
  std::lock_guard<std::mutex> lock(g_mutex);
  auto it = g_layout_of_ptr.find(ptr);
  return it == g_layout_of_ptr.end() ? -1 : it->second;
}

// A CPU tensor aliasing the device bytes of `t`'s storage (whole block,
// padding included).  It keeps the storage alive.  This is how the simulated
// card reads and writes its memory; nothing else should use it.
static at::Tensor device_bytes(const at::Tensor& t) {
  TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1, "not a spyre tensor");
  auto storage = t.storage();
  void* ptr = storage.data_ptr().get();
  int64_t n = 0;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_blocks.find(ptr);
    if (it != g_blocks.end()) n = it->second.nbytes;
  }
  auto keep = new c10::Storage(storage);
  return at::from_blob(
      ptr, {n}, [keep](void*) { delete keep; }, at::TensorOptions().dtype(at::kByte));
}

// device_bytes(t) viewed as `dtype` of `sizes` (row-major): the device tensor
// of a storage's layout, in one call on the eager hot path.
static at::Tensor device_tensor(const at::Tensor& t, c10::ScalarType dtype,
                                std::vector<int64_t> sizes) {
  TORCH_CHECK(t.device().type() == c10::DeviceType::PrivateUse1, "not a spyre tensor");
  auto storage = t.storage();
  void* ptr = storage.data_ptr().get();
  int64_t need = static_cast<int64_t>(c10::elementSize(dtype));
  for (auto s : sizes) need *= s;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_blocks.find(ptr);
    int64_t have = it != g_blocks.end() ? it->second.nbytes : 0;
    TORCH_CHECK(need <= have, "device tensor of ", need, " bytes over a block of ", have);
  }
  auto keep = new c10::Storage(storage);
  return at::from_blob(
      ptr, sizes, [keep](void*) { delete keep; }, at::TensorOptions().dtype(dtype));
}

// A contiguous tensor of `size` whose storage holds the stick layout
// (host_size, device_size, dim_map) of `like`'s dtype: IBM's device_layout=
// (torch_spyre/compat.py checks that host_size has as many elements as size).
static at::Tensor empty_in_layout(std::vector<int64_t> size, std::vector<int64_t> host_size,
                                  std::vector<int64_t> device_size, std::vector<int64_t> dim_map,
                                  const at::Tensor& like, int device) {
  auto dtype = like.scalar_type();
  check_dtype(dtype);
  check_device(device);
  for (auto s : size) TORCH_CHECK(s >= 0, "negative dimension ", s, " in size ", size);
  Layout l{std::move(host_size), std::move(device_size), std::move(dim_map), dtype};
  auto d = default_layout(l.host_size, dtype);
  l.custom = d.device_size != l.device_size || d.dim_map != l.dim_map;
  auto nbytes = at::detail::computeStorageNbytesContiguous(size, c10::elementSize(dtype));
  TORCH_CHECK(static_cast<int64_t>(nbytes) <= layout_nbytes(l), "a layout of ",
              layout_nbytes(l), " device bytes cannot hold a tensor of size ", size);
  return empty_with_layout(std::move(l), size, host_strides(size), device,
                           static_cast<int64_t>(nbytes));
}

// (id, base address) of the device block holding address `addr`, or (-1, 0).
// The simulator keys its host-side views of device memory by block id
// (torch_spyre/sim/hostviews.py): an id is never reused, so a view of a
// freed block can never be mistaken for one of a new block at its address.
static std::pair<int64_t, int64_t> block_of(int64_t addr) {
  std::lock_guard<std::mutex> lock(g_mutex);
  auto p = reinterpret_cast<void*>(addr);
  auto it = g_blocks.upper_bound(p);
  if (it == g_blocks.begin()) return {-1, 0};
  --it;
  auto base = static_cast<char*>(it->first);
  if (static_cast<char*>(p) >= base + it->second.nbytes) return {-1, 0};
  return {it->second.id, reinterpret_cast<int64_t>(base)};
}

// A CPU tensor over `ptr` (device memory of `storage`, which it keeps alive).
static at::Tensor alias_of(const c10::Storage& storage, void* ptr, c10::IntArrayRef sizes,
                           c10::ScalarType dtype) {
  auto keep = new c10::Storage(storage);
  return at::from_blob(
      ptr, sizes, [keep](void*) { delete keep; }, at::TensorOptions().dtype(dtype));
}

// The device memory of `t` as a whole kernel operand, in one call on the eager
// hot path: a CPU tensor aliasing its block as the row-major device tensor of
// its storage's layout, when `t` is all of its storage in that layout (offset
// 0, contiguous, the layout's dtype and host sizes); None otherwise (the
// caller re-lays it first).  Same test as operands._whole_layout.
static py::object whole_operand(const at::Tensor& t) {
  if (t.storage_offset() != 0 || !t.is_contiguous()) return py::none();
  const auto& storage = t.storage();
  void* ptr = storage.data_ptr().get();
  std::vector<int64_t> device_size;
  c10::ScalarType dtype;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    auto it = g_layouts.find(ptr);
    if (it == g_layouts.end()) return py::none();
    const auto& l = it->second;
    if (l.custom || l.dtype != t.scalar_type() || l.host_size != t.sizes().vec()) {
      return py::none();
    }
    device_size = l.device_size;
    dtype = l.dtype;
  }
  if (ptr == nullptr) return py::none();  // nothing allocated (empty)
  return py::cast(alias_of(storage, ptr, device_size, dtype));
}

// A new spyre tensor in the default layout and its device memory (as
// whole_operand gives it), in one call: a kernel's output.
static py::tuple empty_operand(std::vector<int64_t> sizes, c10::ScalarType dtype, int device) {
  auto t = empty_memory_format(sizes, dtype, std::nullopt,
                               c10::Device(c10::DeviceType::PrivateUse1,
                                           static_cast<c10::DeviceIndex>(device)),
                               std::nullopt, std::nullopt);
  void* ptr = t.storage().data_ptr().get();
  if (ptr == nullptr) return py::make_tuple(t, py::none());
  auto l = default_layout(sizes, dtype);
  return py::make_tuple(t, alias_of(t.storage(), ptr, l.device_size, dtype));
}

// ------------------------------------------------- stick <-> host copies
// The executor converts stick-layout device memory to host layout in the
// compute dtype (fp16 -> fp32).  As a strided TensorIterator copy that is
// ~2x slower than a plain cast; this loop moves one stick (a contiguous run
// of both tensors) at a time with the F16C/AVX-512 conversion instructions.
// Values are exactly torch's (fp16 -> fp32 is exact).
__attribute__((target("avx512f"))) static void half_to_float_avx512(const uint16_t* s, float* d,
                                                                    int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(h));
  }
  for (; i < n; ++i) d[i] = c10::detail::fp16_ieee_to_fp32_value(s[i]);
}

__attribute__((target("avx2,f16c"))) static void half_to_float_f16c(const uint16_t* s, float* d,
                                                                   int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
    _mm256_storeu_ps(d + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) d[i] = c10::detail::fp16_ieee_to_fp32_value(s[i]);
}

static void half_to_float_scalar(const uint16_t* s, float* d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) d[i] = c10::detail::fp16_ieee_to_fp32_value(s[i]);
}

using RunFn = void (*)(const uint16_t*, float*, int64_t);

static RunFn half_to_float_fn() {
  static RunFn fn = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return &half_to_float_avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c")) {
      return &half_to_float_f16c;
    }
    return &half_to_float_scalar;
  }();
  return fn;
}

// dst.copy_(src) for a contiguous dst and a src whose last dim is contiguous
// (a permuted view of device memory); fp16 -> fp32, or same dtype.
// Returns false (the caller falls back to copy_) for anything else.
static bool stick_copy(const at::Tensor& src, at::Tensor& dst) {
  if (src.sizes() != dst.sizes() || !dst.is_contiguous() || src.dim() == 0 ||
      src.stride(-1) != 1 || src.device().type() != c10::DeviceType::CPU ||
      dst.device().type() != c10::DeviceType::CPU) {
    return false;
  }
  auto st = src.scalar_type(), dt = dst.scalar_type();
  RunFn run = nullptr;
  size_t same = 0;
  if (dt == at::kFloat && st == at::kHalf) run = half_to_float_fn();
  else if (dt == st) same = c10::elementSize(st);
  else return false;
  const int64_t inner = src.size(-1);
  const int64_t rows = inner == 0 ? 0 : src.numel() / inner;
  const int64_t nd = src.dim() - 1;
  auto sizes = src.sizes().vec();
  auto strides = src.strides().vec();
  const char* sbase = static_cast<const char*>(src.const_data_ptr());
  char* dbase = static_cast<char*>(dst.data_ptr());
  const int64_t ses = static_cast<int64_t>(c10::elementSize(st));
  const int64_t des = static_cast<int64_t>(c10::elementSize(dt));
  at::parallel_for(0, rows, std::max<int64_t>(1, 32768 / std::max<int64_t>(inner, 1)),
                   [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> idx(nd, 0);
    int64_t rem = r0;
    for (int64_t d = nd - 1; d >= 0; --d) {  // row r0's coordinates
      idx[d] = rem % sizes[d];
      rem /= sizes[d];
    }
    int64_t off = 0;
    for (int64_t d = 0; d < nd; ++d) off += idx[d] * strides[d];
    for (int64_t r = r0; r < r1; ++r) {
      const char* sp = sbase + off * ses;
      char* dp = dbase + r * inner * des;
      if (run) run(reinterpret_cast<const uint16_t*>(sp), reinterpret_cast<float*>(dp), inner);
      else std::memcpy(dp, sp, static_cast<size_t>(inner) * same);
      for (int64_t d = nd - 1; d >= 0; --d) {  // next row: odometer
        off += strides[d];
        if (++idx[d] < sizes[d]) break;
        off -= strides[d] * sizes[d];
        idx[d] = 0;
      }
    }
  });
  return true;
}

static void advance_clock(int device, double seconds) {
  check_device(device);
  g_clock_ps[device].fetch_add(static_cast<int64_t>(seconds * 1e12));
}

static double clock_s(int device) {
  check_device(device);
  return static_cast<double>(g_clock_ps[device].load()) * 1e-12;
}

}  // namespace spyre

namespace spyre {
// gemm.cpp: the executor's matmul against a weight in its stick layout
at::Tensor stick_gemm(const at::Tensor& a, const at::Tensor& w, int64_t k, int64_t chunk,
                      int64_t parts, bool simd);
// dl16.cpp: the card's DL16 format
at::Tensor dl16_encode(const at::Tensor& values);
at::Tensor dl16_decode(const at::Tensor& bits);
}  // namespace spyre

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("_stick_gemm", &spyre::stick_gemm, py::arg("a"), py::arg("w"), py::arg("k"),
        py::arg("chunk"), py::arg("parts"), py::arg("simd") = true);
  m.def("_dl16_encode", &spyre::dl16_encode);
  m.def("_dl16_decode", &spyre::dl16_decode);
  m.def("_init_cards", &spyre::init_cards);
  m.def("_stats", &spyre::stats);
  m.def("_reset_peak", &spyre::reset_peak);
  m.def("_layout_of", &spyre::layout_of);
  m.def("_layout_id", &spyre::layout_id);
  m.def("_default_generator", [](int d) {
    return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(
        spyre::default_generator(static_cast<c10::DeviceIndex>(d))));
  });
  m.def("_drop_layout", [](const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(spyre::g_mutex);
    spyre::g_layouts.erase(t.storage().data_ptr().get());
    spyre::g_layout_of_ptr.erase(t.storage().data_ptr().get());
  });
  // The device blocks behind two storages of one logical size trade places
  // (a linear storage taking the block a re-lay filled: access.adopt_default).
  m.def("_swap_blocks", [](const at::Tensor& a, const at::Tensor& b) {
    auto sa = a.storage().unsafeGetStorageImpl();
    auto sb = b.storage().unsafeGetStorageImpl();
    TORCH_CHECK(sa->nbytes() == sb->nbytes() && a.device() == b.device(),
                "internal error: _swap_blocks needs storages of one size on one device");
    at::DataPtr pa = sa->set_data_ptr(at::DataPtr(nullptr, a.device()));
    at::DataPtr pb = sb->set_data_ptr(std::move(pa));
    sa->set_data_ptr_noswap(std::move(pb));
  });
  m.def("_device_bytes", &spyre::device_bytes);
  m.def("_device_tensor", &spyre::device_tensor);
  m.def("_empty_in_layout", &spyre::empty_in_layout);
  m.def("_advance_clock", &spyre::advance_clock);
  m.def("_block_of", &spyre::block_of);
  m.def("_whole_operand", &spyre::whole_operand);
  m.def("_stick_copy", [](const at::Tensor& src, at::Tensor dst) {
    return spyre::stick_copy(src, dst);
  });
  m.def("_empty_operand", &spyre::empty_operand);
  m.def("_clock_s", &spyre::clock_s);
  m.def("_resize_metadata", [](const at::Tensor& t, std::vector<int64_t> size) {
    spyre::resize_metadata_(t, size, std::nullopt);
  });
  m.def("_get_device", []() { return spyre::t_current_device; });
  m.def("_set_device", [](int d) {
    spyre::check_device(d);
    spyre::t_current_device = d;
  });
  m.def("_device_count", []() { return spyre::g_num_cards; });
  spyre::def_warm(m);
}
