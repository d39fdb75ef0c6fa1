// The simulated card's state (card_api.h): device memory and the modelled
// clock, one owner for both.
//
//  * Memory: a block map over the process's host memory (device memory is
//    host memory of the simulating process), a capacity and counters per
//    card.  Large blocks are anonymous mappings (zero, lazily backed like
//    calloc's; transparent huge pages make the first touch ~4x cheaper).
//  * Time: a Clock per card (the clock in seconds, kernels, transfers and
//    collectives with their bytes and times).  The process's cards are
//    g_clocks[0..7]; the Python card model may also make private clocks
//    (design studies that must not move the process's cards).  Sums are
//    doubles added in launch order, whoever adds them (the Python card
//    model or the C++ warm launch path), so modelled figures do not depend
//    on the path a launch took.
#include "card.h"

#include <atomic>
#include <thread>

#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>

namespace spyre_card {

// ------------------------------------------------------------------ memory
namespace {

struct Block {
  int64_t nbytes;
  int card;
  int64_t id;  // unique over the process's life: a reused address is a new block
};

std::mutex g_mem_mutex;
int g_num_cards = 1;
MemStats g_mem[kMaxCards];
// ordered, so the block holding any address inside it is found (block_of)
std::map<const void*, Block> g_blocks;
int64_t g_next_block_id = 0;

constexpr size_t kHugeBytes = size_t(2) << 20;

void* host_alloc_zeroed(size_t nbytes) {
  if (nbytes < kHugeBytes) return std::calloc(1, nbytes);
  void* p = mmap(nullptr, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return nullptr;
  madvise(p, nbytes, MADV_HUGEPAGE);  // advisory: ignored where THP is off
  return p;
}

void host_free(void* p, size_t nbytes) {
  if (p == nullptr) return;
  if (nbytes < kHugeBytes) std::free(p);
  else munmap(p, nbytes);
}

}  // namespace

int num_cards() { return g_num_cards; }

MallocResult card_malloc(int card, int64_t nbytes, void** out) {
  *out = nullptr;
  int64_t rounded = round_to_stick(nbytes);
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  auto& s = g_mem[card];
  if (s.allocated + rounded > s.capacity) {
    s.num_ooms += 1;
    return kMallocOverCapacity;
  }
  if (rounded > 0) {
    void* ptr = host_alloc_zeroed(static_cast<size_t>(rounded));
    if (ptr == nullptr) return kMallocHostOom;
    g_blocks[ptr] = Block{rounded, card, g_next_block_id++};
    s.allocated += rounded;
    s.bytes_in += rounded;
    s.peak = std::max(s.peak, s.allocated);
    s.live_blocks += 1;
    *out = ptr;
  }
  s.num_allocs += 1;
  return kMallocOk;
}

int64_t card_free(void* ptr) {
  if (ptr == nullptr) return 0;
  int64_t nbytes = 0;
  {
    std::lock_guard<std::mutex> lock(g_mem_mutex);
    auto it = g_blocks.find(ptr);
    if (it == g_blocks.end()) return 0;
    nbytes = it->second.nbytes;
    auto& s = g_mem[it->second.card];
    s.allocated -= nbytes;
    s.bytes_out += nbytes;
    s.num_frees += 1;
    s.live_blocks -= 1;
    g_blocks.erase(it);
  }
  host_free(ptr, static_cast<size_t>(nbytes));
  return nbytes;
}

int block_card(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  auto it = g_blocks.find(ptr);
  return it == g_blocks.end() ? -1 : it->second.card;
}

int64_t block_bytes(const void* ptr) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  auto it = g_blocks.find(ptr);
  return it == g_blocks.end() ? 0 : it->second.nbytes;
}

std::pair<int64_t, int64_t> block_of(int64_t addr) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  auto p = reinterpret_cast<const void*>(addr);
  auto it = g_blocks.upper_bound(p);
  if (it == g_blocks.begin()) return {-1, 0};
  --it;
  auto base = static_cast<const char*>(it->first);
  if (static_cast<const char*>(p) >= base + it->second.nbytes) return {-1, 0};
  return {it->second.id, reinterpret_cast<int64_t>(base)};
}

bool zero_range(int64_t addr, int64_t nbytes) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  auto p = reinterpret_cast<char*>(addr);
  auto it = g_blocks.upper_bound(p);
  if (it == g_blocks.begin() || nbytes < 0) return false;
  --it;
  auto base = static_cast<char*>(const_cast<void*>(it->first));
  if (p < base || p + nbytes > base + it->second.nbytes) return false;
  if (p == base && nbytes == it->second.nbytes && static_cast<size_t>(nbytes) >= kHugeBytes) {
    // a whole mapped block: its pages are dropped and read back as zero
    // (never touched pages are not touched now: no first-touch cost)
    if (madvise(base, static_cast<size_t>(nbytes), MADV_DONTNEED) == 0) return true;
  }
  std::memset(p, 0, static_cast<size_t>(nbytes));
  return true;
}

void mem_stats(int card, MemStats* out) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  *out = g_mem[card];
}

void reset_peak(int card) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  g_mem[card].peak = g_mem[card].allocated;
}

void reset_accumulated(int card) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  auto& s = g_mem[card];
  s.num_allocs = s.num_allocs - s.num_frees;
  s.num_frees = 0;
  s.num_ooms = 0;
  s.bytes_in = s.allocated;
  s.bytes_out = 0;
}

std::string set_cards(int n, const std::vector<int64_t>& capacities) {
  std::lock_guard<std::mutex> lock(g_mem_mutex);
  if (n < 1 || n > kMaxCards) {
    return "TORCH_SPYRE_NUM_CARDS must be 1.." + std::to_string(kMaxCards) + ", got " +
           std::to_string(n);
  }
  if (static_cast<int>(capacities.size()) != n) return "one capacity per card";
  for (int i = 0; i < n; ++i) {
    if (capacities[i] < g_mem[i].allocated) {
      return "spyre:" + std::to_string(i) + " capacity " + fmt_bytes(capacities[i]) +
             " is below what is in use (" + fmt_bytes(g_mem[i].allocated) + ")";
    }
  }
  for (int i = 0; i < n; ++i) g_mem[i].capacity = capacities[i];
  g_num_cards = n;
  return "";
}

static std::mutex g_fault_mutex;
static std::string g_stream_error[kMaxCards];

void set_stream_error(int card, const std::string& what) {
  std::lock_guard<std::mutex> lock(g_fault_mutex);
  if (g_stream_error[card].empty()) g_stream_error[card] = what.empty() ? "stream error" : what;
}

std::string stream_error(int card) {
  std::lock_guard<std::mutex> lock(g_fault_mutex);
  return g_stream_error[card];
}

void clear_stream_error(int card) {
  std::lock_guard<std::mutex> lock(g_fault_mutex);
  g_stream_error[card].clear();
}

std::string fmt_bytes(int64_t b) {
  char buf[64];
  double v = static_cast<double>(b);
  if (v >= 1024.0 * 1024 * 1024) snprintf(buf, sizeof buf, "%.2f GiB", v / (1024.0 * 1024 * 1024));
  else if (v >= 1024.0 * 1024) snprintf(buf, sizeof buf, "%.2f MiB", v / (1024.0 * 1024));
  else if (v >= 1024.0) snprintf(buf, sizeof buf, "%.2f KiB", v / 1024.0);
  else snprintf(buf, sizeof buf, "%lld bytes", static_cast<long long>(b));
  return buf;
}

// -------------------------------------------------------------------- time
namespace {
std::atomic<std::thread::id> g_unbilled_owner{};  // no thread: billing on
}  // namespace

void set_unbilled(bool on) {
  g_unbilled_owner.store(on ? std::this_thread::get_id() : std::thread::id());
}

bool unbilled() { return g_unbilled_owner.load() == std::this_thread::get_id(); }

double Clock::account_kernel(double seconds) {
  std::lock_guard<std::mutex> lock(mu);
  if (unbilled()) return clock_s;
  double start = clock_s;
  clock_s += seconds;
  kernels += 1;
  kernel_time_s += seconds;
  return start;
}

double Clock::account_transfer(int kind, int64_t nbytes, double seconds) {
  std::lock_guard<std::mutex> lock(mu);
  if (unbilled()) return clock_s;
  double start = clock_s;
  clock_s += seconds;
  transfers[kind] += 1;
  transfer_bytes[kind] += nbytes;
  transfer_time_s[kind] += seconds;
  return start;
}

std::pair<double, double> Clock::account_collective(int64_t nbytes, double seconds,
                                                    std::optional<double> start_s) {
  std::lock_guard<std::mutex> lock(mu);
  double now = clock_s;
  double start = std::max(now, start_s.value_or(now));
  double wait = start - now;
  clock_s = start + seconds;
  collectives += 1;
  collective_bytes += nbytes;
  collective_time_s += seconds;
  collective_wait_s += wait;
  return {start, wait};
}

double Clock::now() {
  std::lock_guard<std::mutex> lock(mu);
  return clock_s;
}

void Clock::reset() {
  std::lock_guard<std::mutex> lock(mu);
  clock_s = kernel_time_s = 0.0;
  kernels = 0;
  for (int k = 0; k < kTransferKinds; ++k) {
    transfers[k] = transfer_bytes[k] = 0;
    transfer_time_s[k] = 0.0;
  }
  collectives = collective_bytes = 0;
  collective_time_s = collective_wait_s = 0.0;
}

Clock g_clocks[kMaxCards];

namespace {
double api_account_kernel(int card, double seconds) { return g_clocks[card].account_kernel(seconds); }
double api_clock(int card) { return g_clocks[card].now(); }
}  // namespace

const Api g_api = {
    kApiVersion,  &num_cards,  &card_malloc,       &card_free,
    &block_card,  &block_bytes, &mem_stats,        &reset_peak,
    &reset_accumulated, &api_account_kernel, &api_clock,
};

}  // namespace spyre_card
