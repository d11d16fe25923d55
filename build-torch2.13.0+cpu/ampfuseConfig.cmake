# ampfuse CMake package: find_package(ampfuse) provides the imported target ampfuse::ampfuse,
# which carries torch's include paths and compile flags (find_package(Torch) must succeed, e.g.
# with CMAKE_PREFIX_PATH including torch.utils.cmake_prefix_path and ampfuse.cmake_prefix_path).

####### Expanded from @PACKAGE_INIT@ by configure_package_config_file() #######
####### Any changes to this file will be overwritten by the next CMake run ####
####### The input file was ampfuseConfig.cmake.in                            ########

get_filename_component(PACKAGE_PREFIX_DIR "${CMAKE_CURRENT_LIST_DIR}/../../../" ABSOLUTE)

macro(set_and_check _var _file)
  set(${_var} "${_file}")
  if(NOT EXISTS "${_file}")
    message(FATAL_ERROR "File or directory ${_file} referenced by variable ${_var} does not exist !")
  endif()
endmacro()

macro(check_required_components _NAME)
  foreach(comp ${${_NAME}_FIND_COMPONENTS})
    if(NOT ${_NAME}_${comp}_FOUND)
      if(${_NAME}_FIND_REQUIRED_${comp})
        set(${_NAME}_FOUND FALSE)
      endif()
    endif()
  endforeach()
endmacro()

####################################################################################

include(CMakeFindDependencyMacro)
if(NOT TARGET torch)
  find_dependency(Torch)
endif()

include("${CMAKE_CURRENT_LIST_DIR}/ampfuseTargets.cmake")
set(ampfuse_WITH_CUDA OFF)

# libampfuse needs libraries that an application linking torch does not necessarily load itself
# (torch's bundled libgomp, and for a CUDA build c10_cuda and cudart). The installed libampfuse
# only knows torch's location relative to a pip install ($ORIGIN/../../torch/lib), and the
# dynamic loader resolves an indirect dependency through the library's own RUNPATH, not the
# application's. So the application lists them itself (kept by --no-as-needed, as torch does for
# its own libraries): they are loaded from torch's installation before libampfuse asks for them.
if(UNIX AND NOT APPLE)
  set(_ampfuse_runtime_deps "")
  if(ON)
    list(APPEND _ampfuse_runtime_deps "$<TARGET_FILE_DIR:torch>/libgomp.so.1")
  endif()
  if(ampfuse_WITH_CUDA)
    if(TARGET c10_cuda)
      list(APPEND _ampfuse_runtime_deps "$<TARGET_FILE:c10_cuda>")
    endif()
    if(TARGET CUDA::cudart)
      list(APPEND _ampfuse_runtime_deps "$<TARGET_FILE:CUDA::cudart>")
    endif()
  endif()
  foreach(_ampfuse_dep IN LISTS _ampfuse_runtime_deps)
    set_property(TARGET ampfuse::ampfuse APPEND PROPERTY INTERFACE_LINK_LIBRARIES
      "-Wl,--no-as-needed,\"${_ampfuse_dep}\",--as-needed")
  endforeach()
  unset(_ampfuse_dep)
  unset(_ampfuse_runtime_deps)
endif()

check_required_components(ampfuse)
