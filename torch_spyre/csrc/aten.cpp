// The aten kernels of spyre that only touch metadata (views, set_, resize_)
// and must not go through Python, and the autocast op lists.
#include <ATen/autocast_mode.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <torch/library.h>

#include <cstring>

#include "runtime.h"

namespace spyre {

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
void resize_bytes(c10::StorageImpl* storage, size_t newsize) {
  TORCH_CHECK(storage->resizable(), "Trying to resize storage that is not resizable");
  int device = storage->device().has_index() ? storage->device().index() : t_current_device;
  auto old_ptr = storage->data_ptr().get();
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    TORCH_CHECK(old_ptr == nullptr || g_layouts.find(old_ptr) == g_layouts.end() ||
                    newsize == storage->nbytes(),
                "internal error: a spyre storage with a stick layout cannot be resized in place");
  }
  auto data = allocate_on(newsize, device);
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

// autocast
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

}  // namespace spyre
