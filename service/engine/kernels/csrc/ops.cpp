// The torch operators over the kernels: torch.ops.corechat.quantized_linear, .paged_attention, .paths,
// .layout, .page_layout and .peak_multiply_adds. Each output column (and each attention row) is
// computed whole by one thread, so the
// thread count never changes a result either.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <algorithm>
#include <numeric>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "ops.h"

namespace corechat {

namespace {

// Products whose weights are this many bytes or fewer run on one thread: below it, waking the
// pool costs more than it saves.
constexpr int64_t kParallelBytes = 1 << 18;

// kAvx512Bf16 names attention's kernels only (bf16_dot_chosen); products have no such path.
enum Path : int64_t { kBest = 0, kReference = 1, kAvx2 = 2, kAvx512Vnni = 3, kAmx = 4, kAvx512Bf16 = 5 };

bool cpu_has_avx2() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512_vnni() {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && cpu_has_avx2();
}

bool cpu_has_avx512_bf16() { return __builtin_cpu_supports("avx512bf16") && cpu_has_avx512_vnni(); }

// Whether the library has attention's kernels with the bfloat16 dot product (avx512_bf16.cpp) and
// the CPU runs them.
bool bf16_dot_available() {
#ifdef CORECHAT_WITH_AVX512_BF16
    static const bool available = cpu_has_avx512_bf16();
    return available;
#else
    return false;
#endif
}

#ifdef CORECHAT_WITH_AMX
// AMX-TILE and AMX-INT8 (CPUID leaf 7, EDX bits 24 and 25), and Linux's leave to use the tile
// registers, which a process must ask for once (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA) before
// its first tile instruction: without it that instruction kills the process.
bool cpu_has_amx() {
    static const bool granted = [] {
        unsigned int eax = 0, ebx = 0, ecx = 0, edx = 0;
        if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
        if (!(edx & (1u << 24)) || !(edx & (1u << 25)) || !cpu_has_avx512_vnni()) return false;
        constexpr long kRequestPermission = 0x1023, kTileData = 18;
        return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
    }();
    return granted;
}
#endif

// The paths this library was built with and this CPU runs, best last.
std::vector<Path> available_paths() {
    std::vector<Path> paths = {kReference};
#ifdef CORECHAT_WITH_AVX2
    if (cpu_has_avx2()) paths.push_back(kAvx2);
#endif
#ifdef CORECHAT_WITH_AVX512_VNNI
    if (cpu_has_avx512_vnni()) paths.push_back(kAvx512Vnni);
#endif
#ifdef CORECHAT_WITH_AMX
    if (cpu_has_amx()) paths.push_back(kAmx);
#endif
    return paths;
}

const char* path_name(Path path) {
    switch (path) {
        case kReference: return "reference";
        case kAvx2: return "avx2";
        case kAvx512Vnni: return "avx512_vnni";
        case kAmx: return "amx";
        case kAvx512Bf16: return "avx512_bf16";
        default: return "best";
    }
}

// The path `best` (0) runs: the best this CPU runs, or the one use_path chose.
std::atomic<int64_t> chosen_path{kBest};

// Resolve a requested path to one this library and CPU run, or raise.
Path resolve(int64_t requested) {
    static const std::vector<Path> paths = available_paths();
    const int64_t chosen = requested == kBest ? chosen_path.load() : requested;
    const Path path = chosen == kBest ? paths.back() : static_cast<Path>(chosen);
    TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "corechat kernel path ",
                path_name(path), " is not built or not supported by this CPU");
    return path;
}

MatmulKernel select_matmul(int64_t requested) {
    switch (resolve(requested)) {
#ifdef CORECHAT_WITH_AMX
        case kAmx: return matmul_amx;
#endif
#ifdef CORECHAT_WITH_AVX512_VNNI
        case kAvx512Vnni: return matmul_avx512_vnni;
#endif
#ifdef CORECHAT_WITH_AVX2
        case kAvx2: return matmul_avx2;
#endif
        default: return matmul_reference;
    }
}

// torch.ops.corechat.use_path: make `best` mean this path (0: the best this CPU runs again); return
// its name. Every path gives the same bits: a choice changes speed only.
std::string use_path(int64_t path) {
    TORCH_CHECK(path >= kBest && path <= kAmx, "no kernel path ", path);
    chosen_path = kBest;
    const Path resolved = resolve(path);
    chosen_path = path;
    return path_name(resolved);
}

std::vector<std::string> paths() {
    std::vector<std::string> names;
    for (Path path : available_paths()) names.emplace_back(path_name(path));
    return names;
}

// torch.ops.corechat.attention_paths: the paths paged_attention runs here, best last: the product
// paths up to AVX-512 VNNI, then avx512_bf16 where the CPU has the bfloat16 dot product.
std::vector<std::string> attention_paths() {
    std::vector<std::string> names;
    for (Path path : available_paths())
        if (path != kAmx) names.emplace_back(path_name(path));
    if (bf16_dot_available()) names.emplace_back(path_name(kAvx512Bf16));
    return names;
}

// The weight layout the kernels read (kernels.h), which the Python converter must write: it checks
// its own constants against these when it loads. Names and values side by side (a Dict return
// trips a warning inside torch's headers).
std::tuple<std::vector<std::string>, std::vector<int64_t>> layout() {
    return {{"block", "tile_outputs", "group_inputs", "int8_offset", "int6_offset", "int4_offset", "int8_groups",
             "int4_groups", "int4_mins", "int6_groups", "int8_rotated", "int6_rotated"},
            {kBlock, kTileOutputs, kGroupInputs, kInt8Offset, kInt6Offset, kInt4Offset, kInt8Groups, kInt4Groups,
             kInt4Mins, kInt6Groups, rotated_blocks(kInt8Groups), rotated_blocks(kInt6Groups)}};
}

}  // namespace

void check_cpu(const at::Tensor& tensor, const char* name) {
    TORCH_CHECK(tensor.is_cpu(), name, " must be a CPU tensor, not one on ", tensor.device());
}

QuantizeKernel select_quantize(int64_t path);

QuantizedInput quantize_input(const at::Tensor& input, int64_t format, int64_t path) {
    check_cpu(input, "input");
    TORCH_CHECK(input.dim() == 2 && input.is_contiguous(), "input must be a contiguous matrix");
    TORCH_CHECK(input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kFloat,
                "input must be bfloat16 or float32");
    const int64_t rows = input.size(0), inputs = input.size(1);
    // A width of 0 would divide by zero when the rows are shared among threads.
    TORCH_CHECK(inputs > 0 && inputs % kBlock == 0, "the input width must be a positive multiple of ", kBlock);
    const int64_t blocks = inputs / kBlock;
    QuantizedInput x{at::empty({rows, inputs}, input.options().dtype(at::kChar)),
                     at::empty({rows, blocks}, input.options().dtype(at::kFloat)),
                     at::empty({rows, blocks}, input.options().dtype(at::kInt))};
    const bool bfloat16_input = input.scalar_type() == at::kBFloat16;
    const QuantizeKernel quantize_rows = select_quantize(path);
    at::parallel_for(0, rows, std::max<int64_t>(1, kParallelBytes / (inputs * 4)), [&](int64_t begin, int64_t end) {
        quantize_rows(input.const_data_ptr(), bfloat16_input, rotated_blocks(format), inputs, begin, end, x.values.data_ptr<int8_t>(),
                      x.scales.data_ptr<float>(), x.sums.data_ptr<int32_t>(), inputs);
    });
    return x;
}

namespace {

// One product of a shared run: its weights, bias and output, and where its tiles start in the run's range.
struct Job {
    Weights w;
    const float* bias;
    Output out;
    int64_t first_tile, tiles;
};

// Check one product's tensors and make its output (rows x outputs).
Job prepare(const QuantizedInput& input, const ProductSpec& spec, int64_t first_tile, at::Tensor& output) {
    const at::Tensor &weight = spec.weight, &scales = spec.scales;
    const int64_t format = spec.format, outputs = spec.outputs;
    check_cpu(weight, "weight");
    check_cpu(scales, "scales");
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && scales.is_contiguous(),
                "weight and scales must be contiguous");
    const int64_t rows = input.values.size(0), inputs = input.values.size(1), stored = weight.size(0);
    TORCH_CHECK(outputs > 0 && stored == padded_outputs(outputs),
                "weight must hold the outputs padded to a multiple of ", kTileOutputs, " rows");
    TORCH_CHECK(weight.scalar_type() == at::kByte, "weight must be uint8 (weights stored with their offset)");
    const int64_t blocks = inputs / kBlock;
    TORCH_CHECK(known_format(format), "unknown weight format ", format);
    TORCH_CHECK(weight.size(1) * 8 == inputs * weight_bits(format), "a weight of ", weight_bits(format),
                " bits must be [padded rows, inputs * ", weight_bits(format), " / 8] bytes");
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == stored / kTileOutputs * blocks * block_scales(format),
                "scales must be float16 [padded rows / 16, inputs / 32, 16] (int4 with minimums: [..., 2, 16])");
    const float* bias_data = nullptr;
    if (spec.bias.has_value()) {
        const at::Tensor& bias = *spec.bias;
        check_cpu(bias, "bias");
        TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.is_contiguous() && bias.numel() == outputs,
                    "bias must be float32 [outputs]");
        bias_data = bias.data_ptr<float>();
    }
    output = at::empty({rows, outputs}, input.values.options().dtype(spec.float32_output ? at::kFloat : at::kBFloat16));
    return Job{Weights{static_cast<int>(format), weight.const_data_ptr<uint8_t>(), scales.const_data_ptr(), outputs, inputs},
               bias_data, Output{output.data_ptr(), outputs, !spec.float32_output}, first_tile, stored / kTileOutputs};
}

}  // namespace

std::vector<at::Tensor> products(const QuantizedInput& input, const std::vector<ProductSpec>& specs, int64_t path) {
    TORCH_CHECK(!specs.empty(), "no product to compute");
    const MatmulKernel kernel = select_matmul(path);
    const int64_t rows = input.values.size(0), inputs = input.values.size(1);
    QuantizedRows x{input.values.const_data_ptr<int8_t>(), input.scales.const_data_ptr<float>(),
                    input.sums.const_data_ptr<int32_t>(), rows, inputs};
    std::vector<at::Tensor> outputs(specs.size());
    std::vector<Job> jobs;
    int64_t tiles = 0, bytes = 0;
    for (size_t index = 0; index < specs.size(); ++index) {
        jobs.push_back(prepare(input, specs[index], tiles, outputs[index]));
        tiles += jobs.back().tiles;
        bytes += jobs.back().tiles * (inputs / kBlock) * block_bytes(jobs.back().w.format);
    }
    // Run tiles [begin, end) of the shared range, each piece with its own product.
    const auto run = [&](int64_t begin, int64_t end) {
        for (const Job& job : jobs) {
            const int64_t from = std::max(begin, job.first_tile), to = std::min(end, job.first_tile + job.tiles);
            if (from < to) kernel(x, job.w, job.bias, job.out, from - job.first_tile, to - job.first_tile);
        }
    };
    // Small products stay on the calling thread: waking the pool costs more than it saves. Larger
    // ones split the range into one contiguous piece per thread (each thread streams its piece).
    if (bytes <= kParallelBytes) {
        run(0, tiles);
    } else {
        at::parallel_for(0, tiles, 1, run);
    }
    return outputs;
}

at::Tensor product(const QuantizedInput& input, const at::Tensor& weight, const at::Tensor& scales,
                   const std::optional<at::Tensor>& bias, int64_t format, int64_t outputs, bool float32_output,
                   int64_t path) {
    return products(input, {ProductSpec{weight, scales, bias, format, outputs, float32_output}}, path)[0];
}

at::Tensor quantized_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias, int64_t format, int64_t outputs,
                            bool float32_output, int64_t path) {
    return product(quantize_input(input, format, path), weight, scales, bias, format, outputs, float32_output, path);
}

namespace {

// The path's member of a family of kernels built on `Lanes` (attention.inc, weights.inc): the AVX-512
// one on the tile unit's path too, which serves products only. A family's members for paths this
// library was not built with are nullptr, which resolve() never lets through.
#ifdef CORECHAT_WITH_AVX2
#define CORECHAT_IF_AVX2(kernel) kernel
#else
#define CORECHAT_IF_AVX2(kernel) nullptr
#endif
#ifdef CORECHAT_WITH_AVX512_VNNI
#define CORECHAT_IF_AVX512(kernel) kernel
#else
#define CORECHAT_IF_AVX512(kernel) nullptr
#endif
template <typename Kernel>
Kernel lanes_kernel(int64_t requested, Kernel reference, Kernel avx2, Kernel avx512) {
    switch (resolve(requested)) {
        case kAmx:
        case kAvx512Vnni: return avx512;
        case kAvx2: return avx2;
        default: return reference;
    }
}

// Whether attention runs the bfloat16 dot product's kernels (bf16_dot_available) for a requested
// path: kAvx512Bf16, and what the tile unit's path and `best` run; avx512_vnni asked for by name
// (or chosen by use_path) runs the FMA kernels, the same bits.
bool bf16_dot_chosen(int64_t requested) {
    if (requested == kAvx512Bf16) {
        TORCH_CHECK(bf16_dot_available(), "corechat kernel path avx512_bf16 is not built or not supported by this CPU");
        return true;
    }
    const Path path = resolve(requested);
    const bool named = requested == kAvx512Vnni || (requested == kBest && chosen_path.load() == kAvx512Vnni);
    return bf16_dot_available() && (path == kAmx || (path == kAvx512Vnni && !named));
}

#ifdef CORECHAT_WITH_AVX512_BF16
#define CORECHAT_IF_BF16(kernel) kernel
#else
#define CORECHAT_IF_BF16(kernel) nullptr
#endif

AttendKernel select_attend(int64_t requested) {
    if (bf16_dot_chosen(requested)) return CORECHAT_IF_BF16(attend_avx512_bf16);
    return lanes_kernel<AttendKernel>(requested, attend_reference, CORECHAT_IF_AVX2(attend_avx2),
                                      CORECHAT_IF_AVX512(attend_avx512));
}

AttendPartKernel select_attend_part(int64_t requested) {
    if (bf16_dot_chosen(requested)) return CORECHAT_IF_BF16(attend_part_avx512_bf16);
    return lanes_kernel<AttendPartKernel>(requested, attend_part_reference, CORECHAT_IF_AVX2(attend_part_avx2),
                                          CORECHAT_IF_AVX512(attend_part_avx512));
}

}  // namespace

// The activation rounding of a path: reference.cpp's plain code (built for this CPU's best
// instruction set, so the AVX2 path's too), the AVX-512 one on the AVX-512 and tile-unit paths.
QuantizeKernel select_quantize(int64_t path) {
    return lanes_kernel<QuantizeKernel>(path, quantize_rows, quantize_rows, CORECHAT_IF_AVX512(quantize_rows_avx512));
}

TokenWeightsKernel select_token_weights(int64_t path) {
    return lanes_kernel<TokenWeightsKernel>(path, token_weights_reference, CORECHAT_IF_AVX2(token_weights_avx2),
                                            CORECHAT_IF_AVX512(token_weights_avx512));
}

namespace {

void check_bfloat16_rows(const at::Tensor& tensor, int64_t rows, int64_t heads, int64_t dim, const char* name) {
    TORCH_CHECK(tensor.device().is_cpu() && tensor.scalar_type() == at::kBFloat16, name, " must be a bfloat16 CPU tensor");
    TORCH_CHECK(tensor.dim() == 3 && tensor.size(0) == rows && tensor.size(1) == heads && tensor.size(2) == dim &&
                tensor.stride(2) == 1, name, " must be [", rows, ", ", heads, ", ", dim, "] with each vector contiguous");
}

void check_index(const at::Tensor& tensor, int64_t rows, const char* name) {
    TORCH_CHECK(tensor.device().is_cpu() && tensor.scalar_type() == at::kLong && tensor.is_contiguous() &&
                tensor.dim() == 1 && tensor.numel() == rows, name, " must be a contiguous int64 CPU vector of ", rows);
}

// Write each row's key and value vectors into its sequence's page at its position.
void write_rows(const PagedAttention& task, const at::Tensor& keys, const at::Tensor& values, int64_t begin,
                int64_t end) {
    const int64_t dim = task.dim;
    const uint16_t* new_keys = reinterpret_cast<const uint16_t*>(keys.const_data_ptr());
    const uint16_t* new_values = reinterpret_cast<const uint16_t*>(values.const_data_ptr());
    uint16_t* pool = const_cast<uint16_t*>(task.pool);
    for (int64_t row = begin; row < end; ++row) {
        const int64_t position = task.positions[row];
        const int64_t page = task.tables[task.row_sequences[row] * task.table_width + position / kPageTokens];
        const int64_t in_page = position % kPageTokens;
        for (int64_t kv_head = 0; kv_head < task.kv_heads; ++kv_head) {
            const uint16_t* key = new_keys + row * keys.stride(0) + kv_head * keys.stride(1);
            const uint16_t* value = new_values + row * values.stride(0) + kv_head * values.stride(1);
            uint16_t* key_slot =
                pool + page * task.page_stride + task.keys_offset + kv_head * kPageTokens * dim + 2 * in_page;
            uint16_t* value_slot = pool + page * task.page_stride + task.values_offset + kv_head * kPageTokens * dim +
                                   (in_page / 2) * 2 * dim + in_page % 2;
            for (int64_t d = 0; d < dim; d += 2) std::memcpy(key_slot + d * kPageTokens, key + d, 2 * sizeof(uint16_t));
            for (int64_t d = 0; d < dim; ++d) value_slot[2 * d] = value[d];
        }
    }
}

}  // namespace

namespace {

// Keys a row attends to before its (kv head, row) pairs split over threads: below, one thread per
// pair costs less than the split's two more hand-offs.
constexpr int64_t kSplitKeys = 1024;

// How many ways to split each (kv head, row) pair: 1 unless the rows are decode rows of distinct
// sequences (no prompt tile to keep whole), each attending to at least kSplitKeys keys, and the
// pairs cannot share the threads evenly (2 kv heads of one stream on 8 threads, 3 on 2); then the
// fewest parts that can.
int64_t attention_parts(const PagedAttention& task) {
    const int64_t threads = at::get_num_threads(), pairs = task.kv_heads * task.rows;
    const int64_t parts = threads / std::gcd(pairs, threads);
    if (parts < 2) return 1;
    for (int64_t row = 0; row < task.rows; ++row) {
        if (task.positions[row] + 1 < kSplitKeys) return 1;
        if (row > 0 && task.row_sequences[row] == task.row_sequences[row - 1]) return 1;
    }
    return parts;
}

// Attend with every pair split `parts` ways (kernels.h: AttendPartKernel): its keys for the scores and
// weights, its value lanes (as many parts as the dim has 16-lane slices) for the output.
void attend_split(const PagedAttention& task, int64_t parts, int64_t path) {
    const AttendPartKernel kernel = select_attend_part(path);
    const int64_t group = task.heads / task.kv_heads, pairs = task.kv_heads * task.rows;
    int64_t stride = 0;
    for (int64_t row = 0; row < task.rows; ++row)
        stride = std::max(stride, (task.positions[row] / kKeyBlock + 1) * kKeyBlock);
    // The engine's thread calls every layer's attention: its buffers serve them all (read through
    // pointers: a thread_local named in the lambda would be each pool thread's own).
    thread_local std::vector<float> scores_buffer, largest_buffer;
    thread_local std::vector<uint16_t> bits_buffer;
    scores_buffer.resize(pairs * group * stride);
    bits_buffer.resize(pairs * group * stride);
    largest_buffer.resize(pairs * parts * group);
    float *scores = scores_buffer.data(), *largest = largest_buffer.data();
    uint16_t* bits = bits_buffer.data();
    const auto phase = [&](int step, int64_t step_parts) {
        at::parallel_for(0, pairs * step_parts, 1, [&](int64_t begin, int64_t end) {
            for (int64_t unit = begin; unit < end; ++unit) {
                const int64_t pair = unit / step_parts;
                kernel(task, step, pair, unit % step_parts, step_parts,
                       AttendScratch{scores + pair * group * stride, bits + pair * group * stride, stride,
                                     largest + pair * parts * group, parts});
            }
        });
    };
    phase(0, parts);
    phase(1, parts);
    phase(2, std::min(parts, task.dim / kKeyBlock));
}

}  // namespace

// torch.ops.corechat.paged_attention: write each row's keys and values into the pool, then attend
// (kernels.h: PagedAttention); [rows, heads, dim] out.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, at::Tensor& pool,
                           int64_t layer, const at::Tensor& tables, const at::Tensor& row_sequences,
                           const at::Tensor& positions, double scale, int64_t path) {
    TORCH_CHECK(query.dim() == 3, "query must be [rows, heads, dim]");
    const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
    TORCH_CHECK(pool.device().is_cpu() && pool.scalar_type() == at::kBFloat16 && pool.is_contiguous() && pool.dim() == 5 &&
                pool.size(2) == 2, "pool must be a contiguous bfloat16 CPU tensor [pages, layers, 2, kv_heads, ",
                kPageTokens, " * dim]");
    const int64_t pages = pool.size(0), layers = pool.size(1), kv_heads = pool.size(3);
    TORCH_CHECK(rows > 0 && kv_heads > 0 && heads > 0 && heads % kv_heads == 0, "heads (", heads,
                ") must be a positive multiple of kv_heads (", kv_heads, ") and rows (", rows, ") positive");
    TORCH_CHECK(dim == 16 || dim == 32 || dim == 64 || dim == 128 || dim == 256, "head dim must be 16, 32, 64, 128 or 256, not ", dim);
    TORCH_CHECK(pool.size(4) == kPageTokens * dim, "the pool's pages must hold ", kPageTokens, " tokens of dim ", dim);
    TORCH_CHECK(layer >= 0 && layer < layers, "layer ", layer, " is not in the pool's ", layers);
    // Positive and finite: the kernel scales the largest dot product for the largest score.
    TORCH_CHECK(std::isfinite(static_cast<float>(scale)) && static_cast<float>(scale) > 0.0f,
                "scale must be a positive finite float32, not ", scale);
    check_bfloat16_rows(query, rows, heads, dim, "query");
    check_bfloat16_rows(keys, rows, kv_heads, dim, "keys");
    check_bfloat16_rows(values, rows, kv_heads, dim, "values");
    TORCH_CHECK(tables.device().is_cpu() && tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.dim() == 2,
                "tables must be a contiguous int64 CPU matrix [sequences, pages per sequence]");
    check_index(row_sequences, rows, "row_sequences");
    check_index(positions, rows, "positions");
    const int64_t sequences = tables.size(0), width = tables.size(1);
    const int64_t *table_data = tables.const_data_ptr<int64_t>(), *sequence = row_sequences.const_data_ptr<int64_t>(),
                  *position = positions.const_data_ptr<int64_t>();
    for (int64_t row = 0; row < rows; ++row) {
        TORCH_CHECK(sequence[row] >= 0 && sequence[row] < sequences, "row ", row, " names no table");
        TORCH_CHECK(position[row] >= 0 && position[row] / kPageTokens < width, "row ", row, "'s position ",
                    position[row], " is outside its table of ", width, " pages");
        for (int64_t index = 0; index <= position[row] / kPageTokens; ++index) {
            const int64_t page = table_data[sequence[row] * width + index];
            TORCH_CHECK(page >= 0 && page < pages, "row ", row, "'s table names page ", page, " of ", pages);
        }
    }
    at::Tensor output = at::empty({rows, heads, dim}, query.options().memory_format(at::MemoryFormat::Contiguous));
    const int64_t layer_stride = 2 * kv_heads * kPageTokens * dim;
    PagedAttention task{
        reinterpret_cast<const uint16_t*>(query.const_data_ptr()), query.stride(0), query.stride(1),
        reinterpret_cast<const uint16_t*>(pool.data_ptr()), layers * layer_stride, layer * layer_stride,
        layer * layer_stride + kv_heads * kPageTokens * dim, table_data, width, sequence, position,
        reinterpret_cast<uint16_t*>(output.data_ptr()), rows, heads, kv_heads, dim, static_cast<float>(scale)};
    // Every row's keys are in place before any row attends: a prompt's tokens read each other's.
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) { write_rows(task, keys, values, begin, end); });
    const int64_t parts = attention_parts(task);
    if (parts > 1) {
        attend_split(task, parts, path);
    } else {
        const AttendKernel kernel = select_attend(path);
        at::parallel_for(0, kv_heads * rows, 1, [&](int64_t begin, int64_t end) { kernel(task, begin, end); });
    }
    return output;
}

namespace {

std::vector<int64_t> page_layout() { return {kPageTokens, kKeyBlock}; }

// torch.ops.corechat.peak_multiply_adds: run a path's multiply-add instructions alone on `threads`
// threads for `iterations` rounds each; return the multiply-adds done (the caller times the call).
int64_t peak_multiply_adds(int64_t path, int64_t iterations, int64_t threads) {
    TORCH_CHECK(iterations > 0 && threads > 0, "iterations and threads must be positive");
    static const std::vector<Path> paths = available_paths();
    TORCH_CHECK(std::find(paths.begin(), paths.end(), static_cast<Path>(path)) != paths.end() &&
                path != kReference, "the peak probe runs a SIMD path of this CPU");
    std::atomic<int64_t> checksum{0};
    at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
        for (int64_t thread = begin; thread < end; ++thread) {
#ifdef CORECHAT_WITH_AMX
            if (path == kAmx) checksum += peak_loop_amx(iterations);
#endif
#ifdef CORECHAT_WITH_AVX512_VNNI
            if (path == kAvx512Vnni) checksum += peak_loop_avx512(iterations);
#endif
#ifdef CORECHAT_WITH_AVX2
            if (path == kAvx2) checksum += peak_loop_avx2(iterations);
#endif
        }
    });
    TORCH_CHECK(checksum.load() != 0, "the peak probe did no work");
    const int64_t per_round = path == kAmx ? kPeakAmx : path == kAvx512Vnni ? kPeakLanesAvx512 * 64 : kPeakLanesAvx2 * 32;
    return threads * iterations * per_round;
}

}  // namespace

TORCH_LIBRARY(corechat, m) {
    m.def("quantized_linear(Tensor input, Tensor weight, Tensor scales, Tensor? bias, int format, int outputs, "
          "bool float32_output, int path=0) -> Tensor", quantized_linear);
    m.def("paged_attention(Tensor query, Tensor keys, Tensor values, Tensor(a!) pool, int layer, Tensor tables, "
          "Tensor row_sequences, Tensor positions, float scale, int path=0) -> Tensor", paged_attention);
    m.def("page_layout() -> int[]", page_layout);
    m.def("peak_multiply_adds(int path, int iterations, int threads) -> int", peak_multiply_adds);
    m.def("paths() -> str[]", paths);
    m.def("attention_paths() -> str[]", attention_paths);
    m.def("use_path(int path) -> str", use_path);
    m.def("layout() -> (str[], int[])", layout);
}

}  // namespace corechat
