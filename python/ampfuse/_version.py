# The one place ampfuse's version is written. CMakeLists.txt reads it (project VERSION, hence the
# CMake package's ampfuseConfigVersion.cmake and ampfuse_build.json), setup.py reads it (the
# wheel's and sdist's version; binary wheels add a local label naming their torch build, e.g.
# 0.1.0+torch2.14cu130) and ampfuse.__version__ is it. Plain literal: read by regex, not imported.
__version__ = "0.1.0"
