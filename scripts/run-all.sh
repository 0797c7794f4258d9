#!/usr/bin/env bash
# Runs the given Conveyor binaries side by side, prefixing their output with
# their name, until Ctrl-C; then stops them all with SIGTERM.
set -uo pipefail
pids=()
stop() {
  trap - INT TERM
  echo "stopping..." >&2
  kill -TERM "${pids[@]}" 2>/dev/null
  wait
  exit 0
}
trap stop INT TERM
# The binaries never create a database on their own (a mistyped DATABASE_URL
# must fail): `api migrate` creates it if it is missing and migrates it.
# Every request needs a key: make an admin key of the org CONVEYOR_ORG
# (default "local") and keep it in .conveyor-key, for the README's examples.
# API_ADDR may name a host (127.0.0.1:8080) or only a port (:8080).
api_addr=${API_ADDR:-:8080}
case $api_addr in
  :*) api_url="http://localhost$api_addr" ;;
  *) api_url="http://$api_addr" ;;
esac
key=""
for bin in "$@"; do
  if [ "$(basename "$bin")" = api ]; then
    # Another process on API_ADDR (a second `make run`, one left over)
    # would answer the /readyz below in place of this API, which then
    # fails to listen: stop here rather than report a pipeline that is not
    # there. curl's 7 is a refused connection: the address is free.
    curl -s -o /dev/null --noproxy "*" --max-time 2 "$api_url/readyz" 2>/dev/null
    case $? in
      0 | 8 | 28 | 52 | 56)
        echo "$api_url is already in use (another make run?): stop that process or set API_ADDR" >&2
        exit 1
        ;;
    esac
    "$bin" migrate 2>&1 | sed -u "s/^/[migrate] /" || { echo "api migrate failed" >&2; exit 1; }
    key=$("$bin" bootstrap --org "${CONVEYOR_ORG:-local}" --name "make run" 2> >(sed -u "s/^/[bootstrap] /" >&2)) ||
      { echo "api bootstrap failed" >&2; exit 1; }
    (umask 077 && echo "$key" > .conveyor-key)
  fi
done
for bin in "$@"; do
  [ -x "$bin" ] || continue
  name=$(basename "$bin")
  # The binary itself runs in the background (its output goes through sed
  # by a process substitution), so $! is its pid and stop() reaches it.
  # sed ignores Ctrl-C's SIGINT (sent to the whole process group) and
  # SIGTERM, and ends when the binary closes its output: a sed killed first
  # left the binary logging its shutdown into a closed pipe, and a Go
  # binary dies of SIGPIPE there, before a worker has handed its tasks back.
  "$bin" > >(trap '' INT TERM; exec sed -u "s/^/[$name] /") 2>&1 &
  pids+=($!)
  # The API migrates the database; give it a head start so the others find
  # the schema ready. An API that exits meanwhile (its port taken, a bad
  # variable) ends the run here, before the others start and before the
  # banner below says the pipeline is running.
  if [ "$name" = api ]; then
    api_pid=$!
    for _ in $(seq 1 50); do
      curl -fsS --max-time 2 "$api_url/readyz" >/dev/null 2>&1 && break
      kill -0 "$api_pid" 2>/dev/null || break
      sleep 0.2
    done
    if ! kill -0 "$api_pid" 2>/dev/null; then
      wait "$api_pid"
      rc=$?
      trap - INT TERM
      echo "api exited (status $rc) before it was ready; see its log above" >&2
      kill -TERM "${pids[@]}" 2>/dev/null
      wait
      exit $((rc == 0 ? 1 : rc))
    fi
  fi
done
echo "conveyor running: API on $api_url — Ctrl-C to stop" >&2
if [ -n "$key" ]; then
  echo "admin key of org ${CONVEYOR_ORG:-local} (also in .conveyor-key):" >&2
  echo "  export CONVEYOR_KEY=$key" >&2
  # bin/conveyor looks for the API at http://localhost:8080 unless told.
  if [ "$api_url" != "http://localhost:8080" ]; then
    echo "  export CONVEYOR_URL=$api_url" >&2
  fi
fi
if ((BASH_VERSINFO[0] >= 5)); then
  # A service that exits (a crash, a lost database it will not wait for)
  # stops the others: a pipeline missing one part must not look running.
  wait -n "${pids[@]}"
  rc=$?
  trap - INT TERM
  echo "a service exited (status $rc); stopping the others" >&2
  kill -TERM "${pids[@]}" 2>/dev/null
  wait
  exit $((rc == 0 ? 1 : rc))
fi
wait
