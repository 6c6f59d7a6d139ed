#!/bin/bash
# On the GPU machine: join the GGUF parts that earlier calls copied into /root/models/NAME/
# (`split -b 55m -d -a 2 FILE part` here: a 60 MiB part plus the ~7 MiB working tree exceeds the 64 MiB a
# call carries; one part per call, docs/gpu-notes.md) into
# /root/models/NAME.gguf, print its sha256 and convert it into $SPECSERVE_HOME (default /root/ss):
# a file whose sha256 is a catalog model's becomes that catalog name (specserve.hub.resolve_model).
# Writes /root/models/NAME.done when the conversion finished (NAME.failed when a step failed), so a
# later call can wait for a conversion started in the background:
#   nohup bash benchmarks/gpu/assemble_gguf.sh q15 > /root/asm_q15.log 2>&1 &
# Two models can travel as one stream (cat A.gguf B.gguf | split ...: fewer calls than one split each);
# SRC names the stream's folder and SKIP/SIZE the model's bytes in it:
#   SRC=all SIZE=491400064 bash assemble_gguf.sh q05; SRC=all SKIP=491400064 SIZE=1117320768 bash assemble_gguf.sh q15
set -e -o pipefail
NAME=$1
REPO=$(cd "$(dirname "$0")/../.." && pwd)
export PYTHONPATH=/root/site:$REPO SPECSERVE_HOME=${SPECSERVE_HOME:-/root/ss}
cd /root/models
rm -f "$NAME.done" "$NAME.failed"
[ -n "$SKIP" ] && [ -z "$SIZE" ] && { echo "SKIP needs SIZE (the model's bytes in the stream)"; touch "$NAME.failed"; exit 1; }
trap 'touch "/root/models/$NAME.failed"' ERR
if [ -n "$SIZE" ]; then
  # head stops reading early, which SIGPIPEs tail and cat: the size check below is the test, not pipefail
  (set +o pipefail; cat "${SRC:-$NAME}"/part?? | tail -c +$(( ${SKIP:-0} + 1 )) | head -c "$SIZE") > "$NAME.gguf"
  [ "$(stat -c %s "$NAME.gguf")" = "$SIZE" ]
else
  cat "${SRC:-$NAME}"/part?? > "$NAME.gguf"
fi
sha256sum "$NAME.gguf"
python3 -c "import sys; from specserve.hub import resolve_model; print(resolve_model(sys.argv[1]))" "/root/models/$NAME.gguf"
touch "$NAME.done"
