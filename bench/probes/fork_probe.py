"""What a decode step's OpenMP hand-offs cost: a fork and join of torch's pool against barriers in one region.

`python bench/probes/fork_probe.py [--threads 2] [--regions 20000]` builds a small C++ extension
(once, under ~/.cache/corechat/fork-probe) and times, on the given threads, a run of `at::parallel_for`
regions (each thread's share of a region, then a serial part on the calling thread, as a layer's
products and the work around them alternate) against the same work in one `#pragma omp parallel`
region with two barriers per round (what a persistent team with the whole step in one operator
would pay instead). Each figure is the best of 5 runs, per region, for three sizes of work per
thread. A one-row decode step has about 121 regions (5 a layer: q/k/v, attention, o, gate/up,
down; and the output product). It prints a table and writes bench/results/<machine>/fork.json and .md.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils.cpp_extension import load_inline  # noqa: E402

from bench import CACHE_DIR, save_results  # noqa: E402

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>
#include <atomic>
#include <chrono>

namespace {

// A serial chain of `work` multiply-adds, compiled once for both ways.
__attribute__((noinline)) int64_t spin(int64_t work, int64_t seed) {
    int64_t sum = seed;
    for (int64_t k = 0; k < work; ++k) {
        sum = sum * 31 + k;
        asm volatile("" : "+r"(sum));  // neither hoisted out of the rounds nor folded away
    }
    return sum;
}

}  // namespace

// Microseconds per round: a parallel_for whose threads each spin `work`, then `work / 4` on the caller.
double forks(int64_t rounds, int64_t work) {
    std::atomic<int64_t> sink{0};
    const auto began = std::chrono::steady_clock::now();
    for (int64_t round = 0; round < rounds; ++round) {
        at::parallel_for(0, at::get_num_threads(), 1,
                         [&](int64_t begin, int64_t) { sink += spin(work, begin + round); });
        sink += spin(work / 4, round);
    }
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - began).count() / rounds;
}

// The same rounds in one parallel region: every thread spins `work`, a barrier, the first thread spins
// `work / 4`, a barrier.
double barriers(int64_t rounds, int64_t work) {
    std::atomic<int64_t> sink{0};
    const auto began = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(at::get_num_threads())
    {
        const int thread = omp_get_thread_num();
        for (int64_t round = 0; round < rounds; ++round) {
            sink += spin(work, thread + round);
#pragma omp barrier
            if (thread == 0) sink += spin(work / 4, round);
#pragma omp barrier
        }
    }
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - began).count() / rounds;
}
"""
WORK = [0, 1000, 20000, 100000]
REGIONS_PER_STEP = 121


def main() -> None:
    """Build the probe, time both ways at each size of work, print and save the table."""
    parser = argparse.ArgumentParser(prog="python bench/probes/fork_probe.py", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--regions", type=int, default=20000)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    build = CACHE_DIR / "fork-probe"
    build.mkdir(parents=True, exist_ok=True)
    probe = load_inline("corechat_fork_probe", cpp_sources=SOURCE, functions=["forks", "barriers"],
                        extra_cflags=["-O2", "-fopenmp"], extra_ldflags=["-fopenmp"], build_directory=str(build))
    runs = []
    for work in WORK:
        fork = min(probe.forks(args.regions, work) for _ in range(5))
        barrier = min(probe.barriers(args.regions, work) for _ in range(5))
        runs.append({"work": work, "fork_join_us": fork, "barriers_us": barrier})
    lines = [f"OpenMP hand-offs on {args.threads} thread(s), microseconds per round (best of 5 runs of "
             f"{args.regions} rounds); a step's {REGIONS_PER_STEP} regions at that cost.", "",
             "| spin per thread | fork and join (parallel_for) | two barriers in one region | saved per step |",
             "|---|---|---|---|"]
    for run in runs:
        saved = (run["fork_join_us"] - run["barriers_us"]) * REGIONS_PER_STEP / 1e3
        lines.append(f"| {run['work']} | {run['fork_join_us']:.2f} us | {run['barriers_us']:.2f} us | {saved:.3f} ms |")
    save_results("fork", {"threads": args.threads, "regions": args.regions, "runs": runs}, "\n".join([*lines, ""]))


if __name__ == "__main__":
    main()
