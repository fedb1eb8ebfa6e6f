#!/usr/bin/env bash
# On the GPU machine (nvidia-h200-x2): ResNet-50 training migrated from GPU 0 to GPU 1 mid-run,
# then swapped out when idle and restored; ~5 GiB of state. Every log straight into $OUT (no
# pipes, so a worker left behind cannot hold a pipe open).
set -u
python3 -m pip install -q --no-index --find-links .whl --target /tmp/site -r .whl/requirements.txt > "$OUT/pip.log" 2>&1 || exit 1
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
cp bench/results/migration.json "$OUT/migration.json" 2>/dev/null || true
timeout -k 5 240 python3 bench/migration.py --state-gib 5 --steps 40 --migrate-at 10 --batch 64 --out "$OUT/migration.json" > "$OUT/migration_5g.log" 2>&1
echo "migration 5GiB rc=$?" >> "$OUT/migration_5g.log"
pkill -9 -f "gpupool.worker --lease bench-migration"
timeout -k 5 200 python3 bench/migration.py --state-gib 1 --steps 30 --migrate-at 10 --batch 64 --out "$OUT/migration.json" > "$OUT/migration_1g.log" 2>&1
echo "migration 1GiB rc=$?" >> "$OUT/migration_1g.log"
pkill -9 -f "gpupool.worker --lease bench-migration"
exit 0
