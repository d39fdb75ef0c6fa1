// The card module's own declarations (torch_spyre._card): the state behind
// card_api.h and the loops the simulator computes with.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "card_api.h"

namespace spyre_card {

enum TransferKind { kH2D = 0, kD2H = 1, kD2D = 2, kTransferKinds = 3 };

// A card's modelled clock and what ran on it.
struct Clock {
  std::mutex mu;
  double clock_s = 0.0;
  int64_t kernels = 0;
  double kernel_time_s = 0.0;
  int64_t transfers[kTransferKinds] = {0, 0, 0};
  int64_t transfer_bytes[kTransferKinds] = {0, 0, 0};
  double transfer_time_s[kTransferKinds] = {0.0, 0.0, 0.0};
  int64_t collectives = 0;
  int64_t collective_bytes = 0;
  double collective_time_s = 0.0;
  double collective_wait_s = 0.0;

  double account_kernel(double seconds);
  double account_transfer(int kind, int64_t nbytes, double seconds);
  // (start, wait): the clock waits until start_s (never backwards), then seconds
  std::pair<double, double> account_collective(int64_t nbytes, double seconds,
                                               std::optional<double> start_s);
  double now();
  void reset();
};

extern Clock g_clocks[kMaxCards];

// Compile-time work: while a thread compiles a graph (torch.compile, from
// Dynamo's start to its end callback: sim/card.py compiling()), what it runs
// on a card (constants read back or uploaded, fills, cache saves and loads)
// executes but does not move the card's clock nor its counters: it is not
// the user's call, and a warm cache would skip it.  One thread at a time;
// set_unbilled(false) ends it whatever thread calls.
void set_unbilled(bool on);
bool unbilled();  // the calling thread is in the window
extern const Api g_api;

int num_cards();
// "" on success, else what is wrong
std::string set_cards(int n, const std::vector<int64_t>& capacities);
std::pair<int64_t, int64_t> block_of(int64_t addr);
// Zero device memory [addr, addr + nbytes), which must lie inside one block
// (false otherwise, nothing written).  A whole large block drops its pages
// (they read back as zero, as a fresh block's do) instead of writing them.
bool zero_range(int64_t addr, int64_t nbytes);
void mem_stats(int card, MemStats* out);
void reset_peak(int card);
std::string fmt_bytes(int64_t b);

// A card's stream error: set when a launch fails on the card (what IBM's
// runtime calls a stream error, SpyreDeviceState::StreamError); the card
// refuses work until it is reset (clear_stream_error: a device reset).
// "" when the card is healthy.
void set_stream_error(int card, const std::string& what);
std::string stream_error(int card);
void clear_stream_error(int card);

// the loops the simulator computes with
at::Tensor stick_gemm(const at::Tensor& a, const at::Tensor& w, int64_t k, int64_t chunk,
                      int64_t parts, bool simd);
at::Tensor dl16_encode(const at::Tensor& values);
at::Tensor dl16_decode(const at::Tensor& bits);
bool stick_copy(const at::Tensor& src, at::Tensor& dst);

}  // namespace spyre_card
