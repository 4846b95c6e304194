// How a tile over fp32 weights stored in panels ([K][ldp] floats, contiguous, panels one after
// another) prefetches them: kPanelAheadK k ahead (6 KiB of a 32-wide panel; past a panel's end that
// is the next panel, past the whole array's end harmless). The hardware prefetcher stops at each
// 4 KiB page, so without this the FMAs and the reads took turns: measured over the demo model's 30
// layers of projections on a 2-core Xeon, 2 threads, 16 rows 32.9 -> 20.7 ms, 8 rows 26.5 -> 17.4,
// one row 15.0 -> 13.7 (8, 16, 32, 64 or 96 k ahead: less). panel_linear.cpp's tiles and
// lora_sgmv.cpp's one-row base tile both use it, so they stay equally fast.
//
// A second prefetch, into L2 only, kPanelFarAheadK k ahead (16 KiB) keeps more reads in flight than
// L1's fill buffers allow: over the ~1.5B shape's 28 layers (1536 wide, 8960 inner), 2 threads,
// 16 rows 0.89x the time, 8 rows 0.86x, one row unchanged; the demo model's 16 rows 0.91x
// (96 or 192 k ahead: the same within noise; a nearer L1 distance with it: slower).
#pragma once

#include <cstdint>

constexpr int64_t kPanelAheadK = 48, kPanelFarAheadK = 128;

// The two 64-byte lines of k-row `c + kPanelAheadK` of the panel into L1, and of k-row
// `c + kPanelFarAheadK` into L2.
inline void prefetch_panel_ahead(const float* panel, int64_t c, int64_t ldp) {
    const char* line = reinterpret_cast<const char*>(panel + (c + kPanelAheadK) * ldp);
    __builtin_prefetch(line);
    __builtin_prefetch(line + 64);
    const char* far = reinterpret_cast<const char*>(panel + (c + kPanelFarAheadK) * ldp);
    __builtin_prefetch(far, 0, 2);
    __builtin_prefetch(far + 64, 0, 2);
}
