# Consumer test (run by ctest with cmake -P): install ampfuse into a staging prefix, move the
# prefix elsewhere (the package must be relocatable), then configure, build and run examples/cpp
# out of tree with nothing but find_package(Torch) and find_package(ampfuse). Each ```cpp block of
# the manual's pages (DOC_PAGES) is compiled in the same project as a translation unit of its own,
# so a snippet that no longer compiles against the installed headers fails this test.
#
# Variables: AMPFUSE_BUILD_DIR, EXAMPLE_DIR, WORK_DIR, TORCH_PREFIX (torch.utils.cmake_prefix_path),
# CXX_COMPILER, GENERATOR; optional CUDA_TOOLKIT_ROOT (for a CUDA build of torch), LAUNCHER,
# DOC_PAGES (a list of markdown files).
cmake_minimum_required(VERSION 3.18)
foreach(var AMPFUSE_BUILD_DIR EXAMPLE_DIR WORK_DIR TORCH_PREFIX CXX_COMPILER GENERATOR)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "consumer_test.cmake: ${var} is not set.")
  endif()
endforeach()

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: ${what} failed (${rc}):\n${out}\n${err}")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

# 1. Install, then relocate.
run_step("cmake --install" "${CMAKE_COMMAND}" --install "${AMPFUSE_BUILD_DIR}" --prefix "${WORK_DIR}/staging")
file(RENAME "${WORK_DIR}/staging" "${WORK_DIR}/prefix")
foreach(required include/ampfuse/ampfuse.h include/ampfuse/grad_scaler.h include/ampfuse/optim.h
                 include/ampfuse/accumulation.h include/ampfuse/ops.h lib/libampfuse.so
                 share/cmake/ampfuse/ampfuseConfig.cmake share/cmake/ampfuse/ampfuseTargets.cmake)
  if(NOT EXISTS "${WORK_DIR}/prefix/${required}")
    message(FATAL_ERROR "consumer test: the installed package lacks ${required}.")
  endif()
endforeach()
file(GLOB package_files "${WORK_DIR}/prefix/share/cmake/ampfuse/*.cmake")
foreach(f IN LISTS package_files)
  file(READ "${f}" content)
  foreach(forbidden "${WORK_DIR}/staging" "${AMPFUSE_BUILD_DIR}")
    string(FIND "${content}" "${forbidden}" pos)
    if(NOT pos EQUAL -1)
      message(FATAL_ERROR "consumer test: ${f} contains the absolute path ${forbidden}; the package is not relocatable.")
    endif()
  endforeach()
endforeach()

# 2. The manual's C++ snippets, one file each, added to the example's project by a project include.
set(snippet_sources "")
foreach(page IN LISTS DOC_PAGES)
  file(READ "${page}" text)
  set(found FALSE)
  # (string(FIND) walks the text: a list of blocks would split the code at its semicolons.)
  while(TRUE)
    string(FIND "${text}" "```cpp\n" start)
    if(start EQUAL -1)
      break()
    endif()
    math(EXPR start "${start} + 7")
    string(SUBSTRING "${text}" ${start} -1 text)
    string(FIND "${text}" "```" end)
    string(SUBSTRING "${text}" 0 ${end} code)
    string(SUBSTRING "${text}" ${end} -1 text)
    list(LENGTH snippet_sources k)
    set(src "${WORK_DIR}/snippets/snippet_${k}.cpp")
    file(WRITE "${src}" "// from ${page}\n${code}")
    list(APPEND snippet_sources "${src}")
    set(found TRUE)
  endwhile()
  if(NOT found)
    message(FATAL_ERROR "consumer test: ${page} has no ```cpp block to compile.")
  endif()
endforeach()
set(snippet_include "${WORK_DIR}/snippets/snippets.cmake")
file(WRITE "${snippet_include}" "")
if(snippet_sources)
  file(WRITE "${snippet_include}" "add_library(ampfuse_doc_snippets OBJECT ${snippet_sources})\n"
       "target_link_libraries(ampfuse_doc_snippets PRIVATE ampfuse::ampfuse)\n")
endif()

# 3. Configure and build the example (and the snippets) against the relocated package.
if(NOT DEFINED ENV{TORCH_CUDA_ARCH_LIST})
  set(ENV{TORCH_CUDA_ARCH_LIST} "8.0 9.0")  # keeps torch's config from probing for a GPU
endif()
set(configure_args -S "${EXAMPLE_DIR}" -B "${WORK_DIR}/build" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=Release"
    "-DCMAKE_PREFIX_PATH=${TORCH_PREFIX}\;${WORK_DIR}/prefix" "-DCMAKE_PROJECT_INCLUDE=${snippet_include}")
if(CUDA_TOOLKIT_ROOT)
  list(APPEND configure_args "-DCUDA_TOOLKIT_ROOT_DIR=${CUDA_TOOLKIT_ROOT}")
endif()
if(LAUNCHER)
  list(APPEND configure_args "-DCMAKE_CXX_COMPILER_LAUNCHER=${LAUNCHER}")
endif()
# (execute_process directly: a function's ARGN would split the escaped ';' of the prefix path.)
execute_process(COMMAND "${CMAKE_COMMAND}" ${configure_args}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "consumer test: configuring examples/cpp failed (${rc}):\n${out}\n${err}")
endif()
run_step("building examples/cpp" "${CMAKE_COMMAND}" --build "${WORK_DIR}/build")

# 4. Run it: it trains, checks its own convergence and skip count, and prints OK.
run_step("running train_mlp" "${WORK_DIR}/build/train_mlp")
message("${step_output}")
if(NOT step_output MATCHES "\nOK\n?$")
  message(FATAL_ERROR "consumer test: train_mlp did not report OK.")
endif()
# The application links the relocated libampfuse (the ops were registered from it).
file(GET_RUNTIME_DEPENDENCIES EXECUTABLES "${WORK_DIR}/build/train_mlp"
     RESOLVED_DEPENDENCIES_VAR resolved UNRESOLVED_DEPENDENCIES_VAR unresolved
     DIRECTORIES "${WORK_DIR}/prefix/lib"
     PRE_INCLUDE_REGEXES "libampfuse" PRE_EXCLUDE_REGEXES ".*")
list(FILTER resolved INCLUDE REGEX "libampfuse")
if(NOT resolved MATCHES "^${WORK_DIR}/prefix/lib/libampfuse.so$")
  message(FATAL_ERROR "consumer test: train_mlp does not load the installed libampfuse (${resolved}).")
endif()
