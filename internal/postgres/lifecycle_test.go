package postgres_test

import (
	"context"
	"encoding/json"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// The statement for a batch that mixes transitions meets each change's
// rule once, before it joins the tasks. Under a generic plan, as the
// worker and the relay run their statements, PostgreSQL otherwise joined
// the rules last and built every rule again for each task: a third of the
// statement's time.
func TestApplyMeetsEachRuleOnce(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	// The plan that went wrong is the one over a table of a real size.
	b.exec(t, `INSERT INTO tasks (id, org_id, type, status, completed_at)
		SELECT gen_random_uuid(), `+testdb.OrgSQL+`, 'demo.noop', 'COMPLETED', now() FROM generate_series(1, 20000)`)
	ids := make([]uuid.UUID, 50)
	for i := range ids {
		ids[i] = b.pending(t, 3)
	}
	b.exec(t, `ANALYZE tasks`)
	claimed, err := b.worker.Claim(ctx, ids, "w1", time.Minute)
	require.NoError(t, err)
	require.Len(t, claimed, len(ids))
	changes := make([]task.Change, len(claimed))
	for i, c := range claimed {
		changes[i] = task.Change{TaskID: c.ID, Version: c.Version, Transition: task.Complete, Result: []byte(`{}`)}
		if i%2 == 1 {
			changes[i] = task.Change{TaskID: c.ID, Version: c.Version, Transition: task.Fail, Error: "boom"}
		}
	}
	args, err := postgres.ApplyArgs(changes)
	require.NoError(t, err)

	conn, err := b.db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	types := []string{"uuid[]", "int[]", "text[]", "int[]", "text[]", "text[]", "text[]", "bigint[]", "bigint[]", "text[]", "text[]", "text[]"}
	require.Len(t, args, len(types))
	// EXECUTE takes its arguments as SQL: PostgreSQL writes each one out.
	literals := make([]string, len(args))
	for i, a := range args {
		require.NoError(t, conn.QueryRow(ctx, `SELECT quote_literal($1::`+types[i]+`::text) || '::`+types[i]+`'`, a).Scan(&literals[i]))
	}
	for _, sql := range []string{
		`SET plan_cache_mode = force_generic_plan`,
		`PREPARE apply(` + strings.Join(types, ", ") + `) AS ` + statementSQL(t, "tasks.apply"),
	} {
		_, err := conn.Exec(ctx, sql, pgx.QueryExecModeSimpleProtocol)
		require.NoError(t, err)
	}
	rows, err := conn.Query(ctx, `EXPLAIN (ANALYZE) EXECUTE apply(`+strings.Join(literals, ", ")+`)`, pgx.QueryExecModeSimpleProtocol)
	require.NoError(t, err)
	lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	plan := strings.Join(lines, "\n")

	rules := regexp.MustCompile(`Values Scan on "\*VALUES\*".* loops=(\d+)\)`).FindAllStringSubmatch(plan, -1)
	require.NotEmpty(t, rules, plan)
	for _, r := range rules {
		require.Equal(t, "1", r[1], "the rules are built again per task:\n%s", plan)
	}
	require.Equal(t, len(ids), b.count(t, `SELECT count(*) FROM tasks WHERE status IN ('COMPLETED', 'FAILED') AND id = ANY($1)`, ids),
		"the plan explained is the one that ran")
}

// Each transition's statement is planned for its own rule alone: under a
// generic plan, as the worker, the relay and the maintenance run their
// statements, no rule's effect is left to be chosen row by row, and only a
// change that sends its task back to its queue asks the scheduler whether
// the task must wait.
func TestEachTransitionIsPlannedForItsRuleAlone(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	conn, err := b.db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	_, err = conn.Exec(ctx, `SET plan_cache_mode = force_generic_plan`)
	require.NoError(t, err)

	types := "uuid[], int[], text[], int[], text[], text[], text[], bigint[], bigint[], text[], text[], text[]"
	empty := strings.Repeat("'{}', ", 11) + "'{}'"
	effects := regexp.MustCompile(`'(keep|set|clear|fill|give-back|stamp)'::text`)
	for _, tr := range task.Transitions() {
		name := "apply_" + strings.ReplaceAll(string(tr), "-", "_")
		_, err := conn.Exec(ctx, `PREPARE `+name+`(`+types+`) AS `+statementSQL(t, "tasks.apply."+string(tr)),
			pgx.QueryExecModeSimpleProtocol)
		require.NoError(t, err, tr)
		rows, err := conn.Query(ctx, `EXPLAIN (VERBOSE) EXECUTE `+name+`(`+empty+`)`, pgx.QueryExecModeSimpleProtocol)
		require.NoError(t, err, tr)
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err, tr)
		plan := strings.Join(lines, "\n")

		require.NotRegexp(t, effects, plan, "%s chooses an effect per row", tr)
		r := task.Lifecycle[tr]
		asks := r.Message == outbox.KindRun && !r.Hold
		require.Equal(t, asks, strings.Contains(plan, "conveyor_must_wait"), "%s asks the scheduler:\n%s", tr, plan)
	}
}

// One call may carry changes of several transitions; each lands by its own
// rule, and a change that misses its fence changes nothing while the rest
// land.
func TestOneBatchAppliesEachChangeByItsRule(t *testing.T) {
	b := setupStores(t)
	ctx := context.Background()
	var leases []task.Lease
	for range 5 {
		leases = append(leases, b.claim(t, b.pending(t, 3), "w1"))
	}
	changes := []task.Change{
		{TaskID: leases[0].TaskID, Version: leases[0].Version, Transition: task.Complete, Result: json.RawMessage(`{"n":1}`)},
		{TaskID: leases[1].TaskID, Version: leases[1].Version, Transition: task.Fail, Error: "boom"},
		{TaskID: leases[2].TaskID, Version: leases[2].Version, Transition: task.RetryLater, Error: "again", Delay: time.Hour},
		{TaskID: leases[3].TaskID, Version: leases[3].Version, Transition: task.Progress, Progress: 40, State: "Step 2/5",
			Lease: time.Hour},
		{TaskID: leases[4].TaskID, Version: leases[4].Version - 1, Transition: task.Complete, Result: json.RawMessage(`{}`)},
	}
	out, errs, err := b.worker.Apply(ctx, changes)
	require.NoError(t, err)
	for i := range changes {
		require.NoError(t, errs[i])
		require.Equal(t, i == 4, out[i].Fenced, "change %d", i)
		if i < 4 {
			require.Equal(t, leases[i].Version+1, out[i].Version, "change %d", i)
		}
	}
	row := func(i int) string {
		return b.text(t, `SELECT concat_ws(' ', status, state, progress, coalesce(error, '-'),
			(SELECT payload::text FROM task_results WHERE task_id = t.id), next_run_at > now() + interval '50 minutes')
			FROM tasks t WHERE id = $1`, leases[i].TaskID)
	}
	require.Equal(t, `COMPLETED Completed 100 - {"n": 1} f`, row(0))
	require.Equal(t, `FAILED Failed 0 boom f`, row(1))
	require.Equal(t, `PENDING Retry scheduled 0 again t`, row(2))
	require.Equal(t, `IN_PROGRESS Step 2/5 40 - f`, row(3))
	require.Equal(t, `IN_PROGRESS Running 0 - f`, row(4))
	// Only the task sent back to its queue has a message waiting.
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox`))
	require.Equal(t, 1, b.count(t, `SELECT count(*) FROM outbox WHERE kind = 'task.run' AND task_id = $1`, leases[2].TaskID))
}
