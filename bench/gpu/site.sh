# Sourced by the bench/gpu scripts: install the wheels carried in .whl (the GPU machine has no
# internet) into /tmp/site and put them and src/ on PYTHONPATH. Needs OUT set (pip's log).
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt > "$OUT/pip.log" 2>&1 || exit 1
  export PYTHONPATH=/tmp/site:$PWD/src
else
  export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
# The client's and the worker's compiled paths, built for this machine's Python (gpupool runs
# from src/).
python3 setup.py -q build_ext --inplace > "$OUT/build_ext.log" 2>&1 \
  || echo "the compiled paths did not build (see build_ext.log): Python paths" >&2
