package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
)

// statements measures what the worker's own statements cost PostgreSQL per
// task, apart from the broker, the worker's goroutines and concurrency: the
// claim and the completion (with a result) of n pending tasks, batch after
// batch on one connection, with generic plans as the worker has them. The
// CPU is the backend's own, read from /proc. A statement's plan, or a
// change of the tasks table, shows here first; the burn-downs mix it with
// everything else.
func (b *bench) statements(ctx context.Context) error {
	return b.scope(func() error {
		url, admin, err := b.e.database(ctx, "bench_statements", 2)
		if err != nil {
			return err
		}
		if _, err := postgres.Migrate(ctx, admin, slog.New(slog.NewTextHandler(io.Discard, nil))); err != nil {
			return err
		}
		ids, err := pendingNoops(ctx, admin, b.o.burnN)
		if err != nil {
			return err
		}
		pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: url, MaxConns: 1, Plans: postgres.PlansGeneric})
		if err != nil {
			return err
		}
		defer pool.Close()
		claim, complete, err := claimAndComplete(ctx, pool, ids, b.o.stmtBatch)
		if err != nil {
			return err
		}
		n := float64(len(ids))
		b.add(result{Name: fmt.Sprintf("Conveyor: claim + completion, PostgreSQL CPU per task (sequential, batches of %d)", b.o.stmtBatch),
			Value: (claim + complete) / n * 1e6, Unit: "µs"})
		b.add(result{Name: "Conveyor: claim, PostgreSQL CPU per task", Value: claim / n * 1e6, Unit: "µs"})
		b.add(result{Name: "Conveyor: completion, PostgreSQL CPU per task", Value: complete / n * 1e6, Unit: "µs"})
		return nil
	})
}

// pendingNoops writes n pending demo.noop tasks of one org, published, as
// the API and the relay leave them, and returns their ids in order.
func pendingNoops(ctx context.Context, pool *pgxpool.Pool, n int) ([]uuid.UUID, error) {
	org := uuid.New()
	if _, err := pool.Exec(ctx, `INSERT INTO orgs (id, slug, name) VALUES ($1, 'bench', 'bench')`, org); err != nil {
		return nil, err
	}
	ids := make([]uuid.UUID, n)
	for i := range ids {
		id, err := uuid.NewV7()
		if err != nil {
			return nil, err
		}
		ids[i] = id
	}
	_, err := pool.Exec(ctx, `INSERT INTO tasks (id, org_id, type, input_hash, published_at)
		SELECT id, $1, 'demo.noop', encode(sha256(id::text::bytea), 'hex'), now() FROM unnest($2::uuid[]) AS id`, org, ids)
	if err != nil {
		return nil, err
	}
	_, err = pool.Exec(ctx, `VACUUM ANALYZE tasks`)
	return ids, err
}

// claimAndComplete claims and completes ids in batches and returns the
// CPU (seconds) the connection's backend spent in each kind of statement.
func claimAndComplete(ctx context.Context, pool *pgxpool.Pool, ids []uuid.UUID, batch int) (claim, complete float64, err error) {
	var pid int
	if err := pool.QueryRow(ctx, `SELECT pg_backend_pid()`).Scan(&pid); err != nil {
		return 0, 0, err
	}
	store := postgres.NewWorkerStore(pool, nil)
	t0, err := processCPU(pid)
	if err != nil {
		return 0, 0, err
	}
	for i := 0; i < len(ids); i += batch {
		tasks, err := store.Claim(ctx, ids[i:min(i+batch, len(ids))], "bench", time.Minute)
		if err != nil {
			return 0, 0, err
		}
		t1, err := processCPU(pid)
		if err != nil {
			return 0, 0, err
		}
		changes := make([]task.Change, len(tasks))
		for j, t := range tasks {
			changes[j] = task.Change{TaskID: t.ID, Version: t.Version, Transition: task.Complete, Result: []byte(`{}`)}
		}
		_, errs, err := store.Apply(ctx, changes)
		if err != nil {
			return 0, 0, err
		}
		for _, err := range errs {
			if err != nil {
				return 0, 0, err
			}
		}
		t2, err := processCPU(pid)
		if err != nil {
			return 0, 0, err
		}
		claim, complete = claim+t1-t0, complete+t2-t1
		t0 = t2
	}
	var done int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM tasks WHERE status = 'COMPLETED'`).Scan(&done); err != nil {
		return 0, 0, err
	}
	if done != len(ids) {
		return 0, 0, fmt.Errorf("completed %d of %d tasks", done, len(ids))
	}
	return claim, complete, nil
}

// processCPU is the CPU time process pid has used, in seconds: counted in
// clock ticks of 10 ms, so a sum over many short statements is right on
// average, not each one.
func processCPU(pid int) (float64, error) {
	_, cpu, ok := readStat("/proc/" + strconv.Itoa(pid) + "/stat")
	if !ok {
		return 0, fmt.Errorf("read /proc/%d/stat", pid)
	}
	return cpu, nil
}
