package postgres

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/outbox"
)

// The relay's statements: the outbox, taken in batches.

// sqlClaimOutbox locks a batch of due rows, oldest first along the
// outbox_available index. Rows locked by another relay are skipped, so
// relays never publish the same row at once. Parked rows (available_at =
// 'infinity') are never due.
var sqlClaimOutbox = statement("outbox.claim", `
SELECT id, kind, org_id, task_id, task_type, attempt, task_version, priority, headers, attempts, created_at, available_at
FROM outbox WHERE available_at <= now()
ORDER BY available_at, id LIMIT $1
FOR UPDATE SKIP LOCKED`)

var sqlDeleteOutbox = statement("outbox.delete", `DELETE FROM outbox WHERE id = ANY($1)`)

// sqlStampPublished records the broker's confirmation on the tasks whose
// task.run message it confirmed. It is bookkeeping, not a change of the
// task's lifecycle: the version stays. It skips tasks a worker holds locked
// (it is claiming them: no stamp needed).
var sqlStampPublished = statement("tasks.stamp_published", `
UPDATE tasks SET published_at = now()
FROM (SELECT id AS locked_id FROM tasks WHERE id = ANY($1) AND `+isPending+` ORDER BY id FOR UPDATE SKIP LOCKED) l
WHERE id = l.locked_id`)

// sqlRetryOutbox records failures and makes each row available again after
// a backoff that doubles per attempt up to a cap (the exponent is capped
// too: a row that failed a thousand times must not overflow it). The
// backoff counts from the failure (clock_timestamp()), not from the start
// of the pass (now()): the pass waited for the broker's confirms in
// between, up to RELAY_CONFIRM_TIMEOUT, longer than the first backoffs.
var sqlRetryOutbox = statement("outbox.retry", `
UPDATE outbox o SET attempts = o.attempts + 1, last_error = f.reason,
	available_at = clock_timestamp() + make_interval(secs => least($3::float8 * power(2, least(o.attempts, 30)), $4::float8))
FROM unnest($1::bigint[], $2::text[]) AS f(id, reason)
WHERE o.id = f.id`)

// sqlParkOutbox parks rows no queue took: they wait until a worker for
// their type declares its queue (WorkerStore.TypesReady, and maintenance as
// a backstop).
var sqlParkOutbox = statement("outbox.park", `
UPDATE outbox o SET attempts = o.attempts + 1, last_error = f.reason, available_at = 'infinity'
FROM unnest($1::bigint[], $2::text[]) AS f(id, reason)
WHERE o.id = f.id`)

// sqlUnparkOutbox releases the rows parked for types whose queue the relay
// found declared after it parked them (see relay.Relay's re-check).
var sqlUnparkOutbox = statement("outbox.unpark", `
UPDATE outbox SET available_at = now()
WHERE task_type = ANY($1) AND available_at = 'infinity'`)

var sqlOutboxStats = statement("outbox.stats", `SELECT `+outboxStatsColumns+` FROM outbox`)

// outboxStatsColumns are the columns of an outbox.Stats, read by
// scanOutboxStats: the rows due, how long the oldest of them has been due,
// and the rows parked.
const outboxStatsColumns = `count(*) FILTER (WHERE available_at <= now()),
	coalesce(extract(epoch FROM now() - min(available_at) FILTER (WHERE available_at <= now())), 0),
	count(*) FILTER (WHERE available_at = 'infinity')`

func scanOutboxStats(row pgx.Row) (outbox.Stats, error) {
	var st outbox.Stats
	var age float64
	if err := row.Scan(&st.Due, &age, &st.Parked); err != nil {
		return outbox.Stats{}, err
	}
	st.OldestDueAge = time.Duration(age * float64(time.Second))
	return st, nil
}

// sqlPlansPerCall and sqlAfterLock set the rest of a relay's transaction.
//
// The relay's connections keep one generic plan per statement, as its
// statements are keyed by ids; the lock of a batch is planned at each call
// instead, for the outbox as it is: the outbox is empty most of the time,
// and a plan kept from then (a scan of the whole table and a sort) made
// every batch of an outage's backlog read and sort all of it.
//
// The relay's commit does not wait for its WAL to reach the disk. It
// records only that rows were published (deleted, their tasks stamped),
// parked or put off: if PostgreSQL crashes before the WAL is flushed, the
// rows are still there after recovery and are published again, a duplicate
// message that a worker's claim discards. Nothing a client was told is
// lost, and the next commit that waits for its flush (a submission, a
// claim) flushes the relay's with it: the WAL is written in order. At low
// rates, where a pass carries one row, this is one flush a task fewer.
var (
	sqlPlansPerCall = statement("relay.plans_per_call", `SELECT set_config('plan_cache_mode', 'force_custom_plan', true)`)
	sqlAfterLock    = statement("relay.after_lock", `SELECT set_config('plan_cache_mode', 'force_generic_plan', true),
	set_config('synchronous_commit', 'off', true)`)
)

// lockOutbox begins a transaction on conn and locks up to limit due rows
// in it, in one round trip: the BEGIN and the lock are pipelined.
func lockOutbox(ctx context.Context, conn *pgx.Conn, limit int) ([]outbox.Message, error) {
	var msgs []outbox.Message
	b := &pgx.Batch{}
	b.BeginTx(pgx.TxOptions{})
	b.Queue(sqlPlansPerCall)
	b.Queue(sqlClaimOutbox, limit).Query(func(rows pgx.Rows) error {
		var err error
		msgs, err = pgx.CollectRows(rows, scanMessage)
		return err
	})
	b.Queue(sqlAfterLock)
	return msgs, conn.SendBatch(ctx, b).Close()
}

// RelayStore runs the relay's statements.
type RelayStore struct {
	pool *pgxpool.Pool
	// Backoff of a failed row: base doubled per attempt, capped.
	backoffBase, backoffMax time.Duration
}

// NewRelayStore returns the relay's store.
func NewRelayStore(pool *pgxpool.Pool, backoffBase, backoffMax time.Duration) *RelayStore {
	return &RelayStore{pool: pool, backoffBase: backoffBase, backoffMax: backoffMax}
}

// Relay locks up to limit due rows in a short transaction, hands them to
// publish, then — in the same transaction — deletes the rows publish
// confirmed, stamps their tasks as published, parks the rows no queue took,
// schedules the failed ones for a later try, and commits. It returns the
// number of rows locked. publish must not hold on for long: it runs inside
// the transaction. If the process dies before the commit, the rows are
// still there and are published again: at least once, never lost.
//
// A pass is two round trips to PostgreSQL, whatever its size: the BEGIN
// with the lock, and the writes with the COMMIT. At low rates a pass
// carries one row, and each round trip is a wake-up of the relay and of
// its backend.
func (s *RelayStore) Relay(ctx context.Context, limit int, publish func(context.Context, []outbox.Message) outbox.Outcome) (int, error) {
	conn, err := s.pool.Acquire(ctx)
	if err != nil {
		return 0, fmt.Errorf("relay outbox batch: %w", err)
	}
	defer conn.Release()
	n, err := s.relay(ctx, conn.Conn(), limit, publish)
	if err != nil {
		rollBack(ctx, conn.Conn())
		return n, fmt.Errorf("relay outbox batch: %w", err)
	}
	return n, nil
}

// rollBack ends the transaction a failure left open on conn, so that the
// connection goes back to the pool. Where that fails too, the pool closes
// the connection on its release rather than reuse it mid-transaction.
func rollBack(ctx context.Context, conn *pgx.Conn) {
	if conn.IsClosed() || conn.PgConn().TxStatus() == 'I' {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	_, _ = conn.Exec(ctx, "ROLLBACK")
}

func (s *RelayStore) relay(ctx context.Context, conn *pgx.Conn, limit int, publish func(context.Context, []outbox.Message) outbox.Outcome) (int, error) {
	msgs, err := lockOutbox(ctx, conn, limit)
	if err != nil {
		return 0, err
	}
	batch := &pgx.Batch{}
	if len(msgs) > 0 {
		out := publish(ctx, msgs)
		if len(out.Published) > 0 {
			batch.Queue(sqlDeleteOutbox, out.Published)
			// The stamp skips the tasks a worker holds locked (it is
			// claiming them: no stamp needed), so a claim never waits for
			// more than this batch's commit.
			if ran := runTasks(msgs, out.Published); len(ran) > 0 {
				batch.Queue(sqlStampPublished, ran)
			}
		}
		if len(out.Unroutable) > 0 {
			ids, reasons := splitReasons(out.Unroutable)
			batch.Queue(sqlParkOutbox, ids, reasons)
		}
		if len(out.Failed) > 0 {
			ids, reasons := splitReasons(out.Failed)
			batch.Queue(sqlRetryOutbox, ids, reasons, s.backoffBase.Seconds(), s.backoffMax.Seconds())
		}
	}
	// A statement that fails makes PostgreSQL skip the rest of the batch,
	// the COMMIT too, and Close returns its error.
	batch.Queue("COMMIT")
	return len(msgs), conn.SendBatch(ctx, batch).Close()
}

// runTasks lists the tasks of the published task.run messages.
func runTasks(msgs []outbox.Message, published []int64) []uuid.UUID {
	ok := make(map[int64]bool, len(published))
	for _, id := range published {
		ok[id] = true
	}
	var out []uuid.UUID
	for _, m := range msgs {
		if ok[m.ID] && m.Kind == outbox.KindRun {
			out = append(out, m.TaskID)
		}
	}
	return out
}

func splitReasons(m map[int64]string) ([]int64, []string) {
	ids := make([]int64, 0, len(m))
	reasons := make([]string, 0, len(m))
	for id, reason := range m {
		ids = append(ids, id)
		reasons = append(reasons, reason)
	}
	return ids, reasons
}

func scanMessage(row pgx.CollectableRow) (outbox.Message, error) {
	var m outbox.Message
	var kind string
	var priority int16
	var headers []byte
	if err := row.Scan(&m.ID, &kind, &m.OrgID, &m.TaskID, &m.TaskType, &m.Attempt, &m.TaskVersion, &priority, &headers,
		&m.Attempts, &m.CreatedAt, &m.DueAt); err != nil {
		return m, err
	}
	m.Kind, m.Priority = outbox.Kind(kind), uint8(priority)
	if len(headers) > 0 {
		if err := json.Unmarshal(headers, &m.Headers); err != nil {
			return m, fmt.Errorf("outbox %d headers: %w", m.ID, err)
		}
	}
	return m, nil
}

// Stats measures the due backlog and the parked rows.
func (s *RelayStore) Stats(ctx context.Context) (outbox.Stats, error) {
	st, err := scanOutboxStats(s.pool.QueryRow(ctx, sqlOutboxStats))
	if err != nil {
		return st, fmt.Errorf("outbox stats: %w", err)
	}
	return st, nil
}

// Unpark releases the rows parked for types, which a queue now takes, and
// returns how many it released.
func (s *RelayStore) Unpark(ctx context.Context, types []string) (int64, error) {
	tag, err := s.pool.Exec(ctx, sqlUnparkOutbox, types)
	if err != nil {
		return 0, fmt.Errorf("release parked outbox rows: %w", err)
	}
	return tag.RowsAffected(), nil
}

// Ping checks the database.
func (s *RelayStore) Ping(ctx context.Context) error { return s.pool.Ping(ctx) }
