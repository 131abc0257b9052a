// Host test build of the fused CUDA Adam (FusedAdamBuilder's sibling FusedAdamHostBuilder):
// everything the CUDA op does except the launch, compiled by the C++ compiler and run on CPU
// tensors.
//
// 1. A CPU kernel for deepspeed_cpp::fused_adam: the op's own argument checks and launch
//    planning, then, for every argument block, every block of its table and every thread of the
//    block, the kernel body of fused_adam_chunk.h, exactly as the GPU runs it (one thread per
//    (block, thread) pair in turn instead of all at once: the body has no cross-thread state).
// 2. Test ops in their own namespace, deepspeed_cpp_fused_adam_test (a TORCH_LIBRARY block of
//    this test library: they are instruments of the tests, not part of the shipped schema set).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/tensor.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "../fused_adam_checks.h"
#include "../fused_adam_chunk.h"
#include "../fused_adam_launch.h"
#include "../multi_tensor_plan.h"

namespace deepspeed_cpp {
namespace {

// What the CUDA launch does, serially: per block, thread 0's coefficients, then every thread.
void run_launches_on_host(const std::vector<FusedAdamLaunchArgs>& launches,
                          const FusedAdamCall& call, int threads_per_block) {
  dispatch_fused_adam_types(
      call.param_type, call.grad_type, call.state_type, [&](auto param, auto grad, auto state) {
        using Param = typename decltype(param)::type;
        using Grad = typename decltype(grad)::type;
        using State = typename decltype(state)::type;
        for (const FusedAdamLaunchArgs& args : launches) {
          for (int block = 0; block < args.num_blocks; ++block) {
            const AdamCoefficients coefficients = block_coefficients(args, block);
            for (int thread = 0; thread < threads_per_block; ++thread) {
              adam_chunk<Param, Grad, State>(args, block, coefficients, thread, threads_per_block);
            }
          }
        }
      });
}

void fused_adam_on_host(const MultiTensorCapacity& capacity, int64_t threads_per_block,
                        at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                        at::TensorList exp_avg_sqs, int64_t step, double lr, double beta1,
                        double beta2, double eps, double weight_decay, bool bias_correction,
                        bool adamw_mode, const std::optional<at::Tensor>& lr_tensor,
                        std::optional<at::TensorList> state_steps,
                        const std::optional<at::Tensor>& inv_grad_scale,
                        const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK(threads_per_block >= 1 && threads_per_block <= 1024,
              "threads_per_block must be in [1, 1024], got ", threads_per_block);
  const FusedAdamCall call =
      checked_fused_adam_call(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1, beta2, eps,
                              weight_decay, bias_correction, adamw_mode, lr_tensor, state_steps,
                              inv_grad_scale, found_inf, c10::DeviceType::CPU);
  run_launches_on_host(checked_fused_adam_launches(call, capacity), call,
                       static_cast<int>(threads_per_block));
}

// deepspeed_cpp::fused_adam on CPU tensors, with the CUDA op's capacity and block size.
void fused_adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, int64_t step, double lr, double beta1, double beta2,
                    double eps, double weight_decay, bool bias_correction, bool adamw_mode,
                    const std::optional<at::Tensor>& lr_tensor,
                    std::optional<at::TensorList> state_steps,
                    const std::optional<at::Tensor>& inv_grad_scale,
                    const std::optional<at::Tensor>& found_inf) {
  fused_adam_on_host(kFusedAdamCapacity, kFusedAdamBlockThreads, params, grads, exp_avgs,
                     exp_avg_sqs, step, lr, beta1, beta2, eps, weight_decay, bias_correction,
                     adamw_mode, lr_tensor, state_steps, inv_grad_scale, found_inf);
}

// The capacity's counts are int in the planner: a larger int64 would wrap round into another
// (possibly valid) capacity instead of being refused. The planner checks the rest of the range.
void check_capacity_fits_int(int64_t max_tensors, int64_t max_blocks) {
  constexpr int64_t kIntMax = std::numeric_limits<int>::max();
  constexpr int64_t kIntMin = std::numeric_limits<int>::min();
  TORCH_CHECK(max_tensors >= kIntMin && max_tensors <= kIntMax && max_blocks >= kIntMin &&
                  max_blocks <= kIntMax,
              "multi-tensor plan: max_tensors and max_blocks must be at most ", kIntMax, ", got ",
              max_tensors, " and ", max_blocks);
}

// The same with a chosen chunk size, launch capacity and block size, so that small tensors
// exercise tensors split over launches, partial chunks and idle threads.
void fused_adam_with_capacity(int64_t chunk_elements, int64_t max_tensors, int64_t max_blocks,
                              int64_t threads_per_block, at::TensorList params,
                              at::TensorList grads, at::TensorList exp_avgs,
                              at::TensorList exp_avg_sqs, int64_t step, double lr, double beta1,
                              double beta2, double eps, double weight_decay, bool bias_correction,
                              bool adamw_mode, const std::optional<at::Tensor>& lr_tensor,
                              std::optional<at::TensorList> state_steps,
                              const std::optional<at::Tensor>& inv_grad_scale,
                              const std::optional<at::Tensor>& found_inf) {
  TORCH_CHECK(chunk_elements >= 1 && chunk_elements <= (int64_t(1) << 30),
              "chunk_elements must be in [1, 2^30], got ", chunk_elements);
  check_capacity_fits_int(max_tensors, max_blocks);
  const MultiTensorCapacity capacity{chunk_elements, static_cast<int>(max_tensors),
                                     static_cast<int>(max_blocks)};
  fused_adam_on_host(capacity, threads_per_block, params, grads, exp_avgs, exp_avg_sqs, step, lr,
                     beta1, beta2, eps, weight_decay, bias_correction, adamw_mode, lr_tensor,
                     state_steps, inv_grad_scale, found_inf);
}

// The planner's table: blocks [rows, 4] = (launch, slot, tensor, chunk) and slots [rows, 3] =
// (launch, slot, tensor).
std::tuple<at::Tensor, at::Tensor> plan(at::IntArrayRef numels, int64_t chunk_elements,
                                        int64_t max_tensors, int64_t max_blocks) {
  check_capacity_fits_int(max_tensors, max_blocks);
  std::vector<PlannedLaunch> launches;
  try {
    launches = plan_multi_tensor_launches(
        numels.vec(), MultiTensorCapacity{chunk_elements, static_cast<int>(max_tensors),
                                          static_cast<int>(max_blocks)});
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK(false, error.what());
  }
  std::vector<int64_t> blocks;
  std::vector<int64_t> slots;
  for (size_t l = 0; l < launches.size(); ++l) {
    for (size_t s = 0; s < launches[l].tensors.size(); ++s) {
      slots.insert(slots.end(), {int64_t(l), int64_t(s), launches[l].tensors[s]});
    }
    for (const PlannedBlock& block : launches[l].blocks) {
      blocks.insert(blocks.end(),
                    {int64_t(l), block.slot, launches[l].tensors[block.slot], block.chunk});
    }
  }
  const auto as_table = [](const std::vector<int64_t>& values, int64_t columns) {
    return at::tensor(values, at::kLong).reshape({int64_t(values.size()) / columns, columns});
  };
  return {as_table(blocks, 4), as_table(slots, 3)};
}

// (sizeof the argument block, the parameter limit, max tensors, max blocks, chunk, threads).
std::vector<int64_t> argument_block() {
  return {int64_t(sizeof(FusedAdamLaunchArgs)),
          int64_t(kKernelArgumentBytesLimit),
          kFusedAdamMaxTensors,
          kFusedAdamMaxBlocks,
          kFusedAdamChunkElements,
          kFusedAdamBlockThreads};
}

// float32 -> bfloat16 / float16 with the kernel's conversion.
at::Tensor to_low_precision(const at::Tensor& values, bool bfloat16) {
  TORCH_CHECK(values.scalar_type() == at::kFloat && values.device().is_cpu(),
              "values must be a float32 CPU tensor");
  const at::Tensor input = values.contiguous();
  at::Tensor out =
      at::empty(input.sizes(), input.options().dtype(bfloat16 ? at::kBFloat16 : at::kHalf));
  const float* in = input.data_ptr<float>();
  auto* bits = static_cast<uint16_t*>(out.data_ptr());
  for (int64_t i = 0; i < input.numel(); ++i) {
    if (bfloat16) {
      BFloat16Bits stored;
      store_from_float(stored, in[i]);
      bits[i] = stored.bits;
    } else {
      Float16Bits stored;
      store_from_float(stored, in[i]);
      bits[i] = stored.bits;
    }
  }
  return out;
}

// bfloat16 / float16 -> float32 with the kernel's conversion.
at::Tensor to_float(const at::Tensor& values) {
  const bool bfloat16 = values.scalar_type() == at::kBFloat16;
  TORCH_CHECK((bfloat16 || values.scalar_type() == at::kHalf) && values.device().is_cpu(),
              "values must be a bfloat16 or float16 CPU tensor");
  const at::Tensor input = values.contiguous();
  at::Tensor out = at::empty(input.sizes(), input.options().dtype(at::kFloat));
  const auto* bits = static_cast<const uint16_t*>(input.data_ptr());
  float* result = out.data_ptr<float>();
  for (int64_t i = 0; i < input.numel(); ++i) {
    result[i] =
        bfloat16 ? load_as_float(BFloat16Bits{bits[i]}) : load_as_float(Float16Bits{bits[i]});
  }
  return out;
}

// adam_coefficients (what the kernel derives when lr or steps come from the device) for each
// (lrs[i], steps[i]): an [n, 9] float32 table, for comparison with a float64 reference.
at::Tensor coefficients(const at::Tensor& lrs, const at::Tensor& steps, double beta1, double beta2,
                        double eps, double weight_decay, bool bias_correction, bool adamw_mode) {
  TORCH_CHECK(lrs.scalar_type() == at::kDouble && steps.scalar_type() == at::kLong &&
                  lrs.numel() == steps.numel(),
              "lrs must be float64 and steps int64, of equal lengths");
  const at::Tensor lr_values = lrs.contiguous();
  const at::Tensor step_values = steps.contiguous();
  constexpr int kFields = sizeof(AdamCoefficients) / sizeof(float);
  at::Tensor table = at::empty({lrs.numel(), kFields}, at::kFloat);
  const AdamHyperParams hp{0.0, beta1, beta2, eps, weight_decay, 0, bias_correction, adamw_mode};
  for (int64_t i = 0; i < lrs.numel(); ++i) {
    const AdamCoefficients c =
        adam_coefficients(hp, lr_values.data_ptr<double>()[i], step_values.data_ptr<int64_t>()[i]);
    std::memcpy(table.data_ptr<float>() + i * kFields, &c, sizeof c);
  }
  return table;
}

}  // namespace
}  // namespace deepspeed_cpp

TORCH_LIBRARY_IMPL(deepspeed_cpp, CPU, m) { m.impl("fused_adam", &deepspeed_cpp::fused_adam_cpu); }

TORCH_LIBRARY(deepspeed_cpp_fused_adam_test, m) {
  m.def(
      "fused_adam_with_capacity(int chunk_elements, int max_tensors, int max_blocks, "
      "int threads_per_block, Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, int step, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool bias_correction, bool adamw_mode, *, Tensor? lr_tensor=None, "
      "Tensor[]? state_steps=None, Tensor? inv_grad_scale=None, Tensor? found_inf=None) -> ()",
      &deepspeed_cpp::fused_adam_with_capacity);
  m.def(
      "plan(int[] numels, int chunk_elements, int max_tensors, int max_blocks) -> (Tensor, Tensor)",
      &deepspeed_cpp::plan);
  m.def("argument_block() -> int[]", &deepspeed_cpp::argument_block);
  m.def("to_low_precision(Tensor values, bool bfloat16) -> Tensor",
        &deepspeed_cpp::to_low_precision);
  m.def("to_float(Tensor values) -> Tensor", &deepspeed_cpp::to_float);
  m.def(
      "coefficients(Tensor lrs, Tensor steps, float beta1, float beta2, float eps, "
      "float weight_decay, bool bias_correction, bool adamw_mode) -> Tensor",
      &deepspeed_cpp::coefficients);
}
