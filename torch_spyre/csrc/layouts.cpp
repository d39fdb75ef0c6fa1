// Stick layouts of storages: the default layout (must match
// torch_spyre/layout.py, tested), the layout map every storage made here is
// recorded in, and the tensor constructors (empty, empty_strided) that make
// them.
#include <ATen/EmptyTensor.h>

#include <string>

#include "runtime.h"

namespace spyre {

std::mutex g_mutex;
std::unordered_map<void*, Layout> g_layouts;
// Distinct layouts get small ids, so Python can cache its layout objects by
// id instead of rebuilding them from sizes on every op.
static std::unordered_map<std::string, int64_t> g_layout_ids;
std::unordered_map<void*, int64_t> g_layout_of_ptr;
thread_local int t_current_device = 0;

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
void check_device(int d) {
  int n = card().num_cards();
  TORCH_CHECK(d >= 0 && d < n, "spyre:", d, " does not exist: this process has ", n,
              " spyre card(s) (set TORCH_SPYRE_NUM_CARDS, 1..", kMaxCards,
              ", before importing torch_spyre)");
}

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

int64_t layout_nbytes(const Layout& l) {
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

void check_dtype(c10::ScalarType dtype) {
  switch (dtype) {
    case at::kHalf: case at::kBFloat16: case at::kFloat: case at::kChar: case at::kByte:
    case at::kShort: case at::kInt: case at::kLong: case at::kBool:
    case at::kFloat8_e4m3fn: case at::kFloat8_e5m2:
    case at::kComplexFloat:  // interleaved fp32 pairs: 16 per stick
      return;
    default:
      break;
  }
  C10_THROW_ERROR(TypeError, std::string("spyre does not store ") + c10::toString(dtype) +
                                 "; supported dtypes are float16, bfloat16, float32, "
                                 "float8_e4m3fn, float8_e5m2, int8, uint8, int16, int32, int64, "
                                 "bool, complex64. Cast first, e.g. "
                                 "tensor.to(torch.float32) or tensor.to(torch.float16).");
}

// A tensor whose storage holds `layout` in device memory.  The storage's
// nbytes stay the *logical* size PyTorch expects; the block behind it is the
// padded device size.
// `layout_id`: its interned id when the caller has it (-1: intern it here).
at::Tensor empty_with_layout(Layout layout, c10::IntArrayRef size, c10::IntArrayRef stride,
                             int device, int64_t logical_nbytes, int64_t layout_id) {
  auto dtype = layout.dtype;
  auto data = allocate_on(static_cast<size_t>(layout_nbytes(layout)), device);
  void* ptr = data.get();
  if (ptr != nullptr) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_layout_of_ptr[ptr] = layout_id >= 0 ? layout_id : intern_layout(layout);
    g_layouts[ptr] = std::move(layout);
  }
  auto storage = c10::Storage(c10::Storage::use_byte_size_t(), logical_nbytes, std::move(data),
                              device_allocator(), /*resizable=*/true);
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

}  // namespace spyre
