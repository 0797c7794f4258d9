package postgres_test

import (
	"context"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
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
		return grew(t, tx, "seq_tup_read", "tasks", func() error {
			rows, err := tx.Query(ctx, sweep, 500)
			if err == nil {
				rows.Close()
				err = rows.Err()
			}
			return err
		})
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
	plan := b.explain(t, statementSQL(t, "tasks.orphans"), 500)
	require.Contains(t, plan, "using tasks_pkey on tasks p", plan)
	require.NotContains(t, plan, "Seq Scan", plan)
	require.NotContains(t, plan, "Hash Join", plan)
}

// An org's running tasks are read through tasks_running and its others
// through tasks_org_status, which holds no running task (a claim writes
// no entry in it). Every read of the overview, the scheduler's count of
// held slots and a bulk cancel's count takes them: none scans the table.
func TestAnOrgsRunningAndOtherTasksAreReadThroughTheirIndexes(t *testing.T) {
	b := setupStores(t)
	// The org asked about has a tenth of the tasks; another org has the rest.
	other := b.db.Org(t, "other")
	b.exec(t, `INSERT INTO tasks (id, org_id, type, status, completed_at, lease_expires_at)
		SELECT gen_random_uuid(), CASE WHEN g % 100 < 10 THEN `+testdb.OrgSQL+` ELSE $1 END, 'demo.noop', s,
			CASE WHEN s IN ('COMPLETED', 'FAILED') THEN now() - g * interval '1 second' END,
			CASE WHEN s = 'IN_PROGRESS' THEN now() + interval '1 minute' END
		FROM generate_series(1, 100000) g,
		LATERAL (SELECT CASE WHEN g % 7 = 0 THEN 'IN_PROGRESS' WHEN g % 7 = 1 THEN 'PENDING'
			WHEN g % 7 = 2 THEN 'FAILED' ELSE 'COMPLETED' END AS s) st`, other)
	b.exec(t, `VACUUM ANALYZE tasks`)
	org := b.admin.OrgID
	cancelSQL, cancelArgs := postgres.BulkCountSQL(org, task.ActionCancel, task.ActionCancel.Statuses(), task.Filter{})
	for name, plan := range map[string]string{
		"overview.counts":        b.explain(t, statementSQL(t, "overview.counts"), org),
		"overview.queues":        b.explain(t, statementSQL(t, "overview.queues"), org),
		"overview.running":       b.explain(t, statementSQL(t, "overview.running"), org, []string{"w1"}, 5),
		"scheduler.held_by_type": b.explain(t, statementSQL(t, "scheduler.held_by_type"), []string{"demo.noop"}, []uuid.UUID{org}),
		"tasks.bulk_count":       b.explain(t, cancelSQL, cancelArgs...),
	} {
		require.Regexp(t, `(using|on) tasks_running\b`, plan, name)
		require.NotContains(t, plan, "Seq Scan on tasks", name+"\n"+plan)
		if name == "overview.counts" || name == "tasks.bulk_count" {
			require.Regexp(t, `(using|on) tasks_org_status\b`, plan, name)
		}
	}
}

// The relay's claim is planned for the outbox as it is at each batch. The
// relay plans its statements when it connects, when the outbox is mostly
// empty; a claim planned then scanned and sorted a whole backlog for each
// batch of it.
func TestTheRelayClaimIsPlannedForTheOutboxOfTheMoment(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `ANALYZE outbox`)
	require.NoError(t, err)
	pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: db.URL, MaxConns: 1, Plans: postgres.PlansGeneric,
		WarmUp: postgres.RelayHotStatements, MinConns: 1})
	require.NoError(t, err)
	t.Cleanup(pool.Close)

	// scans claims a batch on the relay's connection, the way claim
	// does, and returns how many scans of the whole outbox that took. The
	// counters are read inside the claim's transaction: outside one they
	// may still hold an earlier transaction's counts, which PostgreSQL
	// reports at most once a second, at a transaction's end.
	scans := func(claim func(*pgx.Conn) error) int64 {
		conn, err := pool.Acquire(ctx)
		require.NoError(t, err)
		defer conn.Release()
		_, err = conn.Exec(ctx, "BEGIN")
		require.NoError(t, err)
		n := grew(t, conn.Conn(), "seq_scan", "outbox", func() error { return claim(conn.Conn()) })
		_, err = conn.Exec(ctx, "ROLLBACK")
		require.NoError(t, err)
		return n
	}
	relayClaim := func(conn *pgx.Conn) error {
		// Its BEGIN, inside the one scans began, is only warned about.
		_, err := postgres.LockOutbox(ctx, conn, 500)
		return err
	}
	kept := func(conn *pgx.Conn) error { // the claim as a statement planned once
		rows, err := conn.Query(ctx, statementSQL(t, "outbox.claim"), 500)
		if err == nil {
			rows.Close()
			err = rows.Err()
		}
		return err
	}
	for range 6 {
		scans(relayClaim)
		scans(kept)
	}

	_, err = db.Pool.Exec(ctx, `INSERT INTO outbox (kind, org_id, task_id, task_type, attempt, task_version)
		SELECT 'task.run', `+testdb.OrgSQL+`, gen_random_uuid(), 'demo.noop', 0, 1 FROM generate_series(1, 20000)`)
	require.NoError(t, err)
	require.EqualValues(t, 1, scans(kept), "planned on the empty outbox, a claim scans it all (else this test shows nothing)")
	require.Zero(t, scans(relayClaim), "the relay's claim takes its batch along the outbox_available index")
}

// grew runs run in tx and returns how much a counter of table's grew
// meanwhile, read from the statistics the backend has not reported yet.
// tx must be inside a transaction throughout: within one they only grow,
// while between transactions PostgreSQL may report them (at most once a
// second) and start again from zero.
func grew(t *testing.T, tx interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, counter, table string, run func() error) int64 {
	t.Helper()
	read := func() int64 {
		var n int64
		require.NoError(t, tx.QueryRow(context.Background(), `SELECT coalesce(sum(`+counter+`), 0)
			FROM pg_stat_xact_user_tables WHERE relname = $1`, table).Scan(&n))
		return n
	}
	before := read()
	require.NoError(t, run())
	return read() - before
}

// A submission of a type no worker serves counts the org's unserved types
// that still have a PENDING task. Each type it remembers is looked up by
// type and org, in the indexes of admitted and of waiting tasks: asked of
// every PENDING task at once, the check read the org's whole backlog for
// each type it remembered (one long gone, a typo, the most), at every such
// submission.
func TestTheUnservedTypesCheckReadsOnlyTheTasksOfThoseTypes(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	b.exec(t, `INSERT INTO org_task_types (org_id, type)
		SELECT `+testdb.OrgSQL+`, unnest(ARRAY['typo.gone', 'demo.noop', 'demo.slow'])`)
	// A backlog of 20,000 PENDING tasks: a quarter wait for admission.
	b.exec(t, `INSERT INTO tasks (id, org_id, type, admitted)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, CASE WHEN g % 4 = 0 THEN 'demo.slow' ELSE 'demo.noop' END, g % 4 <> 0
		FROM generate_series(1, 20000) g`)
	b.exec(t, `VACUUM ANALYZE tasks`)

	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, statementSQL(t, "scope.set"), b.admin.OrgID.String(), "", "on")
	require.NoError(t, err)
	var n int
	var added bool
	read := grew(t, tx, "seq_tup_read + coalesce(idx_tup_fetch, 0)", "tasks", func() error {
		return tx.QueryRow(ctx, statementSQL(t, "org_task_types.admit"), b.admin.OrgID, []string{"typo.new"}, 10,
			[]*string{nil}, []*string{nil}).Scan(&n, &added)
	})
	require.True(t, added, "typo.new is a type more")
	require.Equal(t, 3, n, "demo.noop, demo.slow and typo.new wait unserved; typo.gone has no task left")
	require.Less(t, read, int64(100), "task rows read")
}

// A listing of an org's workflow runs, all of them or one workflow's, newest
// first, reads that org's runs only, and from its cursor on. Runs are kept
// for ever (a minutely schedule makes half a million a year): listed by
// walking every org's runs newest first, an org whose runs were older than
// another's read all of those first, at every page.
func TestAnOrgsRunsAreListedFromItsOwnRuns(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	other := b.db.Org(t, "other")
	// The org listed has 1,000 runs of two workflows; another org has
	// 30,000 newer ones.
	b.exec(t, `INSERT INTO workflow_runs (id, org_id, workflow, on_failure, memoize)
		SELECT conveyor_uuidv7(), `+testdb.OrgSQL+`, 'wf' || (g % 2), 'stop', false FROM generate_series(1, 1000) g`)
	b.exec(t, `INSERT INTO workflow_runs (id, org_id, workflow, on_failure, memoize)
		SELECT conveyor_uuidv7(), $1, 'wf' || (g % 2), 'stop', false FROM generate_series(1, 30000) g`, other)
	b.exec(t, `VACUUM ANALYZE workflow_runs`)
	var newest, middle uuid.UUID
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT id FROM workflow_runs WHERE org_id = `+testdb.OrgSQL+`
		ORDER BY id DESC LIMIT 1`).Scan(&newest))
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT id FROM workflow_runs WHERE org_id = `+testdb.OrgSQL+`
		ORDER BY id OFFSET 500 LIMIT 1`).Scan(&middle))

	for _, c := range []struct {
		workflow string
		after    uuid.UUID
		first    uuid.UUID // of the page, when known
	}{{"", uuid.Nil, newest}, {"wf1", uuid.Nil, uuid.Nil}, {"", middle, uuid.Nil}, {"wf0", middle, uuid.Nil}} {
		sql, args := postgres.RunsListSQL(b.admin.OrgID, c.workflow, c.after, 50)
		tx, err := b.db.Pool.Begin(ctx)
		require.NoError(t, err)
		_, err = tx.Exec(ctx, statementSQL(t, "scope.set"), b.admin.OrgID.String(), "", "on")
		require.NoError(t, err)
		var ids []uuid.UUID
		read := grew(t, tx, "seq_tup_read + coalesce(idx_tup_fetch, 0)", "workflow_runs", func() error {
			rows, err := tx.Query(ctx, "SELECT id FROM (\n"+sql+"\n) r", args...)
			if err != nil {
				return err
			}
			ids, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
			return err
		})
		require.NoError(t, tx.Rollback(ctx))
		require.Len(t, ids, 50, "%+v", c)
		if c.first != uuid.Nil {
			require.Equal(t, c.first, ids[0], "%+v", c)
		}
		for i := range ids {
			if i > 0 {
				require.Less(t, ids[i].String(), ids[i-1].String(), "newest first")
			}
			if c.after != uuid.Nil {
				require.Less(t, ids[i].String(), c.after.String(), "after the cursor")
			}
		}
		require.Less(t, read, int64(500), "runs read for %+v", c)
	}
}

// A page of an org's tasks after a cursor reads the tasks from the cursor
// on. The listing may be merged with the tasks' primary key, walked newest
// first; told of the cursor on the listing alone, that walk began at the
// newest task, and a page deep in a large org read every newer task first
// (400,000 rows and 42,000 buffers, over a second, for a page of 50).
func TestAPageAfterACursorReadsTheTasksFromTheCursorOn(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	other := b.db.Org(t, "other")
	// 40,000 tasks, one a second, newest last; a fifth are another org's.
	b.exec(t, `INSERT INTO tasks (id, org_id, type, status, completed_at)
		SELECT (lpad(to_hex((extract(epoch FROM now() - g * interval '1 second') * 1000)::bigint), 12, '0')
				|| '7' || substr(md5(g::text), 1, 3) || '8' || substr(md5(g::text), 4, 15))::uuid,
			CASE WHEN g % 5 = 0 THEN $1 ELSE `+testdb.OrgSQL+` END, 'demo.noop', 'COMPLETED', now()
		FROM generate_series(1, 40000) g`, other)
	b.exec(t, `VACUUM ANALYZE tasks, task_listing`)
	var middle uuid.UUID
	require.NoError(t, b.db.Pool.QueryRow(ctx, `SELECT id FROM task_listing WHERE org_id = `+testdb.OrgSQL+`
		ORDER BY id DESC OFFSET 20000 LIMIT 1`).Scan(&middle))

	sql, args := postgres.ListSQL(b.admin.OrgID, task.ListFilter{After: middle, Limit: 50})
	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, statementSQL(t, "scope.set"), b.admin.OrgID.String(), "", "on")
	require.NoError(t, err)
	var ids []uuid.UUID
	read := grew(t, tx, "seq_tup_read + coalesce(idx_tup_fetch, 0)", "tasks", func() error {
		rows, err := tx.Query(ctx, "SELECT id FROM (\n"+sql+"\n) l", args...)
		if err != nil {
			return err
		}
		ids, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
		return err
	})
	require.Len(t, ids, 50)
	for i := range ids {
		require.Less(t, ids[i].String(), middle.String(), "after the cursor")
		if i > 0 {
			require.Less(t, ids[i].String(), ids[i-1].String(), "newest first")
		}
	}
	require.Less(t, read, int64(1000), "task rows read")
}

// A bulk action's pick reads the tasks it matches through the indexes its
// count took when they are few. Ordered by id alone, it walked the primary
// key from the oldest task: behind a few tasks scheduled long ago, a
// cancel of an org's backlog read every task ever kept to reach it.
func TestABulkActionPicksFewMatchesThroughTheirIndexes(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	// 40,000 tasks, one a second, newest last: the newest 3,000 PENDING,
	// and of the older ones, every 1,000th PENDING (scheduled for later);
	// the rest COMPLETED.
	b.exec(t, `INSERT INTO tasks (id, org_id, type, status, next_run_at, completed_at)
		SELECT (lpad(to_hex((extract(epoch FROM now() - g * interval '1 second') * 1000)::bigint), 12, '0')
				|| '7' || substr(md5(g::text), 1, 3) || '8' || substr(md5(g::text), 4, 15))::uuid,
			`+testdb.OrgSQL+`, 'demo.noop', s, now() + interval '1 day',
			CASE WHEN s = 'COMPLETED' THEN now() END
		FROM generate_series(1, 40000) g,
		LATERAL (SELECT CASE WHEN g <= 3000 OR g % 1000 = 0 THEN 'PENDING' ELSE 'COMPLETED' END AS s) st`)
	b.exec(t, `VACUUM ANALYZE tasks`)
	statuses := task.ActionCancel.Statuses()
	countSQL, countArgs := postgres.BulkCountSQL(b.admin.OrgID, task.ActionCancel, statuses, task.Filter{})

	tx, err := b.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = tx.Rollback(ctx) }()
	_, err = tx.Exec(ctx, statementSQL(t, "scope.set"), b.admin.OrgID.String(), "", "on")
	require.NoError(t, err)
	var matched int
	require.NoError(t, tx.QueryRow(ctx, countSQL, countArgs...).Scan(&matched))
	require.Equal(t, 3037, matched)
	pickSQL, pickArgs := postgres.BulkPickSQL(b.admin.OrgID, task.ActionCancel, statuses, task.Filter{}, 100, nil, matched)
	var picked []uuid.UUID
	read := grew(t, tx, "seq_tup_read + coalesce(idx_tup_fetch, 0)", "tasks", func() error {
		rows, err := tx.Query(ctx, pickSQL, pickArgs...)
		if err != nil {
			return err
		}
		picked, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (uuid.UUID, error) {
			var id uuid.UUID
			var status string
			var version int
			var cancelPending bool
			var traceparent string
			return id, row.Scan(&id, &status, &version, &cancelPending, &traceparent)
		})
		return err
	})
	require.NoError(t, tx.Rollback(ctx))
	var oldest []uuid.UUID
	rows, err := b.db.Pool.Query(ctx, `SELECT id FROM tasks WHERE status = 'PENDING' ORDER BY id LIMIT 100`)
	require.NoError(t, err)
	oldest, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	require.Equal(t, oldest, picked, "the first matches in id order")
	require.Less(t, read, int64(2*matched), "task rows read")

	// The action itself cancels those.
	res, err := b.api.Bulk(ctx, b.admin, task.Bulk{Action: task.ActionCancel, Limit: 100}, nil)
	require.NoError(t, err)
	require.Equal(t, task.BulkResult{Matched: 3037, Changed: 100, More: true}, res)
	var cancelled []uuid.UUID
	rows, err = b.db.Pool.Query(ctx, `SELECT id FROM tasks WHERE status = 'CANCELLED' ORDER BY id`)
	require.NoError(t, err)
	cancelled, err = pgx.CollectRows(rows, pgx.RowTo[uuid.UUID])
	require.NoError(t, err)
	require.Equal(t, oldest, cancelled)
}
