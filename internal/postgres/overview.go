package postgres

import (
	"context"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// The overview's statements read one org's tasks in the caller's scope:
// its running tasks through tasks_running, the others through
// tasks_org_status (migrations 005 and 014), the counts and the last hour
// by an index-only scan of it. A status = ANY (...) over both would be
// served by neither, so each statement reads the two apart.

var sqlOverviewCounts = statement("overview.counts", `SELECT status, count(*) FROM tasks
	WHERE org_id = $1 AND `+notRunning+` GROUP BY status
UNION ALL
SELECT `+lit(task.StatusInProgress)+`, count(*) FROM tasks WHERE org_id = $1 AND `+isRunning+` HAVING count(*) > 0`)

// sqlOverviewMinutes counts the tasks that completed and failed in each of
// the last 60 minutes, the current one last, by the database's clock.
var sqlOverviewMinutes = statement("overview.minutes", `
WITH ended AS (
	SELECT date_trunc('minute', completed_at) AS minute, status FROM tasks
	WHERE org_id = $1 AND status IN (`+litList([]task.Status{task.StatusCompleted, task.StatusFailed})+`)
		AND completed_at >= date_trunc('minute', now()) - interval '59 minutes'
)
SELECT m.minute, count(e.status) FILTER (WHERE e.status = `+lit(task.StatusCompleted)+`),
	count(e.status) FILTER (WHERE e.status = `+lit(task.StatusFailed)+`)
FROM generate_series(date_trunc('minute', now()) - interval '59 minutes', date_trunc('minute', now()),
	interval '1 minute') AS m(minute)
LEFT JOIN ended e ON e.minute = m.minute
GROUP BY m.minute ORDER BY m.minute`)

// sqlOverviewQueues sums up each type's queue: its tasks due, scheduled
// and running, and how long the oldest due one has waited. A parent
// waiting for its children waits for no worker, and is left out.
var sqlOverviewQueues = statement("overview.queues", `SELECT type,
	count(*) FILTER (WHERE `+isPending+` AND next_run_at <= now()),
	count(*) FILTER (WHERE `+isPending+` AND next_run_at > now()),
	count(*) FILTER (WHERE `+isRunning+`),
	coalesce(extract(epoch FROM now() - min(next_run_at) FILTER (WHERE `+isPending+` AND next_run_at <= now())), 0)
FROM (
	SELECT type, status, next_run_at FROM tasks WHERE org_id = $1 AND `+isPending+`
		AND state <> '`+task.StateAwaiting+`'
	UNION ALL
	SELECT type, status, next_run_at FROM tasks WHERE org_id = $1 AND `+isRunning+`
) t
GROUP BY type ORDER BY type`)

// sqlOverviewOutbox measures the org's outbox rows the caller may see
// (their policy follows their task's visibility); the range on
// available_at keeps it on outbox_available.
var sqlOverviewOutbox = statement("overview.outbox", `SELECT `+outboxStatsColumns+` FROM outbox
	WHERE org_id = $1 AND (available_at <= now() OR available_at = 'infinity')`)

// sqlOverviewRunning lists the tasks the named workers run, at most $3 per
// worker, oldest first.
var sqlOverviewRunning = statement("overview.running", `SELECT worker_id, id, type FROM (
	SELECT worker_id, id, type, row_number() OVER (PARTITION BY worker_id ORDER BY id) AS n
	FROM tasks WHERE org_id = $1 AND `+isRunning+` AND worker_id = ANY ($2::text[])
) r WHERE n <= $3 ORDER BY worker_id, id`)

// Overview returns the principal's org at a glance — counts, the last
// hour, the queues, the outbox — and the tasks each of workers runs, all
// limited to the tasks the principal may see. Its statements are pipelined
// in one round trip.
func (s *APIStore) Overview(ctx context.Context, p auth.Principal, workers []string) (task.Overview, error) {
	o := task.Overview{Counts: map[task.Status]int{}, Running: map[string][]task.Running{}}
	b := &pgx.Batch{}
	b.Queue(sqlSetScope, scopeArgs(p.Scope())...)
	b.Queue(sqlOverviewCounts, p.OrgID).Query(func(rows pgx.Rows) error {
		var status string
		var n int
		_, err := pgx.ForEachRow(rows, []any{&status, &n}, func() error {
			o.Counts[task.Status(status)] = n
			return nil
		})
		return err
	})
	b.Queue(sqlOverviewMinutes, p.OrgID).Query(func(rows pgx.Rows) error {
		var err error
		o.Minutes, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (task.Minute, error) {
			var m task.Minute
			return m, row.Scan(&m.Start, &m.Completed, &m.Failed)
		})
		return err
	})
	b.Queue(sqlOverviewQueues, p.OrgID).Query(func(rows pgx.Rows) error {
		var err error
		o.Types, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (task.Queue, error) {
			var q task.Queue
			var age float64
			err := row.Scan(&q.Type, &q.Pending, &q.Scheduled, &q.Running, &age)
			q.OldestPendingAge = time.Duration(age * float64(time.Second))
			return q, err
		})
		return err
	})
	b.Queue(sqlOverviewOutbox, p.OrgID).QueryRow(func(row pgx.Row) error {
		var err error
		o.Outbox, err = scanOutboxStats(row)
		return err
	})
	if len(workers) > 0 {
		b.Queue(sqlOverviewRunning, p.OrgID, workers, task.MaxRunningShown).Query(func(rows pgx.Rows) error {
			var worker, typ string
			var id uuid.UUID
			_, err := pgx.ForEachRow(rows, []any{&worker, &id, &typ}, func() error {
				o.Running[worker] = append(o.Running[worker], task.Running{ID: id, Type: typ})
				return nil
			})
			return err
		})
	}
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return task.Overview{}, translate(err)
	}
	return o, nil
}
