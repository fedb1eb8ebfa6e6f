#!/usr/bin/env bash
# On the GPU machine: bench/gpu/eager_probe.py over the current sources and, for a bisect, over
# older source trees carried under .gl/NAME/src (TREES="old pre post"). Logs go to $OUT.
#   OUT=/some/dir VARIANTS=base,pin WORKLOADS=resnet50:32 TREES="old" bash bench/gpu/run_probe.sh
set -u
OUT=${OUT:?set OUT to a directory for the results}
VARIANTS=${VARIANTS:-local,base,pin,spin,nopoll,flush10,noflusher}
WORKLOADS=${WORKLOADS:-resnet50:32,gpt2:8}
TREE_VARIANTS=${TREE_VARIANTS:-base}
if [ -d .whl/extra ]; then python3 -m pip install -q --no-index --find-links .whl/extra --target /tmp/tools py-spy > "$OUT/pip_extra.log" 2>&1; export PATH=/tmp/tools/bin:$PATH; fi
. bench/gpu/site.sh
HEAD_PATH=$PYTHONPATH
nproc > "$OUT/probe.log"; lscpu | grep -E "Thread|Core|Socket|Model name|NUMA node" >> "$OUT/probe.log"; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader >> "$OUT/probe.log"
PROBE_TAG=head_ PYTHONPATH=$HEAD_PATH timeout -k 5 ${LIMIT:-400} python3 bench/gpu/eager_probe.py --variants "$VARIANTS" \
  --workloads "$WORKLOADS" --steps ${STEPS:-20} 2>> "$OUT/probe.err" | sed 's/^/head: /' >> "$OUT/probe.log"
for tree in ${TREES:-}; do
  PROBE_TAG=${tree}_ PYTHONPATH=${HEAD_PATH/$PWD\/src/$PWD/.gl/$tree/src} timeout -k 5 200 python3 bench/gpu/eager_probe.py --variants "$TREE_VARIANTS" \
    --workloads "${TREE_WORKLOADS:-$WORKLOADS}" --steps ${STEPS:-20} 2>> "$OUT/probe.err" | sed "s/^/$tree: /" >> "$OUT/probe.log"
done
cat "$OUT/probe.log" | cut -c1-700
tail -5 "$OUT/probe.err"
exit 0
