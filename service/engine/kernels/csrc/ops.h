// What the operator files share: the quantized product as a C++ function (layer.cpp calls it), and
// the check that a tensor is the CPU's.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "kernels.h"

namespace corechat {

// The sampler's token weights (kernels.h: TokenWeightsKernel) of a kernel path (0: the best, or
// the one use_path chose).
TokenWeightsKernel select_token_weights(int64_t path);

// Refuse a tensor that is not in the CPU's memory (a meta or device tensor): the kernels read it directly.
void check_cpu(const at::Tensor& tensor, const char* name);

// Activations rounded to int8 per block (kernels.h: QuantizedRows), as tensors.
struct QuantizedInput {
    at::Tensor values;  // int8 [rows, cols]
    at::Tensor scales;  // float32 [rows, cols / 32]
    at::Tensor sums;    // int32 [rows, cols / 32]
};

// Round a contiguous bfloat16 or float32 matrix's rows for the products of a weight format (its
// blocks rotated for a rotated format, kernels.h): once per input, however many products take it.
// Every path (0: the best) gives the same bits.
QuantizedInput quantize_input(const at::Tensor& input, int64_t format, int64_t path = 0);

// One product of a rounded input: a stored weight (kernels.h), its scales and float32 bias, the
// outputs it holds and whether they come out as float32 (else bfloat16).
struct ProductSpec {
    at::Tensor weight;
    at::Tensor scales;
    std::optional<at::Tensor> bias;
    int64_t format;
    int64_t outputs;
    bool float32_output;
};

// Products of one rounded input computed together, [rows, outputs] each: their tiles form one range
// the threads share, so products too small to split alone (a layer's keys and values) still do.
std::vector<at::Tensor> products(const QuantizedInput& input, const std::vector<ProductSpec>& specs, int64_t path);

// A rounded input times a stored weight (kernels.h), plus the float32 bias.
at::Tensor product(const QuantizedInput& input, const at::Tensor& weight, const at::Tensor& scales,
                   const std::optional<at::Tensor>& bias, int64_t format, int64_t outputs, bool float32_output,
                   int64_t path);

// torch.ops.corechat.quantized_linear: input [rows, inputs] (bfloat16 or float32) times a stored
// weight (kernels.h), plus the float32 bias, as bfloat16 or float32 [rows, outputs]; path 0 is
// the best this CPU runs.
at::Tensor quantized_linear(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& scales,
                            const std::optional<at::Tensor>& bias, int64_t format, int64_t outputs,
                            bool float32_output, int64_t path);

// torch.ops.corechat.paged_attention: write each row's keys and values into the pool's pages, then
// attend (kernels.h: PagedAttention); path 0 is the best this CPU runs.
at::Tensor paged_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, at::Tensor& pool,
                           int64_t layer, const at::Tensor& tables, const at::Tensor& row_sequences,
                           const at::Tensor& positions, double scale, int64_t path);

}  // namespace corechat
