#!/usr/bin/env bash
# What a task's two status changes (the claim, then the completion) cost
# PostgreSQL's CPU, for the tasks table as the migrations make it and for
# narrow tables of the lifecycle's columns with different sets of indexes.
# It answers two questions: where the claim's and the completion's cost
# goes — the row's width or the index entries each status change writes —
# and what a claim fused with its completion would save (the row locked
# while the handler runs, then one update and one commit).
#
# Each configuration is filled with 50,000 pending tasks, then a loop in
# one backend claims and completes them in batches of 100, a commit after
# each statement, as a busy worker does. The figure is that backend's CPU
# (utime + stime, read from /proc through pg_read_file) per task, so
# PostgreSQL must run on this machine and the role be a superuser. The
# events, results and outbox rows a real claim and completion also write
# are left out: they are the same in every configuration.
#
# Usage: bench/index-costs.sh [rounds [pattern]]   (default 5 rounds;
# configurations alternate within each round, and the median of each is
# printed; with a pattern, only the configurations whose name matches it,
# as grep -E reads it, e.g. '^tasks')
# Environment: BENCH_DATABASE_URL, the server's admin URL (default
# postgres://postgres@localhost:5432/postgres?sslmode=disable).
set -euo pipefail

rounds=${1:-5}
pattern=${2:-}
admin=${BENCH_DATABASE_URL:-postgres://postgres@localhost:5432/postgres?sslmode=disable}
db=conveyor_index_costs
url=${admin/\/postgres\?/\/$db?}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"; psql -q "$admin" -c "DROP DATABASE IF EXISTS $db" >/dev/null 2>&1 || true' EXIT

psql -q "$admin" -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db"
(cd "$root" && DATABASE_URL=$url go run ./cmd/api migrate >/dev/null)

hz=$(getconf CLK_TCK)
q() { psql -X -q -v ON_ERROR_STOP=1 "$url" "$@"; }

# The lifecycle's columns: every column a status change writes or an index
# keyed on status reads.
narrow_table='CREATE TABLE narrow (
	id uuid PRIMARY KEY, org_id uuid NOT NULL, type text NOT NULL, status text NOT NULL DEFAULT '\''PENDING'\'',
	state text NOT NULL DEFAULT '\''Queued'\'', progress smallint NOT NULL DEFAULT 0,
	priority smallint NOT NULL DEFAULT 5, attempt int NOT NULL DEFAULT 0, version int NOT NULL DEFAULT 1,
	worker_id text, lease_expires_at timestamptz, heartbeat_at timestamptz,
	next_run_at timestamptz NOT NULL DEFAULT now(), started_at timestamptz, completed_at timestamptz,
	updated_at timestamptz NOT NULL DEFAULT now(), cancel_requested_at timestamptz, error text,
	admitted boolean NOT NULL DEFAULT true, concurrency_key text NOT NULL DEFAULT '\'''\'', job_id uuid,
	run_id uuid, parent_id uuid, visibility text[] NOT NULL DEFAULT '\''{}'\'', traceparent text
) WITH (fillfactor = 50)'

# The indexes of tasks whose key or predicate reads status, as the
# migrations define them. A task with no job, workflow run or parent, as a
# burn-down's are, gets an entry in four of them at its two status changes:
# admitted, org_status and running at the claim, org_status and
# terminal_completed at the completion.
declare -A index=(
	[admitted]="(type, org_id, concurrency_key) WHERE admitted AND status IN ('PENDING', 'IN_PROGRESS')"
	[org_status]="(org_id, status, completed_at) INCLUDE (visibility)"
	[running]="(id) WHERE status = 'IN_PROGRESS'"
	[terminal_completed]="(completed_at) WHERE status IN ('COMPLETED', 'FAILED', 'CANCELLED')"
	[admitted_job]="(job_id, concurrency_key) WHERE job_id IS NOT NULL AND admitted AND status IN ('PENDING', 'IN_PROGRESS')"
	[awaiting]="(id) WHERE status = 'PENDING' AND state = 'Waiting for children'"
	[child_open]="(parent_id) WHERE parent_id IS NOT NULL AND status IN ('PENDING', 'IN_PROGRESS')"
	[pending_next_run]="(next_run_at) WHERE status = 'PENDING'"
	[ready]="(type, next_run_at, id) WHERE status = 'PENDING' AND admitted"
	[run_open]="(run_id) WHERE run_id IS NOT NULL AND status IN ('PENDING', 'IN_PROGRESS')"
	[waiting]="(type, org_id, concurrency_key, priority DESC, id) WHERE status = 'PENDING' AND NOT admitted"
)
entries="admitted org_status running terminal_completed"
others="admitted_job awaiting child_open pending_next_run ready run_open waiting"

# The three indexes migration 014 narrowed, as they were before it: the
# claim wrote an entry in each.
before_014=(
	"DROP INDEX tasks_org_status, tasks_admitted, tasks_running"
	"CREATE INDEX tasks_org_status ON tasks ${index[org_status]}"
	"CREATE INDEX tasks_admitted ON tasks ${index[admitted]}"
	"CREATE INDEX tasks_running ON tasks ${index[running]}"
)
after_014=(
	"DROP INDEX tasks_org_status, tasks_admitted, tasks_running"
	"CREATE INDEX tasks_org_status ON tasks (org_id, status, completed_at) INCLUDE (visibility)
		WHERE status IN ('PENDING', 'COMPLETED', 'FAILED', 'CANCELLED')"
	"CREATE INDEX tasks_admitted ON tasks (type, org_id, concurrency_key) WHERE admitted AND status = 'PENDING'"
	"CREATE INDEX tasks_running ON tasks (org_id, type) WHERE status = 'IN_PROGRESS'"
)

# configurations: name, then the narrow table's indexes beside its primary
# key and the pending index the claim reads ("tasks" is the real table).
configs=(
	"tasks"
	"tasks, claim and completion fused"
	"tasks, its indexes as before migration 014"
	"narrow, every index of tasks on status:$entries $others"
	"narrow, the four a task's status changes meet:$entries"
	"narrow, those four but admitted:org_status running terminal_completed"
	"narrow, those four but org_status:admitted running terminal_completed"
	"narrow, those four but running:admitted org_status terminal_completed"
	"narrow, those four but terminal_completed:admitted org_status running"
	"narrow, the seven a task's status changes do not meet:$others"
	"narrow, no other index:"
)

fill() {
	local table=$1
	if [ "$table" = tasks ]; then
		q -c "TRUNCATE tasks CASCADE" -c "TRUNCATE task_listing" 2>/dev/null
		q -c "INSERT INTO tasks (id, type, org_id, payload, metadata, input_hash, traceparent)
			SELECT gen_random_uuid(), 'demo.noop', '0190a4b2-0000-7000-8000-000000000001', '{\"n\": 1}', '{}',
				md5(g::text) || md5((g + 1)::text), '00-' || md5(g::text) || '-' || left(md5((g * 7)::text), 16) || '-01'
			FROM generate_series(1, 50000) g"
	else
		q -c "INSERT INTO narrow (id, org_id, type, traceparent)
			SELECT gen_random_uuid(), '0190a4b2-0000-7000-8000-000000000001', 'demo.noop',
				'00-' || md5(g::text) || '-' || left(md5((g * 7)::text), 16) || '-01'
			FROM generate_series(1, 50000) g"
	fi
	q -c "VACUUM ANALYZE $table"
}

# The status changes as the worker writes them: the claim, a commit, the
# completion, a commit.
two_steps() {
	local table=$1
	cat <<SQL
		UPDATE $table SET status = 'IN_PROGRESS', state = 'Running', attempt = attempt + 1, version = version + 1,
			worker_id = 'worker-7f3a9c-12', lease_expires_at = now() + interval '30 s', started_at = now(),
			heartbeat_at = now(), updated_at = now()
		WHERE id = ANY (ids) AND status = 'PENDING';
		COMMIT;
		UPDATE $table SET status = 'COMPLETED', state = 'Completed', progress = 100, version = version + 1,
			lease_expires_at = NULL, heartbeat_at = NULL, completed_at = now(), updated_at = now()
		WHERE id = ANY (ids) AND status = 'IN_PROGRESS';
		COMMIT;
SQL
}

# A claim and completion fused: the rows locked, the handler run while the
# lock is held, and one update from PENDING to COMPLETED, one commit (a
# design the worker does not have; "Thirty-second round").
fused() {
	local table=$1
	cat <<SQL
		PERFORM 1 FROM $table WHERE id = ANY (ids) AND status = 'PENDING' ORDER BY id FOR UPDATE;
		UPDATE $table SET status = 'COMPLETED', state = 'Completed', progress = 100, version = version + 2,
			attempt = attempt + 1, worker_id = 'worker-7f3a9c-12', started_at = now(),
			lease_expires_at = NULL, heartbeat_at = NULL, completed_at = now(), updated_at = now()
		WHERE id = ANY (ids) AND status = 'PENDING';
		COMMIT;
SQL
}

# loop claims and completes every pending task of table, in batches of 100,
# with steps (two_steps or fused), and prints the backend's CPU per task.
loop() {
	local table=$1 steps=${2:-two_steps}
	q -At <<SQL
CREATE FUNCTION pg_temp.cpu() RETURNS bigint LANGUAGE sql AS \$f\$
	SELECT split_part(s, ' ', 14)::bigint + split_part(s, ' ', 15)::bigint
	FROM pg_read_file('/proc/' || pg_backend_pid() || '/stat') AS s \$f\$;
CREATE TEMP TABLE mark AS SELECT pg_temp.cpu() AS ticks;
DO \$\$
DECLARE ids uuid[];
BEGIN
	FOR ids IN SELECT array_agg(id) FROM (SELECT id, (row_number() OVER (ORDER BY id) - 1) / 100 AS b
			FROM $table WHERE status = 'PENDING') s GROUP BY b ORDER BY b LOOP
$($steps "$table")
	END LOOP;
END \$\$;
SELECT round((pg_temp.cpu() - ticks) * (1e6 / $hz) / 50000, 1) FROM mark;
SQL
}

if [ -n "$pattern" ]; then
	chosen=()
	for c in "${configs[@]}"; do
		if grep -Eq -- "$pattern" <<<"${c%%:*}"; then chosen+=("$c"); fi
	done
	configs=("${chosen[@]}")
fi

# indexes runs statements on tasks, one at a time.
indexes() {
	local sql
	for sql in "$@"; do q -c "$sql"; done
}

for ((r = 1; r <= rounds; r++)); do
	for c in "${configs[@]}"; do
		name=${c%%:*}
		if [ "$name" = tasks ]; then
			indexes "${after_014[@]}"
			fill tasks
			us=$(loop tasks)
		elif [ "$name" = "tasks, claim and completion fused" ]; then
			indexes "${after_014[@]}"
			fill tasks
			us=$(loop tasks fused)
		elif [ "$name" = "tasks, its indexes as before migration 014" ]; then
			indexes "${before_014[@]}"
			fill tasks
			us=$(loop tasks)
		else
			q -c "DROP TABLE IF EXISTS narrow" -c "$narrow_table" \
				-c "CREATE INDEX ON narrow (id) WHERE status = 'PENDING'"
			for i in ${c#*:}; do q -c "CREATE INDEX narrow_$i ON narrow ${index[$i]}"; done
			fill narrow
			us=$(loop narrow)
		fi
		echo "$name	$us" >>"$work/results"
		echo "round $r: $name: $us µs" >&2
	done
done

echo
echo "PostgreSQL CPU per task, claim and completion (µs; median of $rounds, then each round's):"
for c in "${configs[@]}"; do
	name=${c%%:*}
	vals=$(awk -F'\t' -v n="$name" '$1 == n {print $2}' "$work/results" | sort -n | paste -sd' ')
	med=$(echo "$vals" | tr ' ' '\n' | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}')
	printf '  %-55s %6s   (%s)\n' "$name" "$med" "$vals"
done
