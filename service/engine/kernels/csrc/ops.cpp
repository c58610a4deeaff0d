// The torch operators over the kernels: torch.ops.corechat.quantized_linear, .attention, .paths and
// .layout. Each output column (and each attention row) is computed whole by one thread, so the
// thread count never changes a result either.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

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

enum Path : int64_t { kBest = 0, kReference = 1, kAvx2 = 2, kAvx512Vnni = 3 };

bool cpu_has_avx2() {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool cpu_has_avx512_vnni() {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") && cpu_has_avx2();
}

// The paths this library was built with and this CPU runs, best last.
std::vector<Path> available_paths() {
    std::vector<Path> paths = {kReference};
#ifdef CORECHAT_WITH_AVX2
    if (cpu_has_avx2()) paths.push_back(kAvx2);
#endif
#ifdef CORECHAT_WITH_AVX512_VNNI
    if (cpu_has_avx512_vnni()) paths.push_back(kAvx512Vnni);
#endif
    return paths;
}

const char* path_name(Path path) {
    switch (path) {
        case kReference: return "reference";
        case kAvx2: return "avx2";
        case kAvx512Vnni: return "avx512_vnni";
        default: return "best";
    }
}

MatmulKernel select_matmul(int64_t requested) {
    static const std::vector<Path> paths = available_paths();
    Path path = requested == kBest ? paths.back() : static_cast<Path>(requested);
    TORCH_CHECK(std::find(paths.begin(), paths.end(), path) != paths.end(), "corechat kernel path ",
                path_name(path), " is not built or not supported by this CPU");
    switch (path) {
#ifdef CORECHAT_WITH_AVX512_VNNI
        case kAvx512Vnni: return matmul_avx512_vnni;
#endif
#ifdef CORECHAT_WITH_AVX2
        case kAvx2: return matmul_avx2;
#endif
        default: return matmul_reference;
    }
}

std::vector<std::string> paths() {
    std::vector<std::string> names;
    for (Path path : available_paths()) names.emplace_back(path_name(path));
    return names;
}

// The weight layout the kernels read (kernels.h), which the Python converter must write: it checks
// its own constants against these when it loads. Names and values side by side (a Dict return
// trips a warning inside torch's headers).
std::tuple<std::vector<std::string>, std::vector<int64_t>> layout() {
    return {{"block", "interleave", "unit_bytes", "int8_rows", "int4_groups"},
            {kBlock, kInterleave, kUnitBytes, kInt8Rows, kInt4Groups}};
}

}  // namespace

void check_cpu(const at::Tensor& tensor, const char* name) {
    TORCH_CHECK(tensor.is_cpu(), name, " must be a CPU tensor, not one on ", tensor.device());
}

at::Tensor quantized_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias, int64_t format, int64_t outputs,
                            bool float32_output, int64_t path) {
    check_cpu(input, "input");
    check_cpu(weight, "weight");
    check_cpu(scales, "scales");
    TORCH_CHECK(input.dim() == 2 && input.is_contiguous(), "input must be a contiguous matrix");
    TORCH_CHECK(input.scalar_type() == at::kBFloat16 || input.scalar_type() == at::kFloat,
                "input must be bfloat16 or float32");
    TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() && scales.is_contiguous(),
                "weight and scales must be contiguous");
    const int64_t rows = input.size(0), inputs = input.size(1), stored = weight.size(0);
    // A width of 0 would divide by zero when the rows are shared among threads.
    TORCH_CHECK(inputs > 0 && inputs % kBlock == 0, "the input width must be a positive multiple of ", kBlock);
    TORCH_CHECK(outputs > 0 && stored == (outputs + kInterleave - 1) / kInterleave * kInterleave,
                "weight must hold the outputs padded to a multiple of ", kInterleave, " rows");
    if (format == kInt8Rows) {
        TORCH_CHECK(weight.scalar_type() == at::kChar && weight.size(1) == inputs, "int8 weight must be [rows, inputs]");
        TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.numel() == stored, "int8 scales must be float32 [rows]");
    } else {
        TORCH_CHECK(format == kInt4Groups, "unknown weight format ", format);
        TORCH_CHECK(inputs % (2 * kBlock) == 0, "int4 input widths must be multiples of ", 2 * kBlock);
        TORCH_CHECK(weight.scalar_type() == at::kByte && weight.size(1) * 2 == inputs, "int4 weight must be uint8 [rows, inputs / 2]");
        TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.numel() == stored * padded_blocks(inputs),
                    "int4 scales must be float16 [rows, inputs / 32 rounded up to a multiple of 8]");
    }
    const float* bias_data = nullptr;
    if (bias.has_value()) {
        check_cpu(*bias, "bias");
        TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == outputs,
                    "bias must be float32 [outputs]");
        bias_data = bias->data_ptr<float>();
    }
    const MatmulKernel kernel = select_matmul(path);

    at::Tensor values = at::empty({rows, inputs}, input.options().dtype(at::kChar));
    at::Tensor block_scales = at::empty({rows, padded_blocks(inputs)}, input.options().dtype(at::kFloat));
    at::Tensor corrections = at::empty({rows, padded_blocks(inputs)}, input.options().dtype(at::kFloat));
    const bool bfloat16_input = input.scalar_type() == at::kBFloat16;
    at::parallel_for(0, rows, std::max<int64_t>(1, kParallelBytes / (inputs * 4)), [&](int64_t begin, int64_t end) {
        quantize_rows(input.const_data_ptr(), bfloat16_input, inputs, begin, end, values.data_ptr<int8_t>(),
                      block_scales.data_ptr<float>(), corrections.data_ptr<float>(), inputs);
    });
    QuantizedRows x{values.const_data_ptr<int8_t>(), block_scales.const_data_ptr<float>(),
                    corrections.const_data_ptr<float>(), rows, inputs};
    Weights w{static_cast<int>(format), weight.const_data_ptr(), scales.const_data_ptr(), outputs, inputs};

    at::Tensor output = at::empty({rows, outputs}, input.options().dtype(float32_output ? at::kFloat : at::kBFloat16));
    Output out{output.data_ptr(), outputs, !float32_output};
    // Whole groups of kInterleave rows per task, so every tile reads one stream.
    const int64_t group_bytes = weight.size(1) * weight.element_size() * kInterleave;
    const int64_t groups = stored / kInterleave;
    at::parallel_for(0, groups, std::max<int64_t>(4, kParallelBytes / group_bytes), [&](int64_t begin, int64_t end) {
        kernel(x, w, bias_data, out, begin * kInterleave, std::min(end * kInterleave, outputs));
    });
    return output;
}

namespace {

at::Tensor attend_rows(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                       const at::Tensor& cache_rows, const at::Tensor& starts, const at::Tensor& ends, double scale) {
    TORCH_CHECK(query.dim() == 3 && keys.dim() == 4 && values.sizes() == keys.sizes(),
                "query must be [rows, heads, dim], keys and values [cache rows, kv_heads, width, dim]");
    TORCH_CHECK(query.scalar_type() == at::kBFloat16 && keys.scalar_type() == at::kBFloat16 &&
                values.scalar_type() == at::kBFloat16, "attention runs on bfloat16");
    const int64_t rows = query.size(0), heads = query.size(1), dim = query.size(2);
    const int64_t cache_count = keys.size(0), kv_heads = keys.size(1), width = keys.size(2);
    TORCH_CHECK(keys.size(3) == dim && heads % kv_heads == 0 && dim % 8 == 0, "query and cache shapes disagree");
    // A cache may be a view of the first columns of a larger tensor (kvcache.py's room): each
    // token's vector must be contiguous, the rows and heads may be any stride apart.
    TORCH_CHECK(query.stride(2) == 1 && keys.stride(3) == 1 && keys.stride(2) == dim && values.strides() == keys.strides(),
                "each token's keys and values must be contiguous (with the same strides), the query's last dimension too");
    for (const at::Tensor* index : {&cache_rows, &starts, &ends})
        TORCH_CHECK(index->scalar_type() == at::kLong && index->is_contiguous() && index->numel() == rows,
                    "cache_rows, starts and ends must be int64 [rows]");
    const int64_t* cache_row = cache_rows.const_data_ptr<int64_t>();
    const int64_t* first = starts.const_data_ptr<int64_t>();
    const int64_t* last = ends.const_data_ptr<int64_t>();
    for (int64_t row = 0; row < rows; ++row) {
        TORCH_CHECK(cache_row[row] >= 0 && cache_row[row] < cache_count, "row ", row, " names no cache row");
        TORCH_CHECK(first[row] >= 0 && first[row] < last[row] && last[row] <= width, "row ", row, " has no key to attend to");
    }
    at::Tensor output = at::empty({rows, heads, dim}, query.options());
    AttentionTask task{
        reinterpret_cast<const uint16_t*>(query.const_data_ptr()),
        reinterpret_cast<const uint16_t*>(keys.const_data_ptr()),
        reinterpret_cast<const uint16_t*>(values.const_data_ptr()),
        cache_row, first, last,
        reinterpret_cast<uint16_t*>(output.data_ptr()),
        query.stride(0), query.stride(1), keys.stride(0), keys.stride(1), heads, kv_heads, dim, static_cast<float>(scale)};
    at::parallel_for(0, rows * kv_heads, 1, [&](int64_t begin, int64_t end) { attend(task, begin, end); });
    return output;
}

}  // namespace

TORCH_LIBRARY(corechat, m) {
    m.def("quantized_linear(Tensor input, Tensor weight, Tensor scales, Tensor? bias, int format, int outputs, "
          "bool float32_output, int path=0) -> Tensor", quantized_linear);
    m.def("attention(Tensor query, Tensor keys, Tensor values, Tensor cache_rows, Tensor starts, Tensor ends, "
          "float scale) -> Tensor", attend_rows);
    m.def("paths() -> str[]", paths);
    m.def("layout() -> (str[], int[])", layout);
}

}  // namespace corechat
