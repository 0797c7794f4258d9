package postgres

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/registry"
)

// The worker registry as the API reads it. Workers and leaderships are the
// deployment's, shared by every org: these statements run as the pool's
// own user (the tenant role has no grant on them), and name no org's task.

var sqlLiveWorkers = statement("workers.live", `SELECT id, hostname, pid, concurrency, types, version,
	started_at, last_heartbeat_at
	FROM workers WHERE last_heartbeat_at > now() - $1 * interval '1 millisecond' ORDER BY id`)

var sqlLeader = statement("leaders.current", `SELECT coalesce(max(leader_id), '') FROM leaders
	WHERE name = $1 AND expires_at > now()`)

// RegistryStore reads the worker registry for the API.
type RegistryStore struct {
	pool *pgxpool.Pool
}

// NewRegistryStore returns the registry's reader over pool, whose user must
// not be limited by row-level security (the owner's pool).
func NewRegistryStore(pool *pgxpool.Pool) *RegistryStore { return &RegistryStore{pool: pool} }

// Fleet returns the workers heard from within the last liveWithin, by id,
// and the worker that leads maintenance now.
func (s *RegistryStore) Fleet(ctx context.Context, liveWithin time.Duration) (registry.Fleet, error) {
	var f registry.Fleet
	b := &pgx.Batch{}
	b.Queue(sqlLiveWorkers, liveWithin.Milliseconds()).Query(func(rows pgx.Rows) error {
		var err error
		f.Workers, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (registry.Seen, error) {
			var w registry.Seen
			return w, row.Scan(&w.ID, &w.Hostname, &w.PID, &w.Concurrency, &w.Types, &w.Version,
				&w.StartedAt, &w.LastHeartbeatAt)
		})
		return err
	})
	b.Queue(sqlLeader, registry.Maintenance).QueryRow(func(row pgx.Row) error { return row.Scan(&f.Leader) })
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return registry.Fleet{}, translate(err)
	}
	return f, nil
}
