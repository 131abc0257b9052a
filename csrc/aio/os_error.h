// Words for an errno value, for error messages that a user can act on.
#pragma once

#include <string>

namespace deepspeed_cpp {
namespace aio {

// "No space left on device (ENOSPC, errno 28)".
std::string describe_errno(int error_number);

}  // namespace aio
}  // namespace deepspeed_cpp
