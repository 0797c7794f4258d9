package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"
	"github.com/riverqueue/river/rivermigrate"
)

// River, the closest peer, measured on the same PostgreSQL in the same run.

type noopArgs struct {
	I int `json:"i"`
}

func (noopArgs) Kind() string { return "noop" }

type noopWorker struct {
	river.WorkerDefaults[noopArgs]
}

func (noopWorker) Work(context.Context, *river.Job[noopArgs]) error { return nil }

func riverClient(pool *pgxpool.Pool, workers int) (*river.Client[pgx.Tx], error) {
	w := river.NewWorkers()
	river.AddWorker(w, &noopWorker{})
	return river.NewClient(riverpgxv5.New(pool), &river.Config{
		Logger:  slog.New(slog.NewTextHandler(io.Discard, nil)),
		Queues:  map[string]river.QueueConfig{river.QueueDefault: {MaxWorkers: workers}},
		Workers: w,
		// River's default 100ms fetch cooldown caps a queue at MaxWorkers
		// jobs per 100ms; the shortest allowed makes it the strongest
		// baseline for a burn-down. Fetches follow completions (a freed
		// slot calls for one); the poll is the fallback, kept short.
		FetchCooldown:     river.FetchCooldownMin,
		FetchPollInterval: 20 * time.Millisecond,
	})
}

func riverMigrate(ctx context.Context, pool *pgxpool.Pool) error {
	m, err := rivermigrate.New(riverpgxv5.New(pool), nil)
	if err != nil {
		return err
	}
	_, err = m.Migrate(ctx, rivermigrate.DirectionUp, nil)
	return err
}

// riverInsert inserts one job per transaction from conc goroutines.
func riverInsert(ctx context.Context, pool *pgxpool.Pool, conc int, d time.Duration) (float64, error) {
	client, err := riverClient(pool, 1) // insert-only: never started
	if err != nil {
		return 0, err
	}
	return forDuration(conc, d, func(w, i int) error {
		_, err := client.Insert(ctx, noopArgs{I: w*1_000_000 + i}, nil)
		return err
	})
}

// riverPoolConns is the River client's connection pool in the burn-down.
// River's no-op jobs hold no connection while they run: the client needs
// one for the notifier's LISTEN, one for the producer's fetch (one at a
// time per queue), one for the batch completer (one batch at a time), and
// a few at times for the elector and the leader's maintenance services,
// besides the bench's own progress query; about a dozen at most. 32 leaves
// room to spare (the pool opens a connection only when none is idle, so
// the cap costs nothing unused) and stays far under PostgreSQL's default
// max_connections of 100, which workers/2+4 would pass at MaxWorkers 2000.
const riverPoolConns = 32

// burnResult is one burn-down: its rate, and the write transactions and
// WAL bytes per job or task.
type burnResult struct {
	perSec, commits, wal float64
}

// riverBurnDown inserts n no-op jobs, then starts a client with the given
// number of workers and measures how long until all are completed. It
// also returns how many connections the pool opened, the most the client
// and the bench held at once.
func riverBurnDown(ctx context.Context, pool *pgxpool.Pool, n, workers int) (burnResult, int32, error) {
	client, err := riverClient(pool, workers)
	if err != nil {
		return burnResult{}, 0, err
	}
	params := make([]river.InsertManyParams, 0, 5000)
	for i := range n {
		params = append(params, river.InsertManyParams{Args: noopArgs{I: i}})
		if len(params) == cap(params) || i == n-1 {
			if _, err := client.InsertManyFast(ctx, params); err != nil {
				return burnResult{}, 0, err
			}
			params = params[:0]
		}
	}
	before, err := pgCounters(ctx, pool)
	if err != nil {
		return burnResult{}, 0, err
	}
	start, err := dbNow(ctx, pool)
	if err != nil {
		return burnResult{}, 0, err
	}
	cpu := meterCPU(ctx, pool)
	if err := client.Start(ctx); err != nil {
		return burnResult{}, 0, err
	}
	elapsed, err := awaitBurnDown(ctx, pool, n, start,
		`SELECT EXISTS (SELECT 1 FROM river_job WHERE state IN ('available', 'running', 'retryable', 'scheduled', 'pending'))`,
		`SELECT count(*) FROM river_job WHERE state = 'completed'`,
		`SELECT max(finalized_at) FROM river_job`)
	cpu(fmt.Sprintf("River burn-down, %.0f jobs/s (River runs in bench)", float64(n)/elapsed.Seconds()), float64(n))
	conns := pool.Stat().TotalConns()
	stopCtx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_ = client.Stop(stopCtx)
	if err != nil {
		return burnResult{}, 0, fmt.Errorf("river burn-down: %w", err)
	}
	after, err := pgCounters(ctx, pool)
	if err != nil {
		return burnResult{}, 0, err
	}
	return burnResult{float64(n) / elapsed.Seconds(), float64(after.commits-before.commits) / float64(n),
		float64(after.wal-before.wal) / float64(n)}, conns, nil
}

type counters struct{ commits, wal int64 }

// pgCounters reads how many write transactions the cluster has assigned and
// where its WAL stands. Both move at once (the cumulative statistics views
// lag by up to seconds), and the benchmark is alone on the server, so their
// differences are the writes and WAL bytes of the measured work.
func pgCounters(ctx context.Context, pool *pgxpool.Pool) (counters, error) {
	var c counters
	err := pool.QueryRow(ctx, `SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint,
		pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint`).Scan(&c.commits, &c.wal)
	return c, err
}
