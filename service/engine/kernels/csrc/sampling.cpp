// The step's next tokens from its logits, each row in one or two passes over its vocabulary instead
// of the sampler's passes of whole-vocabulary tensors: torch.ops.corechat.greedy_tokens (the first
// largest logit) and .draw_tokens (a draw by temperature, top_k and top_p); .token_weights gives the
// weights draw_tokens draws by; .repetition_penalized and .finite_rows are the sampler's penalty and
// its check of each row's largest logit, one call each. A row's token depends on its own logits and
// parameters alone, never on the other rows, the thread count or the kernel path.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "ops.h"

namespace corechat {

namespace {

// The index of a row's first largest value, as torch.argmax chooses for a row without NaN: each lane
// keeps its first largest (only a strictly larger value replaces it), then the largest of the lanes
// wins, the lowest index among equals, and the tail past the last whole vector goes one by one.
int64_t combine_lanes(const float* best, const int32_t* where, int lanes, const float* row, int64_t from,
                      int64_t width) {
    int64_t chosen = where[0];
    float largest = best[0];
    for (int lane = 1; lane < lanes; ++lane) {
        if (best[lane] > largest || (best[lane] == largest && where[lane] < chosen)) {
            largest = best[lane];
            chosen = where[lane];
        }
    }
    for (int64_t index = from; index < width; ++index) {
        if (row[index] > largest) {
            largest = row[index];
            chosen = index;
        }
    }
    return chosen;
}

int64_t first_largest_plain(const float* row, int64_t width) {
    return std::max_element(row, row + width) - row;
}

#if defined(__x86_64__)
// Two registers of 8 lanes (16 lanes, two independent chains), AVX2: the same choice as the plain loop.
__attribute__((target("avx2"))) int64_t first_largest_avx2(const float* row, int64_t width) {
    constexpr int kLanes = 16;
    if (width < 2 * kLanes) return first_largest_plain(row, width);
    __m256 best[2] = {_mm256_loadu_ps(row), _mm256_loadu_ps(row + 8)};
    __m256i where[2] = {_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15)};
    __m256i at[2] = {_mm256_add_epi32(where[0], _mm256_set1_epi32(kLanes)),
                     _mm256_add_epi32(where[1], _mm256_set1_epi32(kLanes))};
    const __m256i step = _mm256_set1_epi32(kLanes);
    int64_t index = kLanes;
    for (; index + kLanes <= width; index += kLanes) {
        for (int half = 0; half < 2; ++half) {
            const __m256 values = _mm256_loadu_ps(row + index + 8 * half);
            const __m256 larger = _mm256_cmp_ps(values, best[half], _CMP_GT_OQ);
            best[half] = _mm256_blendv_ps(best[half], values, larger);
            where[half] = _mm256_blendv_epi8(where[half], at[half], _mm256_castps_si256(larger));
            at[half] = _mm256_add_epi32(at[half], step);
        }
    }
    alignas(32) float lanes_best[kLanes];
    alignas(32) int32_t lanes_where[kLanes];
    for (int half = 0; half < 2; ++half) {
        _mm256_store_ps(lanes_best + 8 * half, best[half]);
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes_where + 8 * half), where[half]);
    }
    return combine_lanes(lanes_best, lanes_where, kLanes, row, index, width);
}
#endif

// Whether this CPU runs the AVX2 loops below (asked once).
bool cpu_has_avx2() {
#if defined(__x86_64__)
    static const bool avx2 = __builtin_cpu_supports("avx2");
    return avx2;
#else
    return false;
#endif
}

int64_t first_largest(const float* row, int64_t width) {
#if defined(__x86_64__)
    if (cpu_has_avx2()) return first_largest_avx2(row, width);
#endif
    return first_largest_plain(row, width);
}

// A matrix of logits the operators below take: float32, contiguous, rows of 1 to 2^31 - 1 values.
void check_logits(const at::Tensor& logits) {
    check_cpu(logits, "logits");
    TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous() && logits.scalar_type() == at::kFloat,
                "logits must be a contiguous float32 matrix");
    TORCH_CHECK(logits.size(1) > 0 && logits.size(1) <= std::numeric_limits<int32_t>::max(),
                "logits' width must be 1 to 2^31 - 1, not ", logits.size(1));
}

// torch.ops.corechat.greedy_tokens: each row's first largest logit, float32 [rows, width] in, int64
// [rows] out; torch.argmax's choice for rows without NaN (the sampler checks that first).
at::Tensor greedy_tokens(const at::Tensor& logits) {
    check_logits(logits);
    const int64_t rows = logits.size(0), width = logits.size(1);
    at::Tensor chosen = at::empty({rows}, logits.options().dtype(at::kLong));
    const float* values = logits.data_ptr<float>();
    int64_t* out = chosen.data_ptr<int64_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row) out[row] = first_largest(values + row * width, width);
    });
    return chosen;
}

// What draw_tokens returns for a row it leaves to the sampler's whole-row draw in torch: a top_k past
// kMostTopK, a nucleus wider than kMostTopK tokens, or more ties at the k-th logit than it holds.
constexpr int64_t kWholeRow = -2;
// The largest top_k drawn here (the sampler's CANDIDATES), and the candidates held before the
// k-th largest is looked for again: then the floor rises and every candidate below it is dropped.
constexpr int64_t kMostTopK = 256;
constexpr size_t kHeld = 4096;

struct Candidate {
    float value;
    int32_t index;
};

// Keep the candidates at or above the k-th largest value, ties with it included; return that value.
float keep_largest(std::vector<Candidate>& held, int64_t k) {
    const auto kth = held.begin() + (k - 1);
    std::nth_element(held.begin(), kth, held.end(), [](const Candidate& a, const Candidate& b) { return a.value > b.value; });
    const float floor = kth->value;
    held.erase(std::remove_if(held.begin(), held.end(), [floor](const Candidate& c) { return c.value < floor; }),
               held.end());
    return floor;
}

// The candidates at or above `floor` among row[from, to) join `held`; at kHeld the floor rises to the
// k-th largest. Return false where ties at the floor fill half the buffer (the row is left whole).
bool scan_plain(const float* row, int64_t from, int64_t to, int64_t k, float& floor, std::vector<Candidate>& held) {
    for (int64_t index = from; index < to; ++index) {
        if (row[index] >= floor) {
            held.push_back({row[index], static_cast<int32_t>(index)});
            if (held.size() >= kHeld) {
                floor = keep_largest(held, k);
                if (held.size() > kHeld / 2) return false;
            }
        }
    }
    return true;
}

#if defined(__x86_64__)
// The same, 16 values compared with the floor at a time: most of a vocabulary is below it.
__attribute__((target("avx2"))) bool scan_avx2(const float* row, int64_t width, int64_t k, float& floor,
                                               std::vector<Candidate>& held, int64_t& scanned) {
    int64_t index = 0;
    for (; index + 16 <= width; index += 16) {
        const __m256 bound = _mm256_set1_ps(floor);
        const int low = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + index), bound, _CMP_GE_OQ));
        const int high = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + index + 8), bound, _CMP_GE_OQ));
        if ((low | high) == 0) continue;
        for (unsigned mask = static_cast<unsigned>(low | (high << 8)); mask != 0; mask &= mask - 1) {
            const int64_t at = index + __builtin_ctz(mask);
            held.push_back({row[at], static_cast<int32_t>(at)});
        }
        if (held.size() + 16 > kHeld) {
            floor = keep_largest(held, k);
            if (held.size() > kHeld / 2) return false;
        }
    }
    scanned = index;
    return true;
}
#endif

// The row's k largest finite logits and every logit tied with the k-th, into `held`, largest first
// (the lower id first among equals); false where the ties are too many to hold. -inf (a token a
// grammar or bias forbids) is never a candidate: it weighs 0.
bool top_candidates(const float* row, int64_t width, int64_t k, std::vector<Candidate>& held) {
    held.clear();
    float floor = std::numeric_limits<float>::lowest();
    int64_t scanned = 0;
#if defined(__x86_64__)
    static const bool avx2 = __builtin_cpu_supports("avx2");
    if (avx2 && !scan_avx2(row, width, k, floor, held, scanned)) return false;
#endif
    if (!scan_plain(row, scanned, width, k, floor, held)) return false;
    if (static_cast<int64_t>(held.size()) > k) keep_largest(held, k);
    std::sort(held.begin(), held.end(), [](const Candidate& a, const Candidate& b) {
        return a.value > b.value || (a.value == b.value && a.index < b.index);
    });
    return true;
}

// The most likely of the candidates (largest first, with their weights) that hold less than
// `threshold` before them: at least one, and every token as likely as the last kept. Returns how many,
// or 0 where the candidates run out before the threshold or its ties do (the row is left whole).
size_t nucleus(const std::vector<double>& weights, double threshold, bool whole_row_known) {
    size_t kept = 0;
    double before = 0.0;
    while (kept < weights.size() && before < threshold) before += weights[kept++];
    if (before < threshold && !whole_row_known) return 0;
    kept = std::max<size_t>(kept, 1);
    while (kept < weights.size() && weights[kept] == weights[kept - 1]) ++kept;
    if (kept == weights.size() && !whole_row_known) return 0;
    return kept;
}

// The token where uniform * total falls in the running sum of the kept candidates' weights, taken in
// vocabulary order; never one of weight 0 (u * total rounded up to the total takes the last weighed).
int64_t draw_kept(const std::vector<Candidate>& held, const std::vector<double>& weights, size_t kept, double uniform) {
    std::vector<std::pair<int32_t, double>> chosen(kept);
    for (size_t i = 0; i < kept; ++i) chosen[i] = {held[i].index, weights[i]};
    std::sort(chosen.begin(), chosen.end());
    double total = 0.0;
    for (const auto& [index, weight] : chosen) total += weight;
    const double target = uniform * total;
    double running = 0.0;
    int64_t last_weighed = chosen.front().first;
    for (const auto& [index, weight] : chosen) {
        if (weight <= 0.0) continue;
        running += weight;
        last_weighed = index;
        if (running > target) return index;
    }
    return last_weighed;
}

// The token where uniform * total falls in the running sum of the whole row's weights, in vocabulary
// order: the block first, by the blocks' sums, then the token within it. Never one of weight 0.
int64_t draw_whole(const float* weights, int64_t width, const double* block_sums, double total, double uniform) {
    const double target = uniform * total;
    const int64_t blocks = (width + kWeightBlock - 1) / kWeightBlock;
    double running = 0.0;
    int64_t block = 0;
    while (block < blocks - 1 && running + block_sums[block] <= target) running += block_sums[block++];
    int64_t last_weighed = -1;
    for (int64_t index = block * kWeightBlock; index < std::min(width, (block + 1) * kWeightBlock); ++index) {
        if (weights[index] <= 0.0f) continue;
        running += weights[index];
        last_weighed = index;
        if (running > target) return index;
    }
    // Rounding left the target past the block's last weighed token: the last weighed token up to there.
    for (int64_t index = std::min(width, (block + 1) * kWeightBlock) - 1; last_weighed < 0 && index >= 0; --index) {
        if (weights[index] > 0.0f) last_weighed = index;
    }
    return last_weighed;
}

struct RowDraw {
    int64_t top_k;  // 0: off
    double temperature, top_p, uniform;
};

// One row's token (kWholeRow where it is left to torch). `weights` and `block_sums` are scratch.
int64_t draw_row(const float* row, int64_t width, const RowDraw& draw, TokenWeightsKernel weigh,
                 std::vector<Candidate>& held, std::vector<float>& weights, std::vector<double>& block_sums) {
    const float temperature = static_cast<float>(draw.temperature);
    if (draw.top_k > 0) {
        // Among the top_k: their weights alone, top_p of their total.
        if (!top_candidates(row, width, std::min(draw.top_k, width), held) || held.empty()) return kWholeRow;
        std::vector<double> kept_weights(held.size());
        double total = 0.0;
        for (size_t i = 0; i < held.size(); ++i) {
            kept_weights[i] = token_weight(held[i].value, held.front().value, temperature);
            total += kept_weights[i];
        }
        const size_t kept = draw.top_p < 1.0 ? nucleus(kept_weights, draw.top_p * total, true) : held.size();
        return draw_kept(held, kept_weights, kept, draw.uniform);
    }
    // The whole vocabulary: every weight and the total, then the draw (top_p: among the most likely).
    const float largest = row[first_largest(row, width)];
    weights.resize(width);
    block_sums.resize((width + kWeightBlock - 1) / kWeightBlock);
    const double total = weigh(row, width, largest, temperature, weights.data(), block_sums.data());
    if (draw.top_p >= 1.0) return draw_whole(weights.data(), width, block_sums.data(), total, draw.uniform);
    if (!top_candidates(row, width, std::min(kMostTopK, width), held) || held.empty()) return kWholeRow;
    std::vector<double> kept_weights(held.size());
    for (size_t i = 0; i < held.size(); ++i) kept_weights[i] = weights[held[i].index];
    const size_t kept = nucleus(kept_weights, draw.top_p * total, static_cast<int64_t>(held.size()) == width);
    return kept == 0 ? kWholeRow : draw_kept(held, kept_weights, kept, draw.uniform);
}

void check_temperature(double temperature) {
    TORCH_CHECK(temperature >= std::numeric_limits<float>::min() && temperature <= std::numeric_limits<float>::max(),
                "temperatures must be float32 normal numbers (smaller ones are greedy), not ", temperature);
}

// torch.ops.corechat.draw_tokens: each row's draw, float32 [rows, width] with a finite largest value in
// each row (the sampler fails the others first); top_k 0 is off. kWholeRow where torch must draw.
at::Tensor draw_tokens(const at::Tensor& logits, c10::ArrayRef<int64_t> top_k, c10::ArrayRef<double> temperatures,
                       c10::ArrayRef<double> top_p, c10::ArrayRef<double> uniforms, int64_t path) {
    check_logits(logits);
    const int64_t rows = logits.size(0), width = logits.size(1);
    TORCH_CHECK(static_cast<int64_t>(top_k.size()) == rows && static_cast<int64_t>(temperatures.size()) == rows &&
                    static_cast<int64_t>(top_p.size()) == rows && static_cast<int64_t>(uniforms.size()) == rows,
                "one top_k, temperature, top_p and uniform per row");
    for (int64_t row = 0; row < rows; ++row) {
        TORCH_CHECK(top_k[row] >= 0, "top_k must be 0 (off) or positive, not ", top_k[row]);
        check_temperature(temperatures[row]);
        TORCH_CHECK(top_p[row] >= 0.0 && top_p[row] <= 1.0, "top_p must be in [0, 1], not ", top_p[row]);
        TORCH_CHECK(uniforms[row] >= 0.0 && uniforms[row] < 1.0, "uniforms must be in [0, 1), not ", uniforms[row]);
    }
    const TokenWeightsKernel weigh = select_token_weights(path);
    at::Tensor chosen = at::empty({rows}, logits.options().dtype(at::kLong));
    const float* values = logits.data_ptr<float>();
    int64_t* out = chosen.data_ptr<int64_t>();
    at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        thread_local std::vector<Candidate> held;
        thread_local std::vector<float> weights;
        thread_local std::vector<double> block_sums;
        held.reserve(kHeld);
        for (int64_t row = begin; row < end; ++row) {
            const int64_t k = top_k[row] >= width ? 0 : top_k[row];  // a top_k of every token is none
            out[row] = k > kMostTopK ? kWholeRow
                                     : draw_row(values + row * width, width, {k, temperatures[row], top_p[row], uniforms[row]},
                                                weigh, held, weights, block_sums);
        }
    });
    return chosen;
}

// torch.ops.corechat.token_weights: each row's weights as draw_tokens weighs a whole row (kernels.h:
// token_weight), float32 [rows, width].
at::Tensor token_weights(const at::Tensor& logits, c10::ArrayRef<double> temperatures, int64_t path) {
    check_logits(logits);
    const int64_t rows = logits.size(0), width = logits.size(1);
    TORCH_CHECK(static_cast<int64_t>(temperatures.size()) == rows, "one temperature per row");
    for (const double temperature : temperatures) check_temperature(temperature);
    const TokenWeightsKernel weigh = select_token_weights(path);
    at::Tensor weights = at::empty_like(logits);
    std::vector<double> block_sums((width + kWeightBlock - 1) / kWeightBlock);
    for (int64_t row = 0; row < rows; ++row) {
        const float* values = logits.data_ptr<float>() + row * width;
        weigh(values, width, values[first_largest(values, width)], static_cast<float>(temperatures[row]),
              weights.data_ptr<float>() + row * width, block_sums.data());
    }
    return weights;
}

// torch.ops.corechat.repetition_penalized: a copy of float32 logits [rows, width] in which row rows[i]'s
// logits at the first counts[i] ids of seen[i] (each id once) are lowered by penalties[i] as
// transformers' repetition penalty lowers them: a negative logit times the penalty, any other divided
// by it, in float32. One operator instead of a clone, a gather, a where and its operands and an
// indexed write: a decode step runs it on caches its weights just swept, where each operator call
// costs tens of microseconds.
at::Tensor repetition_penalized(const at::Tensor& logits, const std::vector<at::Tensor>& seen,
                                c10::ArrayRef<int64_t> counts, c10::ArrayRef<int64_t> rows,
                                c10::ArrayRef<double> penalties) {
    check_logits(logits);
    const int64_t count = logits.size(0), width = logits.size(1);
    TORCH_CHECK(seen.size() == rows.size() && counts.size() == rows.size() && rows.size() == penalties.size(),
                "one seen list, count and penalty per row");
    at::Tensor out = logits.clone();
    float* values = out.data_ptr<float>();
    for (size_t i = 0; i < rows.size(); ++i) {
        TORCH_CHECK(rows[i] >= 0 && rows[i] < count, "row ", rows[i], " is not one of the ", count, " rows");
        const at::Tensor& ids = seen[i];
        check_cpu(ids, "seen");
        TORCH_CHECK(ids.dim() == 1 && ids.is_contiguous() && ids.scalar_type() == at::kLong,
                    "seen ids must be a contiguous int64 vector");
        TORCH_CHECK(counts[i] >= 0 && counts[i] <= ids.numel(), "count ", counts[i], " is past the seen ids");
        const float penalty = static_cast<float>(penalties[i]);
        float* row = values + rows[i] * width;
        const int64_t* id = ids.const_data_ptr<int64_t>();
        for (int64_t k = 0; k < counts[i]; ++k) {
            TORCH_CHECK(id[k] >= 0 && id[k] < width, "seen id ", id[k], " is outside the vocabulary of ", width);
            const float value = row[id[k]];
            row[id[k]] = value < 0.0f ? value * penalty : value / penalty;
        }
    }
    return out;
}

// Whether a row's largest value is finite: every value below +inf (no NaN, no +inf) and one above -inf.
bool finite_largest_plain(const float* row, int64_t from, int64_t width, bool below, bool above) {
    constexpr float kInfinity = std::numeric_limits<float>::infinity();
    for (int64_t i = from; i < width; ++i) {
        below &= row[i] < kInfinity;
        above |= row[i] > -kInfinity;
    }
    return below && above;
}

#if defined(__x86_64__)
__attribute__((target("avx2"))) bool finite_largest_avx2(const float* row, int64_t width) {
    const __m256 infinity = _mm256_set1_ps(std::numeric_limits<float>::infinity());
    const __m256 negative = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    __m256 below = _mm256_castsi256_ps(_mm256_set1_epi32(-1)), above = _mm256_setzero_ps();
    int64_t index = 0;
    for (; index + 8 <= width; index += 8) {
        const __m256 values = _mm256_loadu_ps(row + index);
        below = _mm256_and_ps(below, _mm256_cmp_ps(values, infinity, _CMP_LT_OQ));
        above = _mm256_or_ps(above, _mm256_cmp_ps(values, negative, _CMP_GT_OQ));
    }
    return finite_largest_plain(row, index, width, _mm256_movemask_ps(below) == 0xff, _mm256_movemask_ps(above) != 0);
}
#endif

bool finite_largest(const float* row, int64_t width) {
#if defined(__x86_64__)
    if (cpu_has_avx2()) return finite_largest_avx2(row, width);
#endif
    return finite_largest_plain(row, 0, width, true, false);
}

// torch.ops.corechat.finite_rows: whether each row of float32 logits has a finite largest value (no
// NaN, no infinite largest; 1, else 0), what torch.isfinite(logits.amax(-1)) tells, in one operator.
std::vector<int64_t> finite_rows(const at::Tensor& logits) {
    check_logits(logits);
    const int64_t count = logits.size(0), width = logits.size(1);
    const float* values = logits.data_ptr<float>();
    std::vector<int64_t> finite(count);
    for (int64_t row = 0; row < count; ++row) finite[row] = finite_largest(values + row * width, width);
    return finite;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corechat, m) {
    m.def("repetition_penalized(Tensor logits, Tensor[] seen, int[] counts, int[] rows, float[] penalties) -> Tensor",
          repetition_penalized);
    m.def("finite_rows(Tensor logits) -> int[]", finite_rows);
    m.def("greedy_tokens(Tensor logits) -> Tensor", greedy_tokens);
    m.def("draw_tokens(Tensor logits, int[] top_k, float[] temperatures, float[] top_p, float[] uniforms, int path=0) "
          "-> Tensor", draw_tokens);
    m.def("token_weights(Tensor logits, float[] temperatures, int path=0) -> Tensor", token_weights);
}

}  // namespace corechat
