#!/usr/bin/env bash
# Build ampfuse CPU-only (AMPFUSE_CUDA=OFF) against one torch release and run Python suites with it.
#
#   tools/test_torch.sh TORCH_VERSION [pytest arguments...]
#
# TORCH_VERSION "dev" means the development virtualenv's torch (.venv); any other version gets a
# virtualenv of its own, cached as $AMPFUSE_CACHE/venv-torch<version>-<hash of
# requirements-matrix.txt>-py<XY> and created once with `pip install torch==<version>` and that
# file. The build goes to build-torch<version>/ (ccache: compiles repeat only when the sources
# change), the package is staged in build-torch<version>/python (the Python sources of this tree
# plus the library built for that torch), and pytest runs from there natively (no emulation).
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:?usage: tools/test_torch.sh TORCH_VERSION [pytest arguments...]}
shift
cache=${AMPFUSE_CACHE:-$HOME/.cache/ampfuse}
bootstrap=${PYTHON_BOOTSTRAP:-python3}
if [ "$version" = dev ]; then
  py=$PWD/.venv/bin/python
else
  key=$(sha256sum < requirements-matrix.txt | cut -c1-16)-$("$bootstrap" -c 'import sys;print("py%d%d" % sys.version_info[:2])')
  venv=$cache/venv-torch$version-$key
  if [ ! -e "$venv/.ampfuse-complete" ]; then
    echo "creating $venv"
    rm -rf "$venv"
    mkdir -p "$cache"
    "$bootstrap" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    "$venv/bin/python" -m pip install -q -r requirements-matrix.txt "torch==$version"
    touch "$venv/.ampfuse-complete"
  fi
  py=$venv/bin/python
fi
torch_version=$("$py" -c 'import torch; print(torch.__version__)')
build=build-torch$version
echo "== torch $torch_version: CPU-only build in $build"
if [ ! -f "$build/build.ninja" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DAMPFUSE_PYTHON="$py" -DAMPFUSE_CUDA=OFF \
    -DCMAKE_INSTALL_PREFIX="$PWD/$build/python/ampfuse" > "$build.configure.log" 2>&1 \
    || { cat "$build.configure.log"; exit 1; }
  rm -f "$build.configure.log"
fi
cmake --build "$build" -j "${MAX_JOBS:-$(nproc)}"
rm -rf "$build/python" && mkdir -p "$build/python"
tar -C python --exclude=ampfuse/lib --exclude=ampfuse/include --exclude=ampfuse/share --exclude=__pycache__ \
  -cf - ampfuse | tar -C "$build/python" -xf -
cmake --install "$build" > /dev/null
env -u AMPFUSE_CPU_KERNELS AMPFUSE_TEST_PACKAGE_DIR="$PWD/$build/python" PYTHONPATH="$PWD/$build/python" \
  "$py" -m pytest -q -p no:cacheprovider "$@"
