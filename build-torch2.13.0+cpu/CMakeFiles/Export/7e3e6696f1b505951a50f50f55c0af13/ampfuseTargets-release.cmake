#----------------------------------------------------------------
# Generated CMake target import file for configuration "Release".
#----------------------------------------------------------------

# Commands may need to know the format version.
set(CMAKE_IMPORT_FILE_VERSION 1)

# Import target "ampfuse::ampfuse" for configuration "Release"
set_property(TARGET ampfuse::ampfuse APPEND PROPERTY IMPORTED_CONFIGURATIONS RELEASE)
set_target_properties(ampfuse::ampfuse PROPERTIES
  IMPORTED_LOCATION_RELEASE "${_IMPORT_PREFIX}/lib/libampfuse.so"
  IMPORTED_SONAME_RELEASE "libampfuse.so"
  )

list(APPEND _cmake_import_check_targets ampfuse::ampfuse )
list(APPEND _cmake_import_check_files_for_ampfuse::ampfuse "${_IMPORT_PREFIX}/lib/libampfuse.so" )

# Commands beyond this point should not need to know the version.
set(CMAKE_IMPORT_FILE_VERSION)
