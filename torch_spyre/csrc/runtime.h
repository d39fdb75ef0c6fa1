// What the PyTorch integration's translation units share (torch_spyre._C):
// the card's C interface, the stick layout record and the layout map, the
// current card, the allocator and the tensor constructors.
#pragma once

#include <ATen/ATen.h>
#include <torch/extension.h>

#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "card/card_api.h"

namespace spyre {

using spyre_card::kMaxCards;
using spyre_card::kStickBytes;

// The simulated card behind the device (card_api.h), set when _C is imported.
const spyre_card::Api& card();
void set_card_api(const spyre_card::Api* api);

struct Layout {  // stick layout of a storage made by empty (see layout.py)
  std::vector<int64_t> host_size;
  std::vector<int64_t> device_size;
  std::vector<int64_t> dim_map;
  c10::ScalarType dtype;
  bool custom = false;  // not the default layout of host_size (device_layout=)
};

extern std::mutex g_mutex;  // guards the layout maps
extern std::unordered_map<void*, Layout> g_layouts;
extern std::unordered_map<void*, int64_t> g_layout_of_ptr;
extern thread_local int t_current_device;

// layouts.cpp
int64_t intern_layout(const Layout& l);
void check_device(int d);
void check_dtype(c10::ScalarType dtype);
Layout default_layout(c10::IntArrayRef size, c10::ScalarType dtype);
int64_t layout_nbytes(const Layout& l);
std::vector<int64_t> host_strides(c10::IntArrayRef size);
at::Tensor empty_with_layout(Layout layout, c10::IntArrayRef size, c10::IntArrayRef stride,
                             int device, int64_t logical_nbytes, int64_t layout_id = -1);
at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype_opt,
                               std::optional<c10::Layout> layout_opt,
                               std::optional<c10::Device> device_opt,
                               std::optional<bool> pin_memory_opt,
                               std::optional<c10::MemoryFormat> memory_format_opt);
at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype_opt,
                         std::optional<c10::Layout> layout_opt,
                         std::optional<c10::Device> device_opt,
                         std::optional<bool> pin_memory_opt);

// allocator.cpp
c10::DataPtr allocate_on(size_t nbytes, int device);
c10::Allocator* device_allocator();

// aten.cpp
void resize_bytes(c10::StorageImpl* storage, size_t newsize);
const at::Tensor& resize_metadata_(const at::Tensor& self, c10::IntArrayRef size,
                                   std::optional<c10::MemoryFormat> memory_format);

// generator.cpp
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);

// Python functions of each part (module.cpp calls them)
void def_access(py::module_& m);
void def_warm(py::module_& m);

}  // namespace spyre
