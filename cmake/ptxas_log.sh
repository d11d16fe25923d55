#!/bin/sh
# Compiler launcher of the CUDA objects in test builds (AMPFUSE_PTXAS_REPORT): runs the compile
# (through ccache when it is the next word, which replays the output on a cache hit) and keeps
# what ptxas reported (-Xptxas=-v: registers, stack frame, spill stores and loads of every kernel
# for every architecture) next to the object as <object>.ptxas.log, for tests/test_ptxas.py. Every
# other line of the compiler's output still reaches the build log.
out=""
prev=""
for a in "$@"; do
  [ "$prev" = "-o" ] && out=$a
  prev=$a
done
[ -n "$out" ] || exec "$@"
"$@" 2>"$out.ptxas.log"
rc=$?
grep -v -e '^ptxas info' -e '^ *[0-9]* bytes stack frame' "$out.ptxas.log" >&2
exit $rc
