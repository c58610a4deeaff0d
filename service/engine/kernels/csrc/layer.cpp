// A quantized Qwen2 (or Qwen3, Llama) decoder layer's work around its products, in three operators, so
// that a layer costs the interpreter three calls instead of dozens: torch.ops.corechat.rms_norm,
// .attention_inputs (norm, q/k/v products, Qwen3's per-head q/k norms, rotary) and .mlp (output
// product, residual, norm, gate/up products, SiLU, down product, residual); and .run_layers, every
// layer of a model (.register_layers) with the paged attention between, in one call.
//
// Each element is computed as transformers computes it, in float32 and rounded to bfloat16 after
// every operation it rounds after (the rotary's products and sum, the residual sums, the norm's
// two products, SiLU and its product), with one exception: RMSNorm's mean of squares is summed in
// corechat's own fixed order (8 lanes, elements in order, the lanes as sum_lanes adds them)
// instead of torch's. Every row is computed whole by one thread from its own values, so a token's
// result depends neither on the other rows of its batch nor on the thread count.
#include <ATen/Parallel.h>
#include <ATen/core/List.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/ones.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "kernels.h"
#include "ops.h"

namespace corechat {

namespace {

// Rows per task of the elementwise loops: a decode step's few rows run on the calling thread.
constexpr int64_t kRowGrain = 16;
// Elements per task of a sum: a decode step's rows (a few thousand elements) on the calling thread.
constexpr int64_t kElementGrain = 1 << 15;
constexpr int64_t kMaxHeadDim = 512;

inline float rounded(float value) { return bfloat16_to_float(float_to_bfloat16(value)); }

// Eight elements as one value of GCC's vector extension (reference.cpp's kind), which this file's
// build (the CPU's best instruction set) turns into one register: every operation lane by lane, the
// same IEEE operation as the scalar code's on each element (-ffp-contract=off: no fused multiply-add).
typedef float Floats8 __attribute__((vector_size(32)));
typedef uint32_t Bits8 __attribute__((vector_size(32)));
typedef uint16_t Halves8 __attribute__((vector_size(16)));

inline Floats8 widened8(const uint16_t* bits) {
    Halves8 halves;
    std::memcpy(&halves, bits, sizeof halves);
    return reinterpret_cast<Floats8>(__builtin_convertvector(halves, Bits8) << 16);
}

// float_to_bfloat16 on each lane: round to nearest even, a NaN kept quiet.
inline void store8(uint16_t* target, Floats8 values) {
    const Bits8 bits = reinterpret_cast<Bits8>(values);
    const Bits8 nan = reinterpret_cast<Bits8>((bits & 0x7fffffffu) > 0x7f800000u);
    const Bits8 chosen = nan ? (bits >> 16) | 0x40u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
    const Halves8 halves = __builtin_convertvector(chosen, Halves8);
    std::memcpy(target, &halves, sizeof halves);
}

// rounded() on each lane.
inline Floats8 rounded8(Floats8 values) {
    uint16_t bits[8];
    store8(bits, values);
    return widened8(bits);
}

inline Floats8 splat8(float value) { return Floats8{value, value, value, value, value, value, value, value}; }

inline const uint16_t* bits(const at::Tensor& tensor) {
    return reinterpret_cast<const uint16_t*>(tensor.const_data_ptr());
}

inline uint16_t* mutable_bits(at::Tensor& tensor) { return reinterpret_cast<uint16_t*>(tensor.data_ptr()); }

void check_matrix(const at::Tensor& tensor, const char* name) {
    check_cpu(tensor, name);
    TORCH_CHECK(tensor.dim() == 2 && tensor.is_contiguous() && tensor.scalar_type() == at::kBFloat16, name,
                " must be a contiguous bfloat16 matrix");
}

void check_vector(const at::Tensor& tensor, int64_t size, const char* name) {
    check_cpu(tensor, name);
    TORCH_CHECK(tensor.dim() == 1 && tensor.is_contiguous() && tensor.scalar_type() == at::kBFloat16 &&
                tensor.size(0) == size, name, " must be a contiguous bfloat16 vector of ", size);
}

// Qwen2RMSNorm of one row: weight * bf16(x * (1 / sqrt(mean(x^2) + eps))).
// Eight elements at a time, lane i % 8 taking element i in order as the scalar loop's lanes[i % 8] does.
void norm_row(const uint16_t* x, const uint16_t* weight, int64_t width, float eps, uint16_t* out) {
    Floats8 squares = splat8(0.0f);
    int64_t i = 0;
    for (; i + 8 <= width; i += 8) {
        const Floats8 values = widened8(x + i);
        squares = squares + values * values;
    }
    float lanes[8];
    std::memcpy(lanes, &squares, sizeof lanes);
    for (; i < width; ++i) {
        const float value = bfloat16_to_float(x[i]);
        lanes[i % 8] = lanes[i % 8] + value * value;
    }
    const float inverse = 1.0f / std::sqrt(sum_lanes(lanes) / static_cast<float>(width) + eps);
    // Each element's eight are read before they are written: in place (norm_heads) is safe.
    for (i = 0; i + 8 <= width; i += 8)
        store8(out + i, widened8(weight + i) * rounded8(widened8(x + i) * splat8(inverse)));
    for (; i < width; ++i)
        out[i] = float_to_bfloat16(bfloat16_to_float(weight[i]) * rounded(bfloat16_to_float(x[i]) * inverse));
}

at::Tensor rms_norm(const at::Tensor& input, const at::Tensor& weight, double eps) {
    check_matrix(input, "input");
    const int64_t rows = input.size(0), width = input.size(1);
    TORCH_CHECK(width > 0, "input rows must have a width above 0");
    check_vector(weight, width, "weight");
    at::Tensor output = at::empty_like(input);
    const uint16_t *x = bits(input), *w = bits(weight);
    uint16_t* out = mutable_bits(output);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row)
            norm_row(x + row * width, w, width, static_cast<float>(eps), out + row * width);
    });
    return output;
}

// transformers' apply_rotary_pos_emb on every head of every row, in place:
// x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]).
void rotate(at::Tensor& states, int64_t head_dim, const at::Tensor& cos, const at::Tensor& sin) {
    const int64_t rows = states.size(0), width = states.size(1), half = head_dim / 2;
    uint16_t* data = mutable_bits(states);
    const uint16_t *c = bits(cos), *s = bits(sin);
    // x[i] from the head as it was (a copy), eight elements at a time within each half.
    const auto rotated = [&](const uint16_t* head, const uint16_t* row_cos, const uint16_t* row_sin, int64_t i,
                             int64_t partner, bool negated, uint16_t* x) {
        if (i + 8 <= (negated ? half : head_dim)) {
            const Floats8 other = widened8(head + partner);
            store8(x + i, rounded8(widened8(head + i) * widened8(row_cos + i)) +
                              rounded8((negated ? -other : other) * widened8(row_sin + i)));
            return int64_t{8};
        }
        const float other = bfloat16_to_float(head[partner]);
        x[i] = float_to_bfloat16(rounded(bfloat16_to_float(head[i]) * bfloat16_to_float(row_cos[i])) +
                                 rounded((negated ? -other : other) * bfloat16_to_float(row_sin[i])));
        return int64_t{1};
    };
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
        uint16_t head[kMaxHeadDim];
        for (int64_t row = begin; row < end; ++row) {
            for (int64_t start = 0; start < width; start += head_dim) {
                uint16_t* x = data + row * width + start;
                const uint16_t *row_cos = c + row * head_dim, *row_sin = s + row * head_dim;
                std::memcpy(head, x, head_dim * sizeof(uint16_t));
                for (int64_t i = 0; i < half;) i += rotated(head, row_cos, row_sin, i, i + half, true, x);
                for (int64_t i = half; i < head_dim;) i += rotated(head, row_cos, row_sin, i, i - half, false, x);
            }
        }
    });
}

// Qwen3's q_norm or k_norm, in place: each head of every row through norm_row, as Qwen3RMSNorm runs over
// the last dimension of [rows, heads, head_dim] (its mean summed in norm_row's order, like every norm here).
void norm_heads(at::Tensor& states, int64_t head_dim, const at::Tensor& weight, double eps) {
    check_vector(weight, head_dim, "head norm weight");
    const int64_t rows = states.size(0), width = states.size(1);
    uint16_t* data = mutable_bits(states);
    const uint16_t* w = bits(weight);
    at::parallel_for(0, rows, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t row = begin; row < end; ++row)
            for (int64_t start = 0; start < width; start += head_dim) {
                // norm_row reads every element before it writes the first, so in place is safe.
                uint16_t* head = data + row * width + start;
                norm_row(head, w, head_dim, static_cast<float>(eps), head);
            }
    });
}

// sum = bf16(sum + addend), elementwise, in place.
// Each element alone, eight at a time; a prompt chunk's elements are shared by the threads.
void add_into(at::Tensor& sum, const at::Tensor& addend) {
    const int64_t count = sum.numel();
    uint16_t* out = mutable_bits(sum);
    const uint16_t* other = bits(addend);
    at::parallel_for(0, (count + 7) / 8, kElementGrain / 8, [&](int64_t begin, int64_t end) {
        const int64_t last = std::min(count, end * 8);
        int64_t i = begin * 8;
        for (; i + 8 <= last; i += 8) store8(out + i, widened8(out + i) + widened8(other + i));
        for (; i < last; ++i) out[i] = float_to_bfloat16(bfloat16_to_float(out[i]) + bfloat16_to_float(other[i]));
    });
}

// The products of a block: weights, scales, biases, output counts and formats side by side.
struct Products {
    const std::vector<at::Tensor>& weights;
    const std::vector<at::Tensor>& scales;
    const c10::List<std::optional<at::Tensor>>& biases;
    const std::vector<int64_t>& outputs;
    const std::vector<int64_t>& formats;

    Products(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
             const c10::List<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& outputs,
             const std::vector<int64_t>& formats, size_t count, const char* block)
        : weights(weights), scales(scales), biases(biases), outputs(outputs), formats(formats) {
        TORCH_CHECK(weights.size() == count && scales.size() == count && biases.size() == count &&
                    outputs.size() == count && formats.size() == count, block, " takes ", count, " products");
    }

    // Products `indices` of one input, in that order: those of one format computed together (ops.h:
    // products) on the input as `input_for` rounds it for that format, once. A block whose products
    // share a format (every block but the 4-bit formats' query, key and value) is one rounding and one call.
    template <typename InputFor>
    std::vector<at::Tensor> apply(std::initializer_list<size_t> indices, const InputFor& input_for) const {
        const size_t* order = indices.begin();
        std::vector<at::Tensor> results(indices.size());
        for (size_t first = 0; first < indices.size(); ++first) {
            if (results[first].defined()) continue;  // computed with an earlier product of its format
            const int64_t format = formats[order[first]];
            std::vector<ProductSpec> specs;
            std::vector<size_t> slots;
            for (size_t at = first; at < indices.size(); ++at) {
                const size_t index = order[at];
                if (formats[index] != format) continue;
                specs.push_back(ProductSpec{weights[index], scales[index], biases.get(index), format, outputs[index], false});
                slots.push_back(at);
            }
            std::vector<at::Tensor> group = products(input_for(format), specs, 0);
            for (size_t k = 0; k < slots.size(); ++k) results[slots[k]] = std::move(group[k]);
        }
        return results;
    }

    // Products `indices` of a bfloat16 input [rows, width], rounded for each format among them.
    std::vector<at::Tensor> apply(std::initializer_list<size_t> indices, const at::Tensor& input) const {
        return apply(indices, [&](int64_t format) { return quantize_input(input, format); });
    }
};

// Norm, then the query, key and value products, then (Qwen3) each query and key head's norm, then
// the rotary on the queries and keys: [rows, heads * head_dim], [rows, kv_heads * head_dim] twice.
// cos and sin are [rows, head_dim].
std::vector<at::Tensor> attention_inputs(const at::Tensor& hidden, const at::Tensor& norm_weight, double eps,
                                         const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
                                         const c10::List<std::optional<at::Tensor>>& biases,
                                         const std::vector<int64_t>& outputs, const std::vector<int64_t>& formats,
                                         const at::Tensor& cos,
                                         const at::Tensor& sin, int64_t head_dim,
                                         const std::optional<at::Tensor>& query_norm,
                                         const std::optional<at::Tensor>& key_norm, double head_eps) {
    const Products products(weights, scales, biases, outputs, formats, 3, "attention_inputs");
    check_matrix(hidden, "hidden");
    check_matrix(cos, "cos");
    check_matrix(sin, "sin");
    TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "head_dim must be even and at most ",
                kMaxHeadDim);
    TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == hidden.size(0) && cos.size(1) == head_dim,
                "cos and sin must be [rows, head_dim]");
    for (size_t index = 0; index < 3; ++index)
        TORCH_CHECK(outputs[index] % head_dim == 0, "product ", index, " does not hold whole heads");
    // Rounded once for the three products (once per format where they differ).
    std::vector<at::Tensor> results = products.apply({0, 1, 2}, rms_norm(hidden, norm_weight, eps));
    if (query_norm.has_value()) norm_heads(results[0], head_dim, *query_norm, head_eps);
    if (key_norm.has_value()) norm_heads(results[1], head_dim, *key_norm, head_eps);
    rotate(results[0], head_dim, cos, sin);
    rotate(results[1], head_dim, cos, sin);
    return results;
}

// The rest of the layer once attention has run: hidden + o(attended), then that plus
// down(silu(gate(s)) * up(s)) with s its norm. Products are [o, gate, up, down].
at::Tensor mlp(const at::Tensor& hidden, const at::Tensor& attended, const at::Tensor& norm_weight, double eps,
               const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
               const c10::List<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& outputs,
               const std::vector<int64_t>& formats) {
    const Products products(weights, scales, biases, outputs, formats, 4, "mlp");
    check_matrix(hidden, "hidden");
    check_matrix(attended, "attended");
    // add_into walks the sum's elements over its addend's: every operand of a sum must be hidden's shape.
    TORCH_CHECK(attended.size(0) == hidden.size(0), "attended must have hidden's rows");
    TORCH_CHECK(outputs[0] == hidden.size(1) && outputs[3] == hidden.size(1),
                "the output and down products must give hidden's width, ", hidden.size(1));
    TORCH_CHECK(outputs[1] == outputs[2], "the gate and up products must have the same width");
    at::Tensor sum = products.apply({0}, attended)[0];
    // hidden + o: the operands swapped, which a sum does not notice, to write into the new tensor.
    add_into(sum, hidden);
    // Rounded once for gate and up.
    std::vector<at::Tensor> gate_up = products.apply({1, 2}, rms_norm(sum, norm_weight, eps));
    // torch's own SiLU, so the activation is F.silu's bits whatever its exp does.
    at::Tensor activation = at::silu(gate_up[0]);
    activation.mul_(gate_up[1]);
    at::Tensor down = products.apply({3}, activation)[0];
    add_into(sum, down);
    return sum;
}

// A quantized model's decoder layers, handed over once (register_layers) so that a forward runs them
// all in one call (run_layers): a decode step then pays the interpreter once, not three times a layer.
struct LayerArguments {
    at::Tensor attention_norm, mlp_norm;
    double attention_eps, mlp_eps;
    // Qwen3's query and key norms; empty for a decoder without them.
    std::optional<at::Tensor> query_norm, key_norm;
    double head_eps = 0.0;
    std::vector<at::Tensor> attention_weights, attention_scales, mlp_weights, mlp_scales;
    c10::List<std::optional<at::Tensor>> attention_biases, mlp_biases;
    std::vector<int64_t> attention_outputs, mlp_outputs, attention_formats, mlp_formats;
};

struct RegisteredLayers {
    std::vector<LayerArguments> layers;
    int64_t head_dim;
    double scaling;
};

std::mutex registry_mutex;
std::vector<std::shared_ptr<const RegisteredLayers>> registry;

constexpr size_t kAttentionProducts = 3, kMlpProducts = 4, kProducts = kAttentionProducts + kMlpProducts;

// Keep a model's layers for run_layers: per layer its two norms' weights and epsilons, then its
// products q, k, v, o, gate, up, down (weights, scales, biases, outputs, formats), layer after layer; and,
// for Qwen3, its query and key norms' weights (two a layer) and their epsilon (one a layer).
int64_t register_layers(const std::vector<at::Tensor>& norms, const std::vector<double>& epsilons,
                        const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& scales,
                        const c10::List<std::optional<at::Tensor>>& biases, const std::vector<int64_t>& outputs,
                        const std::vector<int64_t>& formats, int64_t head_dim, double scaling,
                        const std::vector<at::Tensor>& head_norms,
                        const std::vector<double>& head_epsilons) {
    const size_t count = norms.size() / 2;
    TORCH_CHECK(count > 0 && norms.size() == 2 * count && epsilons.size() == 2 * count, "two norms per layer");
    TORCH_CHECK((head_norms.empty() && head_epsilons.empty()) ||
                (head_norms.size() == 2 * count && head_epsilons.size() == count),
                "head norms are two per layer with one epsilon, or none");
    for (const at::Tensor& norm : head_norms) check_vector(norm, head_dim, "head norm weight");
    TORCH_CHECK(weights.size() == kProducts * count && scales.size() == weights.size() && biases.size() == weights.size() &&
                outputs.size() == weights.size() && formats.size() == weights.size(), "seven products per layer");
    TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0 && head_dim <= kMaxHeadDim, "head_dim must be even and at most ", kMaxHeadDim);
    auto model = std::make_shared<RegisteredLayers>();
    model->head_dim = head_dim;
    model->scaling = scaling;
    for (size_t layer = 0; layer < count; ++layer) {
        LayerArguments arguments;
        arguments.attention_norm = norms[2 * layer];
        arguments.mlp_norm = norms[2 * layer + 1];
        arguments.attention_eps = epsilons[2 * layer];
        arguments.mlp_eps = epsilons[2 * layer + 1];
        if (!head_norms.empty()) {
            arguments.query_norm = head_norms[2 * layer];
            arguments.key_norm = head_norms[2 * layer + 1];
            arguments.head_eps = head_epsilons[layer];
        }
        for (size_t index = 0; index < kProducts; ++index) {
            const size_t at = kProducts * layer + index;
            const bool before = index < kAttentionProducts;
            (before ? arguments.attention_weights : arguments.mlp_weights).push_back(weights[at]);
            (before ? arguments.attention_scales : arguments.mlp_scales).push_back(scales[at]);
            (before ? arguments.attention_biases : arguments.mlp_biases).push_back(biases.get(at));
            (before ? arguments.attention_outputs : arguments.mlp_outputs).push_back(outputs[at]);
            (before ? arguments.attention_formats : arguments.mlp_formats).push_back(formats[at]);
        }
        model->layers.push_back(std::move(arguments));
    }
    std::lock_guard<std::mutex> hold(registry_mutex);
    registry.push_back(std::move(model));
    return static_cast<int64_t>(registry.size()) - 1;
}

// A model's layers as register_layers kept them.
std::shared_ptr<const RegisteredLayers> registered(int64_t model) {
    std::lock_guard<std::mutex> hold(registry_mutex);
    TORCH_CHECK(model >= 0 && model < static_cast<int64_t>(registry.size()), "no registered layers ", model);
    return registry[model];
}

// Every registered layer over rows of tokens: attention_inputs, paged_attention and mlp a layer at a
// time, the same calls the interpreter would make; returns the last layer's hidden states.
at::Tensor run_layers(int64_t model, const at::Tensor& hidden, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& pool, const at::Tensor& tables, const at::Tensor& row_sequences,
                      const at::Tensor& positions) {
    const std::shared_ptr<const RegisteredLayers> layers = registered(model);
    at::Tensor states = hidden;
    const int64_t rows = hidden.size(0), head_dim = layers->head_dim;
    for (size_t index = 0; index < layers->layers.size(); ++index) {
        const LayerArguments& layer = layers->layers[index];
        std::vector<at::Tensor> projected = attention_inputs(
            states, layer.attention_norm, layer.attention_eps, layer.attention_weights, layer.attention_scales,
            layer.attention_biases, layer.attention_outputs, layer.attention_formats, cos, sin, head_dim, layer.query_norm,
            layer.key_norm, layer.head_eps);
        at::Tensor attended = paged_attention(projected[0].view({rows, -1, head_dim}), projected[1].view({rows, -1, head_dim}),
                                              projected[2].view({rows, -1, head_dim}), pool, static_cast<int64_t>(index),
                                              tables, row_sequences, positions, layers->scaling, 0);
        states = mlp(states, attended.view({rows, -1}), layer.mlp_norm, layer.mlp_eps, layer.mlp_weights, layer.mlp_scales,
                     layer.mlp_biases, layer.mlp_outputs, layer.mlp_formats);
    }
    return states;
}

// Only the products of every registered layer, grouped as run_layers groups them (q/k/v, o,
// gate/up, down), on inputs of `rows` rows rounded once before: what the step probe
// (bench/probes/step_probe.py) times to split a step's layers into their products and the rest.
void run_products(int64_t model, int64_t rows) {
    const std::shared_ptr<const RegisteredLayers> layers = registered(model);
    TORCH_CHECK(rows > 0, "rows must be above 0");
    const LayerArguments& first = layers->layers.front();
    // Each product's input, rounded once before for its format, by input width.
    std::map<std::pair<int64_t, int64_t>, QuantizedInput> rounded;
    const auto inputs_of = [&](int64_t width) {
        return [&, width](int64_t format) -> const QuantizedInput& {
            auto found = rounded.find({width, format});
            if (found == rounded.end())
                found = rounded.emplace(std::make_pair(width, format),
                                        quantize_input(at::ones({rows, width}, first.attention_norm.options()), format))
                            .first;
            return found->second;
        };
    };
    // A product's input width, from its stored weight: int8 a byte per input, int4 half a byte.
    const auto width_of = [](const at::Tensor& weight, int64_t format) {
        return weight.size(1) * 8 / weight_bits(format);
    };
    const auto narrow = inputs_of(width_of(first.attention_weights[0], first.attention_formats[0])),
               attended = inputs_of(width_of(first.mlp_weights[0], first.mlp_formats[0])),
               wide = inputs_of(width_of(first.mlp_weights[3], first.mlp_formats[3]));
    for (const LayerArguments& layer : layers->layers) {
        const Products before(layer.attention_weights, layer.attention_scales, layer.attention_biases,
                              layer.attention_outputs, layer.attention_formats, kAttentionProducts, "run_products");
        const Products after(layer.mlp_weights, layer.mlp_scales, layer.mlp_biases, layer.mlp_outputs, layer.mlp_formats,
                             kMlpProducts, "run_products");
        before.apply({0, 1, 2}, narrow);
        after.apply({0}, attended);
        after.apply({1, 2}, narrow);
        after.apply({3}, wide);
    }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(corechat, m) {
    m.def("rms_norm(Tensor input, Tensor weight, float eps) -> Tensor", rms_norm);
    m.def("attention_inputs(Tensor hidden, Tensor norm_weight, float eps, Tensor[] weights, Tensor[] scales, "
          "Tensor?[] biases, int[] outputs, int[] formats, Tensor cos, Tensor sin, int head_dim, "
          "Tensor? query_norm=None, Tensor? key_norm=None, float head_eps=0.0) -> Tensor[]",
          attention_inputs);
    m.def("mlp(Tensor hidden, Tensor attended, Tensor norm_weight, float eps, Tensor[] weights, Tensor[] scales, "
          "Tensor?[] biases, int[] outputs, int[] formats) -> Tensor", mlp);
    m.def("register_layers(Tensor[] norms, float[] epsilons, Tensor[] weights, Tensor[] scales, Tensor?[] biases, "
          "int[] outputs, int[] formats, int head_dim, float scaling, Tensor[] head_norms, "
          "float[] head_epsilons) -> int", register_layers);
    m.def("run_layers(int model, Tensor hidden, Tensor cos, Tensor sin, Tensor(a!) pool, Tensor tables, "
          "Tensor row_sequences, Tensor positions) -> Tensor", run_layers);
    m.def("run_products(int model, int rows) -> ()", run_products);
}

}  // namespace corechat
