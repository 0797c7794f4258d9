package postgres

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/outbox"
)

// sqlClaimOutbox locks a batch of due rows. Rows locked by another relay are
// skipped, so relays never publish the same row at once.
const sqlClaimOutbox = `SELECT id, kind, task_id, routing_key, priority, body, headers, attempts, created_at
	FROM outbox WHERE available_at <= now()
	ORDER BY id LIMIT $1
	FOR UPDATE SKIP LOCKED`

const sqlDeleteOutbox = `DELETE FROM outbox WHERE id = ANY($1)`

// sqlRetryOutbox records failures and makes each row available again after
// an exponential backoff.
const sqlRetryOutbox = `UPDATE outbox o SET attempts = o.attempts + 1, last_error = f.reason,
	available_at = now() + make_interval(secs => least($3::float8 * power(2, o.attempts), $4::float8))
	FROM unnest($1::bigint[], $2::text[]) AS f(id, reason)
	WHERE o.id = f.id`

const sqlOutboxStats = `SELECT count(*), coalesce(extract(epoch FROM now() - min(available_at)), 0)
	FROM outbox WHERE available_at <= now()`

// OutboxStore runs the relay's statements.
type OutboxStore struct {
	pool *pgxpool.Pool
	// Backoff of a failed row: base doubled per attempt, capped.
	backoffBase, backoffMax time.Duration
}

// NewOutboxStore returns the relay's store.
func NewOutboxStore(pool *pgxpool.Pool, backoffBase, backoffMax time.Duration) *OutboxStore {
	return &OutboxStore{pool: pool, backoffBase: backoffBase, backoffMax: backoffMax}
}

// Relay locks up to limit due rows in a short transaction, hands them to
// publish, then deletes the rows publish confirmed and schedules the failed
// ones for a later try, and commits. It returns the number of rows locked.
// publish must not hold on for long: it runs inside the transaction. If the
// process dies before the commit, the rows are still there and will be
// published again: at least once, never lost.
func (s *OutboxStore) Relay(ctx context.Context, limit int, publish func(context.Context, []outbox.Message) outbox.Outcome) (int, error) {
	var n int
	err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, sqlClaimOutbox, limit)
		if err != nil {
			return err
		}
		msgs, err := pgx.CollectRows(rows, scanMessage)
		if err != nil {
			return err
		}
		n = len(msgs)
		if n == 0 {
			return nil
		}
		out := publish(ctx, msgs)
		batch := &pgx.Batch{}
		if len(out.Published) > 0 {
			batch.Queue(sqlDeleteOutbox, out.Published)
		}
		if len(out.Failed) > 0 {
			ids := make([]int64, 0, len(out.Failed))
			reasons := make([]string, 0, len(out.Failed))
			for id, reason := range out.Failed {
				ids = append(ids, id)
				reasons = append(reasons, reason)
			}
			batch.Queue(sqlRetryOutbox, ids, reasons, s.backoffBase.Seconds(), s.backoffMax.Seconds())
		}
		if batch.Len() == 0 {
			return nil
		}
		return tx.SendBatch(ctx, batch).Close()
	})
	if err != nil {
		return n, fmt.Errorf("relay outbox batch: %w", err)
	}
	return n, nil
}

func scanMessage(row pgx.CollectableRow) (outbox.Message, error) {
	var m outbox.Message
	var kind string
	var priority int16
	var headers []byte
	if err := row.Scan(&m.ID, &kind, &m.TaskID, &m.RoutingKey, &priority, &m.Body, &headers, &m.Attempts, &m.CreatedAt); err != nil {
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

// Stats measures the due backlog.
func (s *OutboxStore) Stats(ctx context.Context) (outbox.Stats, error) {
	var st outbox.Stats
	var age float64
	if err := s.pool.QueryRow(ctx, sqlOutboxStats).Scan(&st.Due, &age); err != nil {
		return st, fmt.Errorf("outbox stats: %w", err)
	}
	st.OldestDueAge = time.Duration(age * float64(time.Second))
	return st, nil
}

// Ping checks the database.
func (s *OutboxStore) Ping(ctx context.Context) error { return s.pool.Ping(ctx) }
