// torch_spyre._card: the simulated card as a Python module.  Registers
// nothing with PyTorch (no aten kernels, no hooks): importing it gives the
// card's state (card.cpp), its C interface as a capsule for torch_spyre._C
// (card_api.h), and the loops the simulator computes with.
#include "card.h"

namespace py = pybind11;

namespace {

using spyre_card::Clock;

void check_card(int i) {
  TORCH_CHECK(i >= 0 && i < spyre_card::kMaxCards, "card index must be 0..",
              spyre_card::kMaxCards - 1, ", got ", i);
}

py::dict clock_stats(Clock& c) {
  std::lock_guard<std::mutex> lock(c.mu);
  static const char* kinds[] = {"h2d", "d2h", "d2d"};
  py::dict transfers, bytes, times;
  for (int k = 0; k < spyre_card::kTransferKinds; ++k) {
    transfers[kinds[k]] = c.transfers[k];
    bytes[kinds[k]] = c.transfer_bytes[k];
    times[kinds[k]] = c.transfer_time_s[k];
  }
  py::dict d;
  d["clock_s"] = c.clock_s;
  d["kernels"] = c.kernels;
  d["kernel_time_s"] = c.kernel_time_s;
  d["transfers"] = transfers;
  d["transfer_bytes"] = bytes;
  d["transfer_time_s"] = times;
  d["collectives"] = c.collectives;
  d["collective_bytes"] = c.collective_bytes;
  d["collective_time_s"] = c.collective_time_s;
  d["collective_wait_s"] = c.collective_wait_s;
  return d;
}

py::dict mem_stats(int card) {
  check_card(card);
  spyre_card::MemStats s;
  spyre_card::mem_stats(card, &s);
  py::dict d;
  d["allocated_bytes"] = s.allocated;
  d["peak_allocated_bytes"] = s.peak;
  d["num_allocs"] = s.num_allocs;
  d["num_frees"] = s.num_frees;
  d["num_ooms"] = s.num_ooms;
  d["capacity_bytes"] = s.capacity;
  d["live_blocks"] = s.live_blocks;
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Clock(): a private clock (a card model that is not one of the process's cards)
  py::class_<Clock>(m, "Clock")
      .def(py::init<>())
      .def("account_kernel", &Clock::account_kernel, py::arg("seconds"))
      .def("account_transfer", &Clock::account_transfer, py::arg("kind"), py::arg("nbytes"),
           py::arg("seconds"))
      .def("account_collective", &Clock::account_collective, py::arg("nbytes"),
           py::arg("seconds"), py::arg("start_s") = py::none())
      .def_property_readonly("clock_s", &Clock::now)
      .def("stats", &clock_stats)
      .def("reset", &Clock::reset);
  m.def("set_unbilled", &spyre_card::set_unbilled, py::arg("on"));
  m.def("unbilled", &spyre_card::unbilled);
  m.def(
      "clock",
      [](int i) {
        check_card(i);
        return &spyre_card::g_clocks[i];
      },
      py::return_value_policy::reference);
  m.def("set_cards", [](int n, std::vector<int64_t> capacities) {
    auto err = spyre_card::set_cards(n, capacities);
    TORCH_CHECK(err.empty(), err);
  });
  m.def("num_cards", &spyre_card::num_cards);
  m.def("mem_stats", &mem_stats);
  m.def("reset_peak", [](int card) {
    check_card(card);
    spyre_card::reset_peak(card);
  });
  m.def("block_of", &spyre_card::block_of);
  m.def("zero_range", &spyre_card::zero_range, py::arg("addr"), py::arg("nbytes"));
  // the card's stream error (IBM's SpyreDeviceState::StreamError): "" when healthy
  m.def("set_stream_error", [](int card, const std::string& what) {
    check_card(card);
    spyre_card::set_stream_error(card, what);
  });
  m.def("stream_error", [](int card) {
    check_card(card);
    return spyre_card::stream_error(card);
  });
  m.def("clear_stream_error", [](int card) {
    check_card(card);
    spyre_card::clear_stream_error(card);
  });
  m.def("stick_gemm", &spyre_card::stick_gemm, py::arg("a"), py::arg("w"), py::arg("k"),
        py::arg("chunk"), py::arg("parts"), py::arg("simd") = true);
  m.def("dl16_encode", &spyre_card::dl16_encode);
  m.def("dl16_decode", &spyre_card::dl16_decode);
  m.def("stick_copy",
        [](const at::Tensor& src, at::Tensor dst) { return spyre_card::stick_copy(src, dst); });
  m.attr("api") = py::capsule(static_cast<const void*>(&spyre_card::g_api),
                              spyre_card::kCapsuleName);
  m.attr("MAX_CARDS") = spyre_card::kMaxCards;
}
