package postgres_test

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// The lifecycle statement meets each change's rule once, before it joins
// the tasks. Under a generic plan, as the worker, the relay and the
// maintenance run their statements, PostgreSQL otherwise joined the rules
// last and built every rule again for each task: a third of the
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
	}
	args, _, err := postgres.ApplyArgs(changes)
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
	require.Equal(t, len(ids), b.count(t, `SELECT count(*) FROM tasks WHERE status = 'COMPLETED' AND id = ANY($1)`, ids),
		"the plan explained is the one that ran")
}
