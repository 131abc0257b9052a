// The ISA level a CPU optimizer library runs at, read by Python through ctypes (not an operator:
// it describes the build). Compiled once per family; the family's cpu_optim_family.h names the
// symbol (DS_CPU_OPTIM_ISA_QUERY), so the three libraries export distinct names.
#include <exception>
#include <string>

#include "../common/cpu_isa.h"
#include "cpu_optim_family.h"

// An invalid DS_CPU_ISA comes back as "error: <message>": no exception may cross into ctypes.
extern "C" const char* DS_CPU_OPTIM_ISA_QUERY() {
  try {
    return deepspeed_cpp::cpu_isa_name(deepspeed_cpp::selected_cpu_isa());
  } catch (const std::exception& error) {
    static thread_local std::string message;
    message = std::string("error: ") + error.what();
    return message.c_str();
  }
}
