// When a kernel's loop is worth the team of threads: below kMinParallelElements elements of work
// (W's n x k, or rows x width), waking the threads costs more than it saves. One threshold for the
// kernels that share it (logits_rows.cpp keeps its own, larger one).
#pragma once

#include <cstdint>

constexpr int64_t kMinParallelElements = 1 << 16;
