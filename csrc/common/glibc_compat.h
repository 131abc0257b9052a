// Keeps the op libraries loadable on glibc 2.28 (manylinux_2_28) when they are built on a newer
// system. Every translation unit gets this header first: the op builders pass
// `-include common/glibc_compat.h` to the C++ compiler, and to nvcc's host compiler.
//
// A library records, for each C-library symbol it calls, the symbol version of the glibc (and
// libstdc++) it was linked against; a system whose libraries lack that version refuses to load
// it. Where glibc or libstdc++ still export the older version of the same function, the
// directives below bind to it; where a newer version comes only from a header's inline code,
// the library gets its own copy.
#pragma once

#if defined(__linux__) && !defined(__CUDA_ARCH__) && defined(__has_include)
#if __has_include(<features.h>)
#include <features.h>
#endif
#endif

#if defined(__GLIBC__) && !defined(__CUDA_ARCH__)

#define DS_GLIBC_COMPAT_STR2(x) #x
#define DS_GLIBC_COMPAT_STR(x) DS_GLIBC_COMPAT_STR2(x)
#define DS_BIND_SYMBOL_VERSION(symbol, version) \
  __asm__(".symver " #symbol "," #symbol "@" DS_GLIBC_COMPAT_STR(version))

// glibc 2.29 gave pow, exp, log, exp2 and log2 a new version (GLIBC_2.29) without the wrapper
// that served the obsolete SVID error handling (matherr); the old version, still exported,
// calls the same implementation through that wrapper and returns the same values. Its version
// is the architecture's first glibc: 2.2.5 on x86_64, 2.17 on aarch64.
#if defined(__x86_64__)
#define DS_GLIBC_BASE_VERSION GLIBC_2.2.5
#elif defined(__aarch64__)
#define DS_GLIBC_BASE_VERSION GLIBC_2.17
#endif

#ifdef DS_GLIBC_BASE_VERSION
DS_BIND_SYMBOL_VERSION(pow, DS_GLIBC_BASE_VERSION);
DS_BIND_SYMBOL_VERSION(exp, DS_GLIBC_BASE_VERSION);
DS_BIND_SYMBOL_VERSION(log, DS_GLIBC_BASE_VERSION);
DS_BIND_SYMBOL_VERSION(exp2, DS_GLIBC_BASE_VERSION);
DS_BIND_SYMBOL_VERSION(log2, DS_GLIBC_BASE_VERSION);
#endif

#ifdef __cplusplus
// libstdc++ from gcc 11 on (with glibc 2.32 on) reads glibc's __libc_single_threaded
// (GLIBC_2.32) in its inline code, to skip atomic instructions for shared_ptr reference counts
// while a process has one thread. Each library gets its own hidden copy, so those reads bind
// inside it: 0 means "there may be threads", i.e. the counts are always atomic, which is correct
// in every process (it only forgoes that shortcut). Weak, because every translation unit of the
// library defines it.
extern "C" {
__attribute__((weak, visibility("hidden"))) char __libc_single_threaded = 0;
}

// gcc 12's libstdc++ re-versioned std::condition_variable::wait(unique_lock<mutex>&) as
// GLIBCXX_3.4.30 (it stopped being noexcept, so that thread cancellation can unwind through
// it); the GLIBCXX_3.4.11 version it keeps does the same wait. Nothing here cancels threads.
DS_BIND_SYMBOL_VERSION(_ZNSt18condition_variable4waitERSt11unique_lockISt5mutexE, GLIBCXX_3.4.11);
#endif  // __cplusplus

#endif  // __GLIBC__ && !__CUDA_ARCH__
