package postgres_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"
	"golang.org/x/sync/errgroup"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// Several processes migrating at once a database that does not exist yet:
// it is created once and every migration is applied once.
func TestOpenAndMigrateConcurrently(t *testing.T) {
	t.Parallel()
	url := testdb.NewEmpty(t)
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	const runners = 6
	applied := make([][]int, runners)
	var g errgroup.Group
	for i := range runners {
		g.Go(func() error {
			if err := postgres.EnsureDatabaseURL(ctx, url); err != nil {
				return err
			}
			pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: url, MaxConns: 2})
			if err != nil {
				return err
			}
			defer pool.Close()
			applied[i], err = postgres.Migrate(ctx, pool, log)
			return err
		})
	}
	require.NoError(t, g.Wait())

	all, err := postgres.Migrations()
	require.NoError(t, err)
	var total int
	for _, a := range applied {
		total += len(a)
	}
	require.Equal(t, len(all), total, "each migration applied by exactly one runner")

	pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: url})
	require.NoError(t, err)
	defer pool.Close()
	var versions []int
	rows, err := pool.Query(ctx, "SELECT version FROM schema_migrations ORDER BY version")
	require.NoError(t, err)
	for rows.Next() {
		var v int
		require.NoError(t, rows.Scan(&v))
		versions = append(versions, v)
	}
	require.NoError(t, rows.Err())
	require.Len(t, versions, len(all))
	for i, m := range all {
		require.Equal(t, m.Version, versions[i])
	}

	// Running again applies nothing.
	again, err := postgres.Migrate(ctx, pool, log)
	require.NoError(t, err)
	require.Empty(t, again)
}

// A mistyped DATABASE_URL fails at start-up; only EnsureDatabase (the
// migrate command) creates a database.
func TestOpenRefusesAMissingDatabase(t *testing.T) {
	t.Parallel()
	url := testdb.NewEmpty(t)
	_, err := postgres.Open(context.Background(), postgres.PoolConfig{URL: url})
	require.ErrorContains(t, err, "does not exist")
	require.ErrorContains(t, err, "api migrate")
	_, err = postgres.Open(context.Background(), postgres.PoolConfig{URL: url})
	require.Error(t, err, "still missing: nothing created it")
}

// The schema enforces the data model's rules even against a buggy writer.
func TestSchemaConstraints(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	insert := `INSERT INTO tasks (id, org_id, type, status, progress, priority) VALUES (gen_random_uuid(), ` + testdb.OrgSQL + `, $1, $2, $3, $4)`
	_, err := db.Pool.Exec(ctx, insert, "ok", "PENDING", 0, 0)
	require.NoError(t, err)
	for name, args := range map[string][]any{
		"bad status":                {"ok", "DONE", 0, 0},
		"progress > 100":            {"ok", "PENDING", 101, 0},
		"priority > 9":              {"ok", "PENDING", 0, 10},
		"bad type":                  {"Not OK", "PENDING", 0, 0},
		"terminal w/o completed_at": {"ok", "COMPLETED", 100, 0},
	} {
		_, err := db.Pool.Exec(ctx, insert, args...)
		require.Error(t, err, name)
	}
}

// The API migrates as it starts, on its pool, whose statements are bounded
// by API_REQUEST_TIMEOUT. A migration outlasts that: on a large tasks
// table its statements take minutes, and every other instance starting
// meanwhile waits for the lock that long. Neither may be cut short (the
// waiting instance exited, its lock wait cancelled), and the pool's bound
// holds again afterwards.
func TestMigrateOutlastsThePoolsStatementTimeout(t *testing.T) {
	t.Parallel()
	url := testdb.NewEmpty(t)
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	require.NoError(t, postgres.EnsureDatabaseURL(ctx, url))

	// Another runner holds the lock for a while, as one applying a long
	// migration does.
	other, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	_, err = other.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(postgres.MigrationLockKey))
	require.NoError(t, err)
	released := make(chan struct{})
	go func() {
		defer close(released)
		time.Sleep(time.Second)
		_, _ = other.Exec(ctx, "SELECT pg_advisory_unlock($1)", int64(postgres.MigrationLockKey))
	}()
	defer func() {
		<-released
		_ = other.Close(ctx)
	}()

	pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: url, MaxConns: 1, StatementTimeout: 100 * time.Millisecond})
	require.NoError(t, err)
	defer pool.Close()
	applied, err := postgres.Migrate(ctx, pool, log)
	require.NoError(t, err)
	all, err := postgres.Migrations()
	require.NoError(t, err)
	require.Len(t, applied, len(all))

	var timeout string
	require.NoError(t, pool.QueryRow(ctx, "SHOW statement_timeout").Scan(&timeout))
	require.Equal(t, "100ms", timeout, "the pool's statements are bounded again")
}

// Migration 020 on a database that already has runs of every status: a
// submitted node of a completed run whose task retention had deleted
// completed; no other node gets a status of its own, the others' being
// unknown (a failed or cancelled run) or read from their task.
func TestRunRetentionMigrationBackfill(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, pool := migratedTo(t, 19)
	_, err := pool.Exec(ctx, `INSERT INTO orgs (slug, name) VALUES ('o', 'o')`)
	require.NoError(t, err)
	for _, status := range []string{"RUNNING", "COMPLETED", "FAILED", "CANCELLED"} {
		run, kept := uuid.New(), uuid.New()
		_, err = pool.Exec(ctx, `INSERT INTO workflow_runs (id, org_id, workflow, status, on_failure, memoize, finished_at)
			VALUES ($1, (SELECT id FROM orgs), 'w', $2, 'stop', true, CASE WHEN $2 <> 'RUNNING' THEN now() END)`, run, status)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO tasks (id, org_id, type, status, completed_at, run_id, node)
			VALUES ($1, (SELECT id FROM orgs), 'x', 'COMPLETED', now(), $2, 'kept')`, kept, run)
		require.NoError(t, err)
		_, err = pool.Exec(ctx, `INSERT INTO run_nodes (run_id, node, org_id, position, job, state, task_id) VALUES
			($1, 'gone', (SELECT id FROM orgs), 0, 'a', 'SUBMITTED', $2),
			($1, 'kept', (SELECT id FROM orgs), 1, 'a', 'SUBMITTED', $3),
			($1, 'memo', (SELECT id FROM orgs), 2, 'a', 'MEMOIZED', $4),
			($1, 'wait', (SELECT id FROM orgs), 3, 'a', 'WAITING', NULL),
			($1, 'skip', (SELECT id FROM orgs), 4, 'a', 'SKIPPED', NULL)`, run, uuid.New(), kept, uuid.New())
		require.NoError(t, err)
	}
	ran, err := postgres.Migrate(ctx, pool, slog.New(slog.NewTextHandler(io.Discard, nil)))
	require.NoError(t, err)
	require.Contains(t, ran, 20)

	rows, err := pool.Query(ctx, `SELECT r.status || ' ' || n.node FROM run_nodes n JOIN workflow_runs r ON r.id = n.run_id
		WHERE n.task_status IS NOT NULL`)
	require.NoError(t, err)
	set, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"COMPLETED gone"}, set)
	require.Equal(t, "COMPLETED", func() string {
		var s string
		require.NoError(t, pool.QueryRow(ctx, `SELECT task_status FROM run_nodes WHERE task_status IS NOT NULL`).Scan(&s))
		return s
	}())
}

// A binary older than the schema (started after a newer release migrated
// the database, or rolled back to) refuses to run against it, saying why,
// instead of running statements written for a schema that is gone.
func TestMigrateRefusesANewerSchema(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	all, err := postgres.Migrations()
	require.NoError(t, err)
	next := all[len(all)-1].Version + 1
	_, err = db.Pool.Exec(ctx, "INSERT INTO schema_migrations (version, name) VALUES ($1, 'from_a_newer_release')", next)
	require.NoError(t, err)

	_, err = postgres.Migrate(ctx, db.Pool, log)
	require.ErrorIs(t, err, postgres.ErrSchemaNewer)
	require.ErrorContains(t, err, fmt.Sprintf("%03d", next))
	require.ErrorIs(t, postgres.CheckSchema(ctx, db.Pool), postgres.ErrSchemaNewer, "nor does the relay")

	// The lock was given back: the newer release still migrates.
	_, err = db.Pool.Exec(ctx, "DELETE FROM schema_migrations WHERE version = $1", next)
	require.NoError(t, err)
	again, err := postgres.Migrate(ctx, db.Pool, log)
	require.NoError(t, err)
	require.Empty(t, again)
	require.NoError(t, postgres.CheckSchema(ctx, db.Pool))
	_, err = db.Pool.Exec(ctx, "DELETE FROM schema_migrations WHERE version = $1", next-1)
	require.NoError(t, err)
	require.ErrorIs(t, postgres.CheckSchema(ctx, db.Pool), postgres.ErrSchemaBehind)
}

// A migration cut short (the process stopped while it waited for a lock on
// a busy table) leaves nothing of itself: each migration is one
// transaction with its schema_migrations row, so the next start applies it
// whole.
func TestAnInterruptedMigrationIsAppliedWholeAtTheNextStart(t *testing.T) {
	t.Parallel()
	url, pool := migratedTo(t, 19)
	ctx := context.Background()
	log := slog.New(slog.NewTextHandler(io.Discard, nil))

	// A long transaction reading run_nodes: 020's ALTER TABLE waits for it,
	// after its first statements ran.
	reader, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer reader.Close(ctx)
	tx, err := reader.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "LOCK TABLE run_nodes IN ACCESS SHARE MODE")
	require.NoError(t, err)

	mctx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() {
		_, err := postgres.Migrate(mctx, pool, log)
		done <- err
	}()
	testenv.Eventually(t, 10*time.Second, func() error {
		var waiting int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock'`).Scan(&waiting); err != nil {
			return err
		}
		if waiting == 0 {
			return fmt.Errorf("migration 020 not waiting for run_nodes yet")
		}
		return nil
	})
	stop()
	require.Error(t, <-done)
	require.NoError(t, tx.Rollback(ctx))

	var applied, index, column int
	require.NoError(t, pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM schema_migrations WHERE version = 20),
		(SELECT count(*) FROM pg_class WHERE relname = 'workflow_runs_finished'),
		(SELECT count(*) FROM information_schema.columns WHERE table_name = 'run_nodes' AND column_name = 'task_status')`,
	).Scan(&applied, &index, &column))
	require.Equal(t, [3]int{0, 0, 0}, [3]int{applied, index, column}, "nothing of 020 stays")

	ran, err := postgres.Migrate(ctx, pool, log)
	require.NoError(t, err)
	require.NotEmpty(t, ran)
	require.Equal(t, 20, ran[0], "020 first, then any later migration")
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.columns
		WHERE table_name = 'run_nodes' AND column_name = 'task_status'`).Scan(&column))
	require.Equal(t, 1, column)
}

// lockedTasks is a test database whose tasks table a session reads in a
// transaction left open (a long report, a forgotten psql session: it holds
// ACCESS SHARE until it ends), and a migration that needs ACCESS
// EXCLUSIVE on tasks.
type lockedTasks struct {
	db        *testdb.DB
	blocker   pgx.Tx
	pid       uint32
	migration []postgres.Migration
	log       *slog.Logger
	logs      *syncBuffer
}

func lockTasks(t *testing.T) *lockedTasks {
	t.Helper()
	ctx := context.Background()
	db := testdb.New(t)
	cc, err := pgx.ParseConfig(db.URL)
	require.NoError(t, err)
	cc.RuntimeParams["application_name"] = "monthly_report"
	conn, err := pgx.ConnectConfig(ctx, cc)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(ctx) })
	tx, err := conn.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "SELECT count(*) FROM tasks")
	require.NoError(t, err)
	logs := &syncBuffer{}
	return &lockedTasks{
		db: db, blocker: tx, pid: conn.PgConn().PID(), logs: logs,
		log: slog.New(slog.NewTextHandler(logs, nil)),
		migration: []postgres.Migration{{Version: 900, Name: "needs_tasks_alone",
			SQL: "ALTER TABLE tasks ADD COLUMN needs_tasks_alone integer"}},
	}
}

// waits counts the waits for a lock the migration runner logged.
func (l *lockedTasks) waits() int {
	return strings.Count(l.logs.String(), "migration waiting for a lock held by another session")
}

// A migration waiting for tasks behind a long transaction holds up every
// later statement on tasks only for its lock_timeout: then it gives the
// table back, logs whom it waits for, and tries again, until the
// transaction ends and it is applied.
func TestAMigrationWaitingForALockLetsTheServiceRun(t *testing.T) {
	t.Parallel()
	l := lockTasks(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	type result struct {
		ran []int
		err error
	}
	done := make(chan result, 1)
	go func() {
		ran, err := postgres.MigrateThese(ctx, l.db.Pool, l.log,
			postgres.MigrateConfig{LockTimeout: 300 * time.Millisecond, LockTries: 1000, LockBackoff: 50 * time.Millisecond},
			l.migration)
		done <- result{ran, err}
	}()

	// Reads of tasks arriving while the migration waits queue behind it,
	// and go through once its lock_timeout gives the table back. Without
	// one they would wait as long as the report: the bound here is
	// generous, the test's only concern being that they are not held for
	// as long as the blocker lasts.
	for range 3 {
		testenv.Eventually(t, 10*time.Second, func() error {
			var waiting int
			if err := l.db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE 'ALTER TABLE tasks%'`).Scan(&waiting); err != nil {
				return err
			}
			if waiting == 0 {
				return fmt.Errorf("the migration is not waiting for tasks")
			}
			return nil
		})
		rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
		var n int
		err := l.db.Pool.QueryRow(rctx, "SELECT count(*) FROM tasks").Scan(&n)
		rcancel()
		require.NoError(t, err, "a read of tasks stayed queued behind the waiting migration")
	}
	testenv.Eventually(t, 10*time.Second, func() error {
		for _, line := range strings.Split(l.logs.String(), "\n") {
			if strings.Contains(line, "migration waiting for a lock held by another session") &&
				strings.Contains(line, "version=900") && strings.Contains(line, fmt.Sprintf("session pid %d", l.pid)) &&
				strings.Contains(line, "monthly_report") {
				return nil
			}
		}
		return fmt.Errorf("no wait naming the migration and its blocker logged yet:\n%s", l.logs.String())
	})

	// The report ends: the migration is applied at its next try.
	require.NoError(t, l.blocker.Commit(ctx))
	r := <-done
	require.NoError(t, r.err)
	require.Equal(t, []int{900}, r.ran)
	var column int
	require.NoError(t, l.db.Pool.QueryRow(ctx, `SELECT count(*) FROM information_schema.columns
		WHERE table_name = 'tasks' AND column_name = 'needs_tasks_alone'`).Scan(&column))
	require.Equal(t, 1, column)
}

// A migration whose table stays locked gives up after its tries, leaving
// nothing of itself, in an error that names the session to end.
func TestAMigrationThatNeverGetsItsLockFailsNamingTheBlocker(t *testing.T) {
	t.Parallel()
	l := lockTasks(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()

	_, err := postgres.MigrateThese(ctx, l.db.Pool, l.log,
		postgres.MigrateConfig{LockTimeout: 500 * time.Millisecond, LockTries: 3, LockBackoff: 10 * time.Millisecond},
		l.migration)
	require.ErrorContains(t, err, "apply migration 900_needs_tasks_alone")
	require.ErrorContains(t, err, "gave up after 3 tries, each waiting 500ms for a lock held by")
	require.ErrorContains(t, err, fmt.Sprintf("session pid %d", l.pid))
	require.ErrorContains(t, err, `application "monthly_report"`)
	require.ErrorContains(t, err, "idle in transaction")
	var pgErr *pgconn.PgError
	require.ErrorAs(t, err, &pgErr)
	require.Equal(t, "55P03", pgErr.Code)
	require.Equal(t, 2, l.waits(), "each wait before the last try is logged")

	var applied, column int
	require.NoError(t, l.db.Pool.QueryRow(ctx, `SELECT
		(SELECT count(*) FROM schema_migrations WHERE version = 900),
		(SELECT count(*) FROM information_schema.columns WHERE table_name = 'tasks' AND column_name = 'needs_tasks_alone')`,
	).Scan(&applied, &column))
	require.Equal(t, [2]int{0, 0}, [2]int{applied, column}, "nothing of the migration stays")
	_, err = l.blocker.Exec(ctx, "SELECT count(*) FROM tasks")
	require.NoError(t, err, "the blocking session is left alone")
}

// syncBuffer is a bytes.Buffer safe for a logger's writes from other
// goroutines.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}
