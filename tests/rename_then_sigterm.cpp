// Fault injector for one test, loaded with LD_PRELOAD into preprocess_data: after a rename onto a
// name ending in ".bin" succeeds, it sends its own process SIGTERM. That is a signal arriving in
// the moment between IndexedDatasetWriter::finish's two renames, which no timing can hit reliably.
#include <dlfcn.h>
#include <signal.h>
#include <unistd.h>

#include <cstring>

extern "C" int rename(const char* from, const char* to) {
  using RenameFunction = int (*)(const char*, const char*);
  static const auto real_rename = reinterpret_cast<RenameFunction>(dlsym(RTLD_NEXT, "rename"));
  const int result = real_rename(from, to);
  const size_t length = std::strlen(to);
  if (result == 0 && length >= 4 && std::strcmp(to + length - 4, ".bin") == 0) kill(getpid(), SIGTERM);
  return result;
}
