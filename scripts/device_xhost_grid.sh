#!/usr/bin/env bash
# Issue 31's configuration grid on the lent 16-core GPU machine, one device command:
# cross-host bench_store.py runs (kvpool only, flows steered with --rps) of several
# client / master / holder configurations, each run's JSON and log under $OUT (packed
# at the end), then each record's line and what its calls cost (master RPCs,
# transfers). Carry .xh and
# .whlx as for device_xhost_runs.sh. GRID picks runs by name (default: all):
#   GRID="default spin stripes2m threads4" bash scripts/device_xhost_grid.sh
# (nostripe, profile16 and profile4k run only when named). Everything it writes is
# packed into $OUT/xhost_grid.tgz at the end (the device's reply brings back only a
# few files).
set -uo pipefail
t0=$(date +%s)
[ -d .whl ] || { mkdir .whl && cp .whlx/*.whl .whl/; }
# shellcheck disable=SC1091
source .xh/env.sh > "$OUT/setup.log" 2>&1 || { cat "$OUT/setup.log"; exit 3; }
export PATH="/tmp/site/bin:$PATH"  # py-spy (--profile), from the carried wheels
B=(python3 scripts/bench_store.py --cross-host --rps --holder-memory 4GiB
   --limit-seconds 1.5 --bytes-per-op "${BYTES_PER_OP:-512MiB}")
run() {  # name, then bench_store.py arguments
  local name=$1; shift
  case " ${GRID:-default spin stripes2m threads4 threads16} " in *" $name "*) ;; *) return;; esac
  timeout "${RUN_TIMEOUT:-200}" "${B[@]}" "$@" --json "$OUT/grid_$name.json" \
    > "$OUT/grid_$name.log" 2>&1
  echo "== $name rc=$? at $(( $(date +%s) - t0 ))s"
  grep -E "^  (tcp|socket|iperf3)|per call" "$OUT/grid_$name.log"
}
run default --sizes 4096,2097152,16777216 --ops put,put_from,batch_put_from \
  --streams 4,8 --stripes 4,8
run spin --sizes 4096,16777216 --ops put,put_from,batch_put_from --no-limits \
  --master-arg=--rpc-spin-us=2000 --holder-transfer '{"server": {"bulk_spin_us": 500}}'
run stripes2m --sizes 16777216 --ops put_from --no-limits \
  --tcp-options '{"stripe_bytes": 2097152}'
run threads4 --sizes 2097152 --ops batch_put_from --no-limits --tcp-threads 4
run threads16 --sizes 2097152,16777216 --ops put_from,batch_put_from --no-limits \
  --tcp-threads 16 --tcp-options '{"stripe_bytes": 1048576}'
# opt-in (name them in GRID): where a lone 16 MiB call's transfer phase goes,
# against one plain stream (unstriped) and under py-spy (every process, waits too)
run nostripe --sizes 16777216 --ops put_from,get_into --streams 1 --stripes 4 \
  --tcp-options '{"stripe_bytes": 67108864}'
run profile16 --sizes 16777216 --ops put_from,get_into --no-limits \
  --profile "$OUT/prof16" --profile-idle --profile-rate 997
# opt-in: where the 4 KiB calls' CPU goes in each process (no waits sampled)
run profile4k --sizes 4096 --ops put_from,get_into,batch_put_from,batch_get_into --no-limits \
  --profile "$OUT/prof4k" --profile-rate 997
(cd "$OUT" && tar czf xhost_grid.tgz --remove-files setup.log grid_* $(ls -d prof16 prof4k 2>/dev/null))
