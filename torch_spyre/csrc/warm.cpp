// The warm launch of the commonest elementwise ops (add, sub, mul, div on
// whole operands of one shape and dtype), from what Python recorded of its own
// first launch of the same call; it reads the layout map (runtime.h) and
// accounts its launches on the card (card_api.h).
#include <ATen/ATen.h>
#include <ATen/ops/add_compositeexplicitautogradnonfunctional_dispatch.h>
#include <ATen/ops/div_compositeexplicitautogradnonfunctional_dispatch.h>
#include <ATen/ops/mul_compositeexplicitautogradnonfunctional_dispatch.h>
#include <ATen/ops/sub_compositeexplicitautogradnonfunctional_dispatch.h>
#include <ATen/record_function.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime.h"

namespace spyre {

// ------------------------------------------------- warm elementwise launches
// A warm `a + b` on two small spyre tensors costs ~15 us through PyTorch's
// composite add.Tensor (output allocation, add.out redispatched to our boxed
// Python fallback, the kernel cache, operand binding, the executor, the card's
// accounting), 8x host torch; a Python kernel cannot go below ~6 us.  So the
// commonest calls are served here, from what the Python path did the first
// time: Python launches each (op, shape, dtype, card) once, then records it
// with warm_put (its modelled time, how the executor computed it, its
// dispatch-stats name).  A later call that matches, on whole default-layout
// operands, gets what the Python path would have done, in C++:
//  * the same output allocation (default layout, through the allocator);
//  * the same CPU kernel on the device bytes as the executor's same-layout
//    elementwise runner (sim/executor.py, _same_layout_elementwise): add/sub/
//    mul straight into the output in its dtype (the op's out= form), div in
//    fp32 then rounded once into the output; padding included, as there;
//  * the same modelled time: one kernel of its modelled time accounted on
//    the card (card_api.h, account_kernel), which the Python path's launches
//    add to too, so the floating-point sums are the very same additions in
//    the same order;
//  * the same dispatch-stats and kernel-cache hit counts, taken by Python
//    (warm_counts, warm_take_hits) when it reports them.
// The output is a fresh block (a new block id), so no host view of it can
// exist to go stale (sim/hostviews.py).  Anything else goes to PyTorch's
// composite kernel, i.e. exactly the route these ops took before this
// existed (same errors, same records): a miss, a view or other non-whole
// operand, broadcasting, mixed dtypes or devices, a host scalar, alpha != 1,
// RecordFunction callbacks (torch.profiler), and whatever Python turns the
// path off for (warm_allow: a trace listener, timing-only runs, the
// TORCH_SPYRE_WARM_PATH switch).  Python records only calls the executor ran
// in one of the two forms above (never DL16 memory, which goes through the
// layouts).
enum WarmOp { kWarmAdd = 0, kWarmSub = 1, kWarmMul = 2, kWarmDiv = 3, kWarmOps = 4 };
constexpr int kWarmMaxDims = 8;

struct WarmKey {
  int op = 0, device = 0, dtype = 0, ndim = 0;
  int64_t sizes[kWarmMaxDims] = {};
  bool operator==(const WarmKey& o) const {
    return op == o.op && device == o.device && dtype == o.dtype && ndim == o.ndim &&
           std::memcmp(sizes, o.sizes, sizeof(int64_t) * ndim) == 0;
  }
};

struct WarmKeyHash {
  size_t operator()(const WarmKey& k) const {
    size_t h = (static_cast<size_t>(k.op) * 31 + k.device) * 131 + k.dtype;
    for (int i = 0; i < k.ndim; ++i) h = h * 1000003u ^ static_cast<size_t>(k.sizes[i]);
    return h;
  }
};

struct WarmEntry {
  double time_s;           // the program's modelled time on this card
  bool upcast;             // computed in fp32, rounded once into the output
  Layout layout;           // the output's (default) layout, and its id
  int64_t layout_id;
  std::vector<int64_t> strides;
  int64_t nbytes;          // the output storage's logical bytes
  std::string stat;        // the Python path's dispatch-stats name ("add.out")
  int64_t pending = 0;     // launches not yet counted in Python
};

static std::mutex g_warm_mutex;
static std::unordered_map<WarmKey, WarmEntry, WarmKeyHash> g_warm;
static std::unordered_map<std::string, int64_t> g_warm_orphans;  // counts of cleared entries
static std::atomic<bool> g_warm_allowed{false};
static int64_t g_warm_served = 0;  // over the process's life (tests)
static int64_t g_warm_hits = 0;    // kernel-cache hits not yet counted in Python

static bool warm_key(int op, const at::Tensor& t, WarmKey& k) {
  auto sizes = t.sizes();
  if (sizes.empty() || sizes.size() > static_cast<size_t>(kWarmMaxDims)) return false;
  k.op = op;
  k.device = t.device().index();
  k.dtype = static_cast<int>(t.scalar_type());
  k.ndim = static_cast<int>(sizes.size());
  std::memcpy(k.sizes, sizes.data(), sizeof(int64_t) * k.ndim);
  return true;
}

// `t` is all of its storage in the default layout of its sizes and dtype, with
// row-major strides (the test of whole_operand, strides exact): its device
// bytes as they lie are the operand the executor's runner would see.
static void* warm_whole(const at::Tensor& t) {
  if (t.storage_offset() != 0) return nullptr;
  auto sizes = t.sizes();
  auto strides = t.strides();
  int64_t acc = 1;
  for (int64_t i = static_cast<int64_t>(sizes.size()) - 1; i >= 0; --i) {
    if (strides[i] != acc) return nullptr;
    acc *= std::max<int64_t>(sizes[i], 1);
  }
  void* ptr = t.storage().data_ptr().get();
  if (ptr == nullptr) return nullptr;
  auto it = g_layouts.find(ptr);  // caller holds g_mutex
  if (it == g_layouts.end()) return nullptr;
  const auto& l = it->second;
  if (l.custom || l.dtype != t.scalar_type() || !(sizes == c10::IntArrayRef(l.host_size))) {
    return nullptr;
  }
  return ptr;
}

static std::optional<at::Tensor> warm_launch(int op, const at::Tensor& a, const at::Tensor& b) {
  if (!g_warm_allowed.load(std::memory_order_relaxed) || at::hasCallbacks()) return std::nullopt;
  if (!a.defined() || !b.defined() || a.device() != b.device() ||
      a.device().type() != c10::DeviceType::PrivateUse1 || a.scalar_type() != b.scalar_type() ||
      a.sizes() != b.sizes()) {
    return std::nullopt;
  }
  WarmKey key;
  if (!warm_key(op, a, key)) return std::nullopt;
  void* pa;
  void* pb;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    pa = warm_whole(a);
    pb = warm_whole(b);
  }
  if (pa == nullptr || pb == nullptr) return std::nullopt;
  std::lock_guard<std::mutex> lock(g_warm_mutex);
  auto it = g_warm.find(key);
  if (it == g_warm.end()) return std::nullopt;
  auto& e = it->second;
  auto out = empty_with_layout(e.layout, a.sizes(), e.strides, key.device, e.nbytes, e.layout_id);
  void* po = out.storage().data_ptr().get();
  auto opts = at::TensorOptions().dtype(a.scalar_type());
  const auto& dsize = e.layout.device_size;
  auto x = at::from_blob(pa, dsize, opts);
  auto y = at::from_blob(pb, dsize, opts);
  auto o = at::from_blob(po, dsize, opts);
  if (e.upcast) {  // the executor's `run`: inputs to fp32, the functional op, one rounding
    auto xf = x.to(at::kFloat);
    auto yf = y.to(at::kFloat);
    switch (op) {
      case kWarmAdd: o.copy_(at::add(xf, yf)); break;
      case kWarmSub: o.copy_(at::sub(xf, yf)); break;
      case kWarmMul: o.copy_(at::mul(xf, yf)); break;
      default: o.copy_(at::div(xf, yf)); break;
    }
  } else {  // the executor's `run_into`: the op's out= form on the device tensors
    switch (op) {
      case kWarmAdd: at::add_out(o, x, y); break;
      case kWarmSub: at::sub_out(o, x, y); break;
      case kWarmMul: at::mul_out(o, x, y); break;
      default: at::div_out(o, x, y); break;
    }
  }
  // the accounting of SimulatedCard.account
  card().account_kernel(key.device, e.time_s);
  e.pending += 1;
  g_warm_served += 1;
  g_warm_hits += 1;
  return out;
}

static bool alpha_is_one(const c10::Scalar& alpha) {
  return alpha.isIntegral(/*includeBool=*/false) && alpha.to<int64_t>() == 1;
}

// The PrivateUse1 kernels.  On a miss each calls PyTorch's own composite
// kernel of the op directly (what the dispatcher chose for spyre before this
// registration: it allocates the output and redispatches the out= overload
// to our Python fallback), so every other call behaves exactly as before.
static at::Tensor warm_add(const at::Tensor& self, const at::Tensor& other,
                           const c10::Scalar& alpha) {
  if (alpha_is_one(alpha)) {
    if (auto out = warm_launch(kWarmAdd, self, other)) return *out;
  }
  return at::compositeexplicitautogradnonfunctional::add(self, other, alpha);
}

static at::Tensor warm_sub(const at::Tensor& self, const at::Tensor& other,
                           const c10::Scalar& alpha) {
  if (alpha_is_one(alpha)) {
    if (auto out = warm_launch(kWarmSub, self, other)) return *out;
  }
  return at::compositeexplicitautogradnonfunctional::sub(self, other, alpha);
}

static at::Tensor warm_mul(const at::Tensor& self, const at::Tensor& other) {
  if (auto out = warm_launch(kWarmMul, self, other)) return *out;
  return at::compositeexplicitautogradnonfunctional::mul(self, other);
}

static at::Tensor warm_div(const at::Tensor& self, const at::Tensor& other) {
  if (auto out = warm_launch(kWarmDiv, self, other)) return *out;
  return at::compositeexplicitautogradnonfunctional::div(self, other);
}

// Python (ops/pointwise.py) after its launch of `op` on operands of `sizes`
// and `dtype` on card `device`: serve the next such calls here.
static void warm_put(int op, int device, c10::ScalarType dtype, std::vector<int64_t> sizes,
                     double time_s, bool upcast, std::string stat) {
  check_device(device);
  TORCH_CHECK(op >= 0 && op < kWarmOps, "warm op ", op);
  TORCH_CHECK(!sizes.empty() && sizes.size() <= static_cast<size_t>(kWarmMaxDims),
              "warm shape of ", sizes.size(), " dims");
  WarmKey key;
  key.op = op;
  key.device = device;
  key.dtype = static_cast<int>(dtype);
  key.ndim = static_cast<int>(sizes.size());
  std::memcpy(key.sizes, sizes.data(), sizeof(int64_t) * key.ndim);
  auto layout = default_layout(sizes, dtype);
  int64_t id;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    id = intern_layout(layout);
  }
  auto nbytes = at::detail::computeStorageNbytesContiguous(sizes, c10::elementSize(dtype));
  std::lock_guard<std::mutex> lock(g_warm_mutex);
  if (g_warm.size() >= 4096 && g_warm.find(key) == g_warm.end()) return;  // enough
  auto& e = g_warm[key];
  e.time_s = time_s;
  e.upcast = upcast;
  e.layout = std::move(layout);
  e.layout_id = id;
  e.strides = host_strides(sizes);
  e.nbytes = static_cast<int64_t>(nbytes);
  e.stat = std::move(stat);
}

// The counts of launches served since the last call, by dispatch-stats name.
static std::vector<std::pair<std::string, int64_t>> warm_counts() {
  std::lock_guard<std::mutex> lock(g_warm_mutex);
  std::vector<std::pair<std::string, int64_t>> out;
  for (auto& kv : g_warm_orphans) out.emplace_back(kv.first, kv.second);
  g_warm_orphans.clear();
  for (auto& kv : g_warm) {
    if (kv.second.pending) out.emplace_back(kv.second.stat, kv.second.pending);
    kv.second.pending = 0;
  }
  return out;
}

// The kernel-cache hits of launches served since the last call
// (runtime/launch.py counts one per warm launch).
static int64_t warm_take_hits() {
  std::lock_guard<std::mutex> lock(g_warm_mutex);
  int64_t n = g_warm_hits;
  g_warm_hits = 0;
  return n;
}

// Forget every entry (their counts stay, for warm_counts).
static void warm_clear() {
  std::lock_guard<std::mutex> lock(g_warm_mutex);
  for (auto& kv : g_warm) {
    if (kv.second.pending) g_warm_orphans[kv.second.stat] += kv.second.pending;
  }
  g_warm.clear();
}

static py::dict warm_info() {
  std::lock_guard<std::mutex> lock(g_warm_mutex);
  py::dict d;
  d["entries"] = static_cast<int64_t>(g_warm.size());
  d["served"] = g_warm_served;
  d["allowed"] = g_warm_allowed.load();
  d["record_function_callbacks"] = at::hasCallbacks();
  return d;
}


void def_warm(py::module_& m) {
  m.def("_warm_put", &warm_put);
  m.def("_warm_counts", &warm_counts);
  m.def("_warm_take_hits", &warm_take_hits);
  m.def("_warm_clear", &warm_clear);
  m.def("_warm_info", &warm_info);
  m.def("_warm_allow", [](bool on) { g_warm_allowed.store(on); });
}

}  // namespace spyre

// Registered when torch_spyre._C is loaded, like spyre.cpp's kernels.
TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("add.Tensor", spyre::warm_add);
  m.impl("sub.Tensor", spyre::warm_sub);
  m.impl("mul.Tensor", spyre::warm_mul);
  m.impl("div.Tensor", spyre::warm_div);
}
