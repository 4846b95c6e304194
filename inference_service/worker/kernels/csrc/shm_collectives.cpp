// Collectives between the shards of one host through a shared memory region (what vLLM does on
// CPU): gloo's all-reduce over loopback costs ~1.7 ms, two per layer; this one costs microseconds.
//
// The region: a header, one cache line per rank (its sequence number and its pid), then two sets
// (by the sequence number's parity) of one slot per rank. Every collective is one or more rounds;
// in a round each rank writes its slot, publishes the round's number, waits until every rank has
// published it, and reads what it needs. A rank writes a slot again two rounds later, after every
// rank has published the round in between, which it does only once it has read: no lock needed.
//
// Sums are in fp32, in rank order (slot 0 + slot 1 + ...), computed the same way by every rank:
// the result is deterministic and equal on all of them. Waiting spins a little, then sleeps on a
// futex; asleep, it looks every few milliseconds whether a peer's process is gone (dead or a
// zombie) or the group was aborted, and returns an error instead of waiting forever.
//
// Plain C ABI (called through ctypes, which releases the GIL around the call).

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr uint64_t kMagic = 0x73686d636f6c6c31ULL;  // "shmcoll1"
// Busy polls (a few µs) before sleeping on the futex. Short: on a machine with more runnable threads
// than cores a spinning waiter burns the share its peer needs (measured there: 2,000 polls made decode
// 3x slower than gloo's blocking sockets), while a futex sleeper is woken the moment its peer
// publishes (microseconds). No sched_yield either: it can give the core away for a whole round.
constexpr int kSpins = 128;
constexpr long kSleepNs = 5 * 1000 * 1000;             // a sleep's limit: how often peers are checked

struct alignas(64) Header {
  uint64_t magic;
  uint64_t nonce;  // the creator's random number: an attacher checks it found the right region
  int64_t world;
  int64_t slot_bytes;
  std::atomic<uint32_t> aborted;
};

struct alignas(64) RankState {
  std::atomic<uint32_t> seq;       // the last round this rank published (the futex word)
  std::atomic<uint32_t> sleepers;  // peers asleep on `seq`
  int64_t pid;
};

Header* header(void* base) { return static_cast<Header*>(base); }

RankState* states(void* base) {
  return reinterpret_cast<RankState*>(static_cast<char*>(base) + sizeof(Header));
}

char* slot(void* base, uint32_t seq, int64_t rank) {
  Header* h = header(base);
  char* data = reinterpret_cast<char*>(states(base) + h->world);
  return data + ((int64_t)(seq & 1) * h->world + rank) * h->slot_bytes;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

inline bool reached(uint32_t have, uint32_t want) { return (int32_t)(have - want) >= 0; }

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// Whether process `pid` is gone: no such process, or a zombie (killed, not yet reaped).
bool process_gone(int64_t pid) {
  if (pid <= 0) return false;
  if (kill((pid_t)pid, 0) != 0 && errno == ESRCH) return true;
  char path[64];
  snprintf(path, sizeof(path), "/proc/%lld/stat", (long long)pid);
  FILE* file = fopen(path, "r");
  if (file == nullptr) return false;  // no /proc: kill's answer stands
  char text[512];
  size_t n = fread(text, 1, sizeof(text) - 1, file);
  fclose(file);
  text[n] = 0;
  const char* close = strrchr(text, ')');  // "pid (name) S ...": the state follows the name
  return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

void publish(void* base, int64_t rank, uint32_t seq) {
  RankState& own = states(base)[rank];
  own.seq.store(seq, std::memory_order_seq_cst);
  if (own.sleepers.load(std::memory_order_seq_cst) > 0) futex(&own.seq, FUTEX_WAKE, INT32_MAX, nullptr);
}

// 0 once every rank published round `seq`; 1 if the group was aborted; 2 + r if rank r is gone.
int wait_all(void* base, int64_t rank, uint32_t seq) {
  Header* h = header(base);
  if (h->aborted.load(std::memory_order_acquire)) return 1;  // not just the pending rounds: every later one
  for (int64_t r = 0; r < h->world; ++r) {
    if (r == rank) continue;
    RankState& peer = states(base)[r];
    int polls = 0;
    for (;;) {
      uint32_t seen = peer.seq.load(std::memory_order_acquire);
      if (reached(seen, seq)) break;
      if (h->aborted.load(std::memory_order_relaxed)) return 1;
      ++polls;
      if (polls < kSpins) {
        cpu_relax();
        continue;
      }
      peer.sleepers.fetch_add(1, std::memory_order_seq_cst);
      timespec limit = {0, kSleepNs};
      futex(&peer.seq, FUTEX_WAIT, seen, &limit);
      peer.sleepers.fetch_sub(1, std::memory_order_seq_cst);
      if (!reached(peer.seq.load(std::memory_order_acquire), seq) && process_gone(peer.pid)) return 2 + (int)r;
    }
  }
  return 0;
}

// One round: publish the next number, wait for everyone; the slot to write is chosen before.
uint32_t next_round(void* base, int64_t rank) { return states(base)[rank].seq.load(std::memory_order_relaxed) + 1; }

inline float bf16_to_f32(uint16_t bits) {
  uint32_t wide = (uint32_t)bits << 16;
  float value;
  memcpy(&value, &wide, 4);
  return value;
}

inline uint16_t f32_to_bf16(float value) {  // round to nearest even; NaN stays NaN
  uint32_t bits;
  memcpy(&bits, &value, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1)) >> 16);
}

// out[i] = Σ_r slot_r[i] in fp32, r = 0, 1, ... (the same order on every rank).
template <typename T, typename Load, typename Store>
void sum_slots(void* base, uint32_t seq, int64_t world, T* out, int64_t n, Load load, Store store) {
  for (int64_t i = 0; i < n; ++i) {
    float acc = load(reinterpret_cast<const T*>(slot(base, seq, 0))[i]);
    for (int64_t r = 1; r < world; ++r) acc += load(reinterpret_cast<const T*>(slot(base, seq, r))[i]);
    out[i] = store(acc);
  }
}

}  // namespace

extern "C" {

int64_t shm_region_bytes(int64_t world, int64_t slot_bytes) {
  return (int64_t)sizeof(Header) + world * (int64_t)sizeof(RankState) + 2 * world * slot_bytes;
}

// The creator (rank 0) lays out a zeroed region.
int shm_init(void* base, int64_t world, int64_t slot_bytes, uint64_t nonce) {
  if (world < 1 || slot_bytes < 64 || slot_bytes % 64) return 1;
  Header* h = header(base);
  h->nonce = nonce;
  h->world = world;
  h->slot_bytes = slot_bytes;
  h->aborted.store(0);
  for (int64_t r = 0; r < world; ++r) {
    states(base)[r].seq.store(0);
    states(base)[r].sleepers.store(0);
    states(base)[r].pid = 0;
  }
  std::atomic_thread_fence(std::memory_order_seq_cst);
  h->magic = kMagic;
  return 0;
}

// Every rank: check the region is the creator's, and say which process this rank is.
int shm_attach(void* base, int64_t rank, int64_t world, uint64_t nonce, int64_t pid) {
  Header* h = header(base);
  if (h->magic != kMagic || h->nonce != nonce || h->world != world || rank < 0 || rank >= world) return 1;
  states(base)[rank].pid = pid;
  return 0;
}

// Wake every waiter and make every collective return 1: a shard is known to be gone.
void shm_abort(void* base) {
  Header* h = header(base);
  h->aborted.store(1, std::memory_order_seq_cst);
  for (int64_t r = 0; r < h->world; ++r) futex(&states(base)[r].seq, FUTEX_WAKE, INT32_MAX, nullptr);
}

// Sum `data` (numel elements: dtype 0 fp32, 1 bf16) over the ranks, in place.
int shm_all_reduce(void* base, int64_t rank, void* data, int64_t numel, int64_t dtype) {
  Header* h = header(base);
  const int64_t size = dtype == 0 ? 4 : 2;
  if (dtype != 0 && dtype != 1) return -1;
  const int64_t per_round = h->slot_bytes / size;
  for (int64_t start = 0; start < numel; start += per_round) {
    const int64_t n = numel - start < per_round ? numel - start : per_round;
    const uint32_t seq = next_round(base, rank);
    char* part = static_cast<char*>(data) + start * size;
    memcpy(slot(base, seq, rank), part, n * size);
    publish(base, rank, seq);
    if (int status = wait_all(base, rank, seq)) return status;
    if (dtype == 0) {
      sum_slots<float>(
          base, seq, h->world, reinterpret_cast<float*>(part), n, [](float v) { return v; },
          [](float v) { return v; });
    } else {
      sum_slots<uint16_t>(base, seq, h->world, reinterpret_cast<uint16_t*>(part), n, bf16_to_f32, f32_to_bf16);
    }
  }
  return 0;
}

// Every rank's `nbytes` from `src` into root's `dst` (world × nbytes, in rank order).
int shm_gather(void* base, int64_t rank, int64_t root, const void* src, int64_t nbytes, void* dst) {
  Header* h = header(base);
  for (int64_t start = 0; start < nbytes || (start == 0 && nbytes == 0); start += h->slot_bytes) {
    const int64_t n = nbytes - start < h->slot_bytes ? nbytes - start : h->slot_bytes;
    const uint32_t seq = next_round(base, rank);
    memcpy(slot(base, seq, rank), static_cast<const char*>(src) + start, n);
    publish(base, rank, seq);
    if (int status = wait_all(base, rank, seq)) return status;
    if (rank == root) {
      for (int64_t r = 0; r < h->world; ++r) memcpy(static_cast<char*>(dst) + r * nbytes + start, slot(base, seq, r), n);
    }
    if (nbytes == 0) break;
  }
  return 0;
}

// Root's `nbytes` of `buffer` into every rank's `buffer`.
int shm_broadcast(void* base, int64_t rank, int64_t root, void* buffer, int64_t nbytes) {
  Header* h = header(base);
  for (int64_t start = 0; start < nbytes || (start == 0 && nbytes == 0); start += h->slot_bytes) {
    const int64_t n = nbytes - start < h->slot_bytes ? nbytes - start : h->slot_bytes;
    const uint32_t seq = next_round(base, rank);
    if (rank == root) memcpy(slot(base, seq, rank), static_cast<char*>(buffer) + start, n);
    publish(base, rank, seq);
    if (int status = wait_all(base, rank, seq)) return status;
    if (rank != root) memcpy(static_cast<char*>(buffer) + start, slot(base, seq, root), n);
    if (nbytes == 0) break;
  }
  return 0;
}

}  // extern "C"
