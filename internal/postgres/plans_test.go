package postgres_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// A background statement that searches the tasks by status is planned for
// the table as it is at each call. Planned once, while the table was empty,
// the sweep for tasks of stopped runs read the whole table at every pass
// once a backlog came, and compared every task with every other.
func TestBackgroundStatementsArePlannedForTheTableOfTheMoment(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `ANALYZE tasks`)
	require.NoError(t, err)
	sweep := statementSQL(t, "tasks.orphans")

	// scanned runs the sweep on conn and returns the task rows it read by
	// scanning the table.
	scanned := func(conn *pgx.Conn) int64 {
		tx, err := conn.Begin(ctx)
		require.NoError(t, err)
		defer func() { _ = tx.Rollback(ctx) }()
		rows, err := tx.Query(ctx, sweep, nil, 500)
		require.NoError(t, err)
		rows.Close()
		require.NoError(t, rows.Err())
		var n int64
		require.NoError(t, tx.QueryRow(ctx,
			`SELECT coalesce(sum(seq_tup_read), 0) FROM pg_stat_xact_user_tables WHERE relname = 'tasks'`).Scan(&n))
		return n
	}
	conns := map[postgres.Plans]*pgx.Conn{}
	for _, plans := range []postgres.Plans{postgres.PlansGeneric, postgres.PlansCustom} {
		pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: db.URL, MaxConns: 1, Plans: plans})
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		c, err := pool.Acquire(ctx)
		require.NoError(t, err)
		t.Cleanup(c.Release)
		conns[plans] = c.Conn()
		for range 6 { // past the five calls after which PostgreSQL may keep a plan
			scanned(conns[plans])
		}
	}

	_, err = db.Pool.Exec(ctx, `INSERT INTO tasks (id, org_id, type)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop' FROM generate_series(1, 2000)`)
	require.NoError(t, err)
	generic := scanned(conns[postgres.PlansGeneric])
	t.Logf("planned once on the empty table: %d rows read", generic)
	require.GreaterOrEqual(t, generic, int64(2000),
		"planned once on the empty table, the sweep reads it all (else this test shows nothing)")
	require.Zero(t, scanned(conns[postgres.PlansCustom]), "the sweep reads only its partial indexes")
}

// The sweep for tasks of stopped runs and failed parents starts from the
// tasks in flight that have a run or a parent, and reads each one's run or
// parent by key, whatever the statistics say: the stopped runs and the
// finished tasks only grow. Statistics taken while many children were open
// made a hash join over every failed task look cheap.
func TestTheSweepForOrphansReadsRunsAndParentsByKey(t *testing.T) {
	b := setupStores(t)
	b.exec(t, `INSERT INTO tasks (id, org_id, type, status, completed_at)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop', 'FAILED', now() FROM generate_series(1, 5000)`)
	b.exec(t, `INSERT INTO tasks (id, org_id, type, parent_id, child_key)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop', id, 'c' FROM tasks`)
	b.exec(t, `ANALYZE tasks`)
	b.exec(t, `UPDATE tasks SET status = 'CANCELLED', completed_at = now() WHERE parent_id IS NOT NULL`)
	plan := b.explain(t, statementSQL(t, "tasks.orphans"), nil, 500)
	require.Contains(t, plan, "using tasks_pkey on tasks p", plan)
	require.NotContains(t, plan, "Seq Scan", plan)
	require.NotContains(t, plan, "Hash Join", plan)
}
