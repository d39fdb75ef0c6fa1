// torch_spyre._C: the PyTorch integration of the spyre device, one file per
// integration point (as PyTorch's OpenReg does):
//
//   allocator.cpp  c10 allocator over the card's memory, host allocator
//   layouts.cpp    stick layouts of storages, empty / empty_strided
//   aten.cpp       metadata-only aten kernels (views, set_, resize_), autocast
//   generator.cpp  the device generator
//   guard.cpp      device guard: current card, streams, events
//   hooks.cpp      PrivateUse1 hooks
//   access.cpp     what the Python runtime reads of device tensors
//   warm.cpp       the C++ warm launch of the commonest elementwise ops
//   aoti.cpp       AOTInductor's model runner for spyre packages
//   module.cpp     this module: binds the card's C interface, the functions
//
// The device itself, the simulated card (its memory and modelled clock), is
// torch_spyre._card (csrc/card/), reached only through card_api.h.
// Everything else that touches values is in Python.
#include "runtime.h"

namespace spyre {

static const spyre_card::Api* g_card_api = nullptr;

const spyre_card::Api& card() { return *g_card_api; }

void set_card_api(const spyre_card::Api* api) {
  TORCH_CHECK(api != nullptr && api->version == spyre_card::kApiVersion,
              "torch_spyre._card has card API version ", api ? api->version : -1,
              ", torch_spyre._C needs ", spyre_card::kApiVersion,
              ": rebuild the package (pip install -e .)");
  g_card_api = api;
}

}  // namespace spyre

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  auto capsule = py::module_::import("torch_spyre._card").attr("api");
  spyre::set_card_api(static_cast<const spyre_card::Api*>(
      PyCapsule_GetPointer(capsule.ptr(), spyre_card::kCapsuleName)));
  spyre::def_access(m);
  spyre::def_warm(m);
}
