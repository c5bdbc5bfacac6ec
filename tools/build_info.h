// What `eaglekit --version` prints: the version, the git commit the binaries were built from
// ("-dirty" when tracked files had changed), the LibTorch they link and the CUDA compiled in.
// Defined in the build folder's build_info.cpp, which cmake/build_info.cmake writes at every
// build (rewritten only when it changes).
#pragma once

namespace eaglekit::tools {
extern const char* const kBuildVersion;
extern const char* const kBuildGitCommit;
extern const char* const kBuildTorchVersion;
extern const char* const kBuildCudaVersion;  // nullptr: LibTorch without CUDA
}  // namespace eaglekit::tools
