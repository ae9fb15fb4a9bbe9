#!/usr/bin/env bash
# Issue 31's measurement on the lent 16-core GPU machine, one device command:
# RUNS cross-host runs of bench_store.py (kvpool beside Mooncake 0.3.13 tcp, flows
# steered with --rps), each run's JSON and log under $OUT (packed at the end), the
# target lines printed.
# Carry .xh (device_xhost_prepare.sh) and a folder of the py3.12 wheels (.whl, or
# .whlx with only msgspec and pyzmq when .xh plus .whl pass the 64 MiB carry limit;
# add py-spy there for device_xhost_grid.sh's --profile runs).
#   RUNS=3 bash scripts/device_xhost_runs.sh
# At the end it prints the medians over the runs (bench_store.py --medians) and packs
# everything it wrote into $OUT/xhost_runs.tgz (the device's reply brings back only a
# few files: unpacked, the later runs' records were left out).
set -uo pipefail
t0=$(date +%s)
[ -d .whl ] || { mkdir .whl && cp .whlx/*.whl .whl/; }
# shellcheck disable=SC1091
source .xh/env.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 3; }
echo "setup $(( $(date +%s) - t0 ))s"
for i in $(seq 1 "${RUNS:-3}"); do
  timeout "${RUN_TIMEOUT:-170}" python3 scripts/bench_store.py --cross-host --rps \
    --sizes "${SIZES:-4096,2097152,16777216}" --holder-memory 4GiB \
    --mooncake /tmp/mcvenv/bin/python --json "$OUT/xh_$i.json" ${EXTRA:-} > "$OUT/xh_$i.log" 2>&1
  echo "run $i rc=$? at $(( $(date +%s) - t0 ))s"
  grep -E "^target" "$OUT/xh_$i.log"
done
echo "== medians of the runs"
python3 scripts/bench_store.py --medians "$OUT"/xh_*.json
(cd "$OUT" && tar czf xhost_runs.tgz --remove-files setup.log xh_*)
