# The emulated CUDA kernel table (test builds, AMPFUSE_CUDA_EMULATION=ON).
#
# The unchanged csrc/cuda/*.cu files are compiled by the host C++ compiler with the emulator's
# shim (csrc/cuemu/include/cuemu/cuemu.h) force-included, and linked with the emulator runtime into
# libampfuse_cuemu.so. libampfuse loads it when AMPFUSE_CPU_KERNELS=cuda-emulated and runs CPU
# tensors through it. Only the toolkit's headers are needed (cuda_runtime.h, cuda_fp16.h,
# cuda_bf16.h); nothing links libcudart.
#
# Options: AMPFUSE_CUEMU_COVERAGE=ON compiles the kernels with --coverage (tools/cuda_coverage.sh).
option(AMPFUSE_CUEMU_COVERAGE "Instrument the emulated CUDA kernels for gcov" OFF)

if(NOT CUDAToolkit_INCLUDE_DIRS)
  find_package(CUDAToolkit QUIET)
endif()
find_path(AMPFUSE_CUDA_RUNTIME_INCLUDE cuda_runtime.h HINTS ${CUDAToolkit_INCLUDE_DIRS})
if(NOT AMPFUSE_CUDA_RUNTIME_INCLUDE)
  message(FATAL_ERROR "ampfuse: AMPFUSE_CUDA_EMULATION=ON needs the CUDA toolkit's headers "
                      "(cuda_runtime.h); none were found (set CUDAToolkit_ROOT).")
endif()

# Fibers: Boost.Context's fcontext when present (Debian libboost-context-dev; about 10x faster
# switches), else glibc's ucontext.
find_path(AMPFUSE_BOOST_CONTEXT_INCLUDE boost/context/detail/fcontext.hpp)
find_library(AMPFUSE_BOOST_CONTEXT_LIBRARY boost_context)
if(AMPFUSE_BOOST_CONTEXT_INCLUDE AND AMPFUSE_BOOST_CONTEXT_LIBRARY)
  set(_cuemu_fiber_defs CUEMU_FIBER_BOOST=1)
  set(_cuemu_fiber_libs "${AMPFUSE_BOOST_CONTEXT_LIBRARY}")
  message(STATUS "ampfuse: CUDA emulation with Boost.Context fibers")
else()
  set(_cuemu_fiber_defs CUEMU_FIBER_BOOST=0)
  set(_cuemu_fiber_libs "")
  message(STATUS "ampfuse: CUDA emulation with ucontext fibers (install libboost-context-dev for speed)")
endif()

set(_cuemu_shim "${PROJECT_SOURCE_DIR}/csrc/cuemu/include/cuemu/cuemu.h")
# Frame pointers: the emulator identifies barriers and warp collectives by their call path
# (runtime.cpp, call_chain), walking the frames of the fiber's stack.
set(_cuemu_flags -include "${_cuemu_shim}" -ffp-contract=off -fno-strict-aliasing
    -fno-omit-frame-pointer -Wall -Wno-unknown-pragmas -Wno-unused-function)

# Each .cu is compiled through a generated .cpp that includes it, so the sources stay as they are
# and gcov reports their own lines. The include is found through the target's csrc include
# directory, not by absolute path, so that the preprocessed text is the same in every checkout and
# ccache serves one clone's objects to another.
set(_cuemu_kernel_sources "")
foreach(_cu IN LISTS AMPFUSE_CUDA_KERNEL_SOURCES)
  get_filename_component(_name "${_cu}" NAME_WE)
  string(REGEX REPLACE "^csrc/" "" _cu_in_csrc "${_cu}")
  set(_wrapper "${CMAKE_CURRENT_BINARY_DIR}/cuemu/${_name}.cpp")
  file(GENERATE OUTPUT "${_wrapper}" CONTENT "#include \"${_cu_in_csrc}\"\n")
  list(APPEND _cuemu_kernel_sources "${_wrapper}")
endforeach()

# The emulator runtime, shared by the library and its self-test.
add_library(ampfuse_cuemu_runtime OBJECT csrc/cuemu/runtime.cpp)
target_include_directories(ampfuse_cuemu_runtime PRIVATE csrc/cuemu/include
                           "${AMPFUSE_CUDA_RUNTIME_INCLUDE}" ${AMPFUSE_BOOST_CONTEXT_INCLUDE})
target_compile_definitions(ampfuse_cuemu_runtime PRIVATE ${_cuemu_fiber_defs})
target_compile_options(ampfuse_cuemu_runtime PRIVATE -include "${_cuemu_shim}" -fno-omit-frame-pointer -Wall)
set_target_properties(ampfuse_cuemu_runtime PROPERTIES CXX_STANDARD 17 CXX_VISIBILITY_PRESET hidden)

add_library(ampfuse_cuemu SHARED ${_cuemu_kernel_sources} csrc/cuemu/export.cpp
            $<TARGET_OBJECTS:ampfuse_cuemu_runtime>)
target_include_directories(ampfuse_cuemu PRIVATE csrc csrc/cuemu/include "${AMPFUSE_CUDA_RUNTIME_INCLUDE}")
target_compile_options(ampfuse_cuemu PRIVATE ${_cuemu_flags})
target_link_options(ampfuse_cuemu PRIVATE "LINKER:-Bsymbolic" "LINKER:--no-undefined")
target_link_libraries(ampfuse_cuemu PRIVATE ${_cuemu_fiber_libs} pthread dl)
set_target_properties(ampfuse_cuemu PROPERTIES CXX_STANDARD 17 CXX_VISIBILITY_PRESET hidden
                      VISIBILITY_INLINES_HIDDEN ON)
if(AMPFUSE_CUEMU_COVERAGE)
  target_compile_options(ampfuse_cuemu PRIVATE --coverage -O0)
  target_link_options(ampfuse_cuemu PRIVATE --coverage)
endif()
install(TARGETS ampfuse_cuemu LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})

# The emulated CUDA device: a PrivateUse1 backend over host memory (renamed "cuemu" by
# ampfuse.testing.cuemu) whose tensors run torch's CPU kernels and ampfuse's CUDA kernel table
# under the emulator, counting every synchronizing call. Loaded by Python only, never by libampfuse.
add_library(ampfuse_cuemu_device SHARED csrc/cuemu/device.cpp)
target_include_directories(ampfuse_cuemu_device PRIVATE csrc)
target_compile_options(ampfuse_cuemu_device PRIVATE -Wall -Wextra -Wno-unused-parameter)
target_link_libraries(ampfuse_cuemu_device PRIVATE ampfuse torch)
set_target_properties(ampfuse_cuemu_device PROPERTIES INSTALL_RPATH "\$ORIGIN;\$ORIGIN/../../torch/lib")
install(TARGETS ampfuse_cuemu_device LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR})

# The emulator's own semantics (shuffles, votes, barriers, shared memory, atomics, error reports).
if(AMPFUSE_BUILD_TESTS)
  add_executable(cuemu_selftest tests/cuemu/selftest.cu $<TARGET_OBJECTS:ampfuse_cuemu_runtime>)
  set_source_files_properties(tests/cuemu/selftest.cu PROPERTIES LANGUAGE CXX)
  target_include_directories(cuemu_selftest PRIVATE csrc csrc/cuemu/include "${AMPFUSE_CUDA_RUNTIME_INCLUDE}")
  target_compile_options(cuemu_selftest PRIVATE -x c++ ${_cuemu_flags})
  target_link_libraries(cuemu_selftest PRIVATE ${_cuemu_fiber_libs} pthread dl)
  set_target_properties(cuemu_selftest PROPERTIES CXX_STANDARD 17 LINKER_LANGUAGE CXX)
  add_test(NAME cuemu_selftest COMMAND cuemu_selftest)
  set_tests_properties(cuemu_selftest PROPERTIES TIMEOUT 300)
endif()

# The same library built with AddressSanitizer and UndefinedBehaviorSanitizer, for
# `make test-sanitize` only (not part of `all`, not installed): an out-of-bounds or misaligned
# access of a kernel is reported at its source line. The runtime is compiled with it too, so its
# fiber switches are announced to ASan (CUEMU_ASAN). Loaded through AMPFUSE_CUEMU_LIBRARY by a
# python started with libasan preloaded.
set(_cuemu_sanitize_flags -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g)
add_library(ampfuse_cuemu_sanitized SHARED EXCLUDE_FROM_ALL ${_cuemu_kernel_sources} csrc/cuemu/export.cpp
            csrc/cuemu/runtime.cpp)
target_include_directories(ampfuse_cuemu_sanitized PRIVATE csrc csrc/cuemu/include "${AMPFUSE_CUDA_RUNTIME_INCLUDE}"
                           ${AMPFUSE_BOOST_CONTEXT_INCLUDE})
target_compile_definitions(ampfuse_cuemu_sanitized PRIVATE ${_cuemu_fiber_defs})
target_compile_options(ampfuse_cuemu_sanitized PRIVATE ${_cuemu_flags} ${_cuemu_sanitize_flags})
target_link_options(ampfuse_cuemu_sanitized PRIVATE -fsanitize=address,undefined "LINKER:-Bsymbolic")
target_link_libraries(ampfuse_cuemu_sanitized PRIVATE ${_cuemu_fiber_libs} pthread dl)
set_target_properties(ampfuse_cuemu_sanitized PROPERTIES CXX_STANDARD 17 CXX_VISIBILITY_PRESET hidden
                      VISIBILITY_INLINES_HIDDEN ON)
