// The simulated card's C interface: the one owner of card state.
//
// Like OpenReg's openreg.h (orMalloc, orFree, ...), the device is a small C
// API under PyTorch's integration: device memory (blocks per card against a
// capacity), and the card's modelled clock with what ran on it (kernels,
// transfers, collectives).  The card module (torch_spyre._card, card.cpp)
// implements it and hands it out as a capsule; the PyTorch integration
// (torch_spyre._C: allocator, events, the warm launch path) calls it through
// that capsule, and the Python card model (torch_spyre/sim/card.py) through
// the module's bindings.  Nothing else holds a copy of this state.
#pragma once

#include <cstdint>

namespace spyre_card {

constexpr int kMaxCards = 8;
constexpr int64_t kStickBytes = 128;
constexpr int kApiVersion = 1;
constexpr const char* kCapsuleName = "torch_spyre._card.api";

inline int64_t round_to_stick(int64_t n) { return (n + kStickBytes - 1) / kStickBytes * kStickBytes; }

struct MemStats {
  int64_t allocated = 0;   // bytes held by live blocks (whole sticks)
  int64_t peak = 0;
  int64_t num_allocs = 0;
  int64_t num_frees = 0;
  int64_t num_ooms = 0;
  int64_t capacity = 0;    // usable device memory
  int64_t bytes_in = 0;    // cumulative bytes allocated / freed
  int64_t bytes_out = 0;
  int64_t live_blocks = 0;
};

enum MallocResult { kMallocOk = 0, kMallocOverCapacity = 1, kMallocHostOom = 2 };

struct Api {
  int version;
  // the cards of this process
  int (*num_cards)();
  // ---- device memory: blocks of whole sticks, zero-filled
  // *out = a new block of round_to_stick(nbytes) on `card` (nullptr for 0 bytes)
  MallocResult (*malloc)(int card, int64_t nbytes, void** out);
  // frees the block starting at ptr; returns its bytes (0: no such block)
  int64_t (*free)(void* ptr);
  // card of the block starting at ptr, or -1
  int (*block_card)(const void* ptr);
  // bytes of the block starting at ptr, or 0
  int64_t (*block_bytes)(const void* ptr);
  void (*mem_stats)(int card, MemStats* out);
  void (*reset_peak)(int card);
  void (*reset_accumulated)(int card);
  // ---- modelled time
  // one kernel of `seconds` on `card`: the clock moves on; returns its start
  double (*account_kernel)(int card, double seconds);
  double (*clock)(int card);  // seconds
};

}  // namespace spyre_card
