#include "os_error.h"

#include <cstring>

namespace deepspeed_cpp {
namespace aio {

std::string describe_errno(int error_number) {
  char text[256];
  // The GNU strerror_r returns a pointer that may or may not be `text`.
  const char* message = strerror_r(error_number, text, sizeof(text));
  std::string described = message;
  described += " (";
  const char* symbol = errno_name(error_number);
  if (symbol != nullptr) described += std::string(symbol) + ", ";
  described += "errno " + std::to_string(error_number) + ")";
  return described;
}

}  // namespace aio
}  // namespace deepspeed_cpp
