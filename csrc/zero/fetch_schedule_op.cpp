// ATen glue for the ZeRO-3 fetch scheduler: the FetchSchedule custom class over the torch-free
// core in fetch_schedule.h. Every core error (std::invalid_argument) becomes a c10::Error, which
// Python sees as RuntimeError with the core's message (it names the bad value).
#include <torch/custom_class.h>
#include <torch/library.h>

#include <stdexcept>
#include <tuple>
#include <utility>
#include <vector>

#include "fetch_schedule.h"

namespace deepspeed_cpp {
namespace {

template <typename F>
auto checked(F&& call) -> decltype(call()) {
  try {
    return call();
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK(false, error.what());
  }
}

}  // namespace

// Named (not anonymous) so that the class's registered type is unique across libraries.
class FetchScheduleClass : public torch::CustomClassHolder {
 public:
  FetchScheduleClass(std::vector<int64_t> unit_numel, int64_t prefetch_bucket_size,
                     int64_t max_live_parameters, int64_t max_reuse_distance)
      : core_(checked([&] {
          return FetchSchedule(std::move(unit_numel), prefetch_bucket_size, max_live_parameters,
                               max_reuse_distance);
        })) {}

  std::vector<int64_t> on_use(int64_t unit) {
    return checked([&] { return core_.on_use(unit); });
  }
  // on_use and then diverged in one call: a call into a custom class costs ~7 us of boxing on
  // this machine's CPUs, and ZeRO-3 asks both at every use.
  std::tuple<std::vector<int64_t>, bool> on_use_and_diverged(int64_t unit) {
    auto launches = on_use(unit);
    return {std::move(launches), core_.diverged()};
  }
  bool on_done(int64_t unit) {
    return checked([&] { return core_.on_done(unit); });
  }
  std::vector<int64_t> end_pass() { return core_.end_pass(); }
  void invalidate() { core_.invalidate(); }
  bool recording() { return core_.recording(); }
  bool diverged() { return core_.diverged(); }
  int64_t divergences() { return core_.divergences(); }
  int64_t live_numel() { return core_.live_numel(); }
  int64_t peak_live_numel() { return core_.peak_live_numel(); }
  void reset_peak() { core_.reset_peak(); }
  std::vector<int64_t> trace() { return core_.trace(); }
  int64_t num_units() { return core_.num_units(); }

 private:
  FetchSchedule core_;
};

}  // namespace deepspeed_cpp

// A custom class must be registered by the library that implements it (see zero_op.cpp).
TORCH_LIBRARY_FRAGMENT(deepspeed_cpp, m) {
  using deepspeed_cpp::FetchScheduleClass;
  m.class_<FetchScheduleClass>("FetchSchedule")
      .def(torch::init<std::vector<int64_t>, int64_t, int64_t, int64_t>())
      .def("on_use", &FetchScheduleClass::on_use)
      .def("on_use_and_diverged", &FetchScheduleClass::on_use_and_diverged)
      .def("on_done", &FetchScheduleClass::on_done)
      .def("end_pass", &FetchScheduleClass::end_pass)
      .def("invalidate", &FetchScheduleClass::invalidate)
      .def("recording", &FetchScheduleClass::recording)
      .def("diverged", &FetchScheduleClass::diverged)
      .def("divergences", &FetchScheduleClass::divergences)
      .def("live_numel", &FetchScheduleClass::live_numel)
      .def("peak_live_numel", &FetchScheduleClass::peak_live_numel)
      .def("reset_peak", &FetchScheduleClass::reset_peak)
      .def("trace", &FetchScheduleClass::trace)
      .def("num_units", &FetchScheduleClass::num_units);
}
