// What torch_spyre's Python runtime reads of device tensors, in one call
// each on the eager hot path: the layout behind a storage, its device bytes
// as a CPU tensor, whole kernel operands, new operands, and the current card.
#include <torch/csrc/Generator.h>

#include "runtime.h"

namespace spyre {

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
  int64_t n = card().block_bytes(ptr);
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
  int64_t have = card().block_bytes(ptr);
  TORCH_CHECK(need <= have, "device tensor of ", need, " bytes over a block of ", have);
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

void def_access(py::module_& m) {
  m.def("_layout_of", &layout_of);
  m.def("_layout_id", &layout_id);
  m.def("_default_generator", [](int d) {
    return py::reinterpret_steal<py::object>(THPGenerator_initDefaultGenerator(
        default_generator(static_cast<c10::DeviceIndex>(d))));
  });
  m.def("_drop_layout", [](const at::Tensor& t) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_layouts.erase(t.storage().data_ptr().get());
    g_layout_of_ptr.erase(t.storage().data_ptr().get());
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
  m.def("_device_bytes", &device_bytes);
  m.def("_device_tensor", &device_tensor);
  m.def("_empty_in_layout", &empty_in_layout);
  m.def("_whole_operand", &whole_operand);
  m.def("_empty_operand", &empty_operand);
  m.def("_resize_metadata", [](const at::Tensor& t, std::vector<int64_t> size) {
    resize_metadata_(t, size, std::nullopt);
  });
  m.def("_get_device", []() { return t_current_device; });
  m.def("_set_device", [](int d) {
    check_device(d);
    t_current_device = d;
  });
  m.def("_device_count", []() { return card().num_cards(); });
}

}  // namespace spyre
