// What spyre.cpp's card state shares with the other translation units of the
// extension (warm.cpp): the stick layout record, the locks and maps it lives
// in, the card clocks, and the allocation helpers.  Defined in spyre.cpp.
#pragma once

#include <ATen/ATen.h>
#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace spyre {

constexpr int kMaxCards = 8;
constexpr int64_t kStickBytes = 128;

struct Layout {  // stick layout of a storage made by empty (see layout.py)
  std::vector<int64_t> host_size;
  std::vector<int64_t> device_size;
  std::vector<int64_t> dim_map;
  c10::ScalarType dtype;
  bool custom = false;  // not the default layout of host_size (device_layout=)
};

extern std::mutex g_mutex;  // guards the block and layout maps
extern std::unordered_map<void*, Layout> g_layouts;
extern std::atomic<int64_t> g_clock_ps[kMaxCards];  // modelled device time

int64_t intern_layout(const Layout& l);
void check_device(int d);
Layout default_layout(c10::IntArrayRef size, c10::ScalarType dtype);
std::vector<int64_t> host_strides(c10::IntArrayRef size);
at::Tensor empty_with_layout(Layout layout, c10::IntArrayRef size, c10::IntArrayRef stride,
                             int device, int64_t logical_nbytes, int64_t layout_id = -1);

// warm.cpp: the warm elementwise launches' Python functions (_warm_*)
void def_warm(py::module_& m);

}  // namespace spyre
