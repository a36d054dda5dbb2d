// Work items claimed one at a time from a shared counter, for the cpu backend's kernels.
//
// at::parallel_for splits a range into equal slices up front, one per thread, and returns when the slowest
// slice is done. On a machine with as many cores as intra-op threads, a thread that loses its core for a moment
// (to the gateway, the kvmanager or a client: on two cores there is nowhere else for them to run) holds the whole
// call at that barrier, and items of unequal cost (sequences of different lengths) leave one thread idle. Here
// each thread takes the next unclaimed item until none is left, so the other thread takes up the slack.
// (kvserve/kernels/cpu_paged.py keys its build cache on this file's text too.)
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace kvserve {

// fn(i) for every i in [0, num_items), on the intra-op threads, each item claimed by exactly one thread.
template <typename F>
void parallel_items(int64_t num_items, const F& fn) {
  if (num_items <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1, std::memory_order_relaxed); i < num_items;
         i = next.fetch_add(1, std::memory_order_relaxed)) {
      fn(i);
    }
  });
}

}  // namespace kvserve
