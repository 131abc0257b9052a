// Words for an errno value, for error messages that a user can act on.
#pragma once

#include <string>

namespace deepspeed_cpp {
namespace aio {

// "No space left on device (ENOSPC, errno 28)".
std::string describe_errno(int error_number);

// "ENOSPC" for 28: the errno macro's name, or nullptr for a value that has none.
const char* errno_name(int error_number);

}  // namespace aio
}  // namespace deepspeed_cpp
