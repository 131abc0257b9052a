// Which engines this build has, which of them the running kernel allows, and the default choice.
#include <cstdlib>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "io_engine.h"

namespace deepspeed_cpp {
namespace aio {
namespace {

[[maybe_unused]] std::string not_compiled_reason(EngineKind kind) {
  if (kind == EngineKind::kIoUring) {
    return "io_uring is not compiled into this build (liburing.h or -luring was missing when "
           "the op was built; install liburing-dev and rebuild)";
  }
  return "libaio is not compiled into this build (libaio.h or -laio was missing when the op was "
         "built; install libaio-dev and rebuild)";
}

std::string probe(EngineKind kind) {
  switch (kind) {
    case EngineKind::kIoUring:
#if DS_AIO_HAVE_LIBURING
      return probe_io_uring();
#else
      return not_compiled_reason(kind);
#endif
    case EngineKind::kLibaio:
#if DS_AIO_HAVE_LIBAIO
      return probe_libaio();
#else
      return not_compiled_reason(kind);
#endif
    case EngineKind::kThreads:
      return "";
    case EngineKind::kAuto:
      break;
  }
  return "'auto' is a choice among engines, not an engine";
}

EngineKind best_usable() {
  for (EngineKind kind : compiled_engines()) {
    if (engine_unavailable_reason(kind).empty()) return kind;
  }
  return EngineKind::kThreads;
}

}  // namespace

EngineKind parse_engine(const std::string& name) {
  if (name == "auto") return EngineKind::kAuto;
  if (name == "io_uring") return EngineKind::kIoUring;
  if (name == "libaio") return EngineKind::kLibaio;
  if (name == "threads") return EngineKind::kThreads;
  throw std::invalid_argument("engine='" + name +
                              "' is not known; expected one of auto, io_uring, libaio, threads");
}

const char* engine_name(EngineKind kind) {
  switch (kind) {
    case EngineKind::kAuto:
      return "auto";
    case EngineKind::kIoUring:
      return "io_uring";
    case EngineKind::kLibaio:
      return "libaio";
    case EngineKind::kThreads:
      return "threads";
  }
  return "unknown";
}

std::vector<EngineKind> compiled_engines() {
  std::vector<EngineKind> kinds;
#if DS_AIO_HAVE_LIBURING
  kinds.push_back(EngineKind::kIoUring);
#endif
#if DS_AIO_HAVE_LIBAIO
  kinds.push_back(EngineKind::kLibaio);
#endif
  kinds.push_back(EngineKind::kThreads);
  return kinds;
}

std::string engine_unavailable_reason(EngineKind kind) {
  // Probed once per process: the answer depends on the build and the kernel only.
  static std::mutex mutex;
  static std::string reasons[4];
  static bool probed[4] = {false, false, false, false};
  const int index = static_cast<int>(kind);
  std::lock_guard<std::mutex> lock(mutex);
  if (!probed[index]) {
    reasons[index] = probe(kind);
    probed[index] = true;
  }
  return reasons[index];
}

EngineKind resolve_engine(EngineKind requested) {
  if (requested == EngineKind::kAuto) {
    const char* forced = std::getenv("DS_AIO_ENGINE");
    if (forced == nullptr || *forced == '\0' || std::string(forced) == "auto") return best_usable();
    try {
      requested = parse_engine(forced);
    } catch (const std::invalid_argument&) {
      throw std::invalid_argument(std::string("DS_AIO_ENGINE='") + forced +
                                  "' is not known; expected one of auto, io_uring, libaio, "
                                  "threads");
    }
  }
  const std::string reason = engine_unavailable_reason(requested);
  if (!reason.empty()) {
    throw std::runtime_error(std::string("engine='") + engine_name(requested) +
                             "' cannot run here: " + reason);
  }
  return requested;
}

std::unique_ptr<IoEngine> make_engine(EngineKind kind, int queue_depth) {
  switch (kind) {
#if DS_AIO_HAVE_LIBURING
    case EngineKind::kIoUring:
      return make_io_uring_engine(queue_depth);
#endif
#if DS_AIO_HAVE_LIBAIO
    case EngineKind::kLibaio:
      return make_libaio_engine(queue_depth);
#endif
    case EngineKind::kThreads:
      return make_thread_pool_engine(queue_depth);
    default:
      break;
  }
  throw std::runtime_error(std::string("engine '") + engine_name(kind) +
                           "' is not available in this build");
}

}  // namespace aio
}  // namespace deepspeed_cpp
