#include "fused_adam_launch.h"

#include <stdexcept>
#include <string>

namespace deepspeed_cpp {

std::vector<FusedAdamLaunchArgs> encode_fused_adam_launches(const FusedAdamCall& call,
                                                            const MultiTensorCapacity& capacity) {
  if (capacity.max_tensors > kFusedAdamMaxTensors || capacity.max_blocks > kFusedAdamMaxBlocks) {
    throw std::invalid_argument(
        "fused_adam: a launch holds at most " + std::to_string(kFusedAdamMaxTensors) +
        " tensors and " + std::to_string(kFusedAdamMaxBlocks) + " blocks, asked for " +
        std::to_string(capacity.max_tensors) + " and " + std::to_string(capacity.max_blocks));
  }
  std::vector<int64_t> numels;
  numels.reserve(call.tensors.size());
  for (const FusedAdamTensor& tensor : call.tensors) {
    numels.push_back(tensor.numel);
  }
  const std::vector<PlannedLaunch> plan = plan_multi_tensor_launches(numels, capacity);

  const AdamCoefficients coefficients = make_adam_coefficients(call.hyper);
  std::vector<FusedAdamLaunchArgs> launches(plan.size());
  for (size_t l = 0; l < plan.size(); ++l) {
    FusedAdamLaunchArgs& args = launches[l];
    args = FusedAdamLaunchArgs{};  // unused slots stay null
    args.hyper = call.hyper;
    args.coefficients = coefficients;
    args.lr = call.lr;
    args.inv_grad_scale = call.inv_grad_scale;
    args.found_inf = call.found_inf;
    args.chunk_elements = capacity.chunk_elements;
    args.num_blocks = static_cast<int32_t>(plan[l].blocks.size());
    for (size_t slot = 0; slot < plan[l].tensors.size(); ++slot) {
      const FusedAdamTensor& tensor = call.tensors[plan[l].tensors[slot]];
      args.param[slot] = tensor.param;
      args.grad[slot] = tensor.grad;
      args.exp_avg[slot] = tensor.exp_avg;
      args.exp_avg_sq[slot] = tensor.exp_avg_sq;
      args.step[slot] = tensor.step;
      args.numel[slot] = tensor.numel;
    }
    for (size_t block = 0; block < plan[l].blocks.size(); ++block) {
      args.block_slot[block] = static_cast<uint8_t>(plan[l].blocks[block].slot);
      args.block_chunk[block] = plan[l].blocks[block].chunk;
    }
  }
  return launches;
}

}  // namespace deepspeed_cpp
