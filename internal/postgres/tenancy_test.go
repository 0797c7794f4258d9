package postgres_test

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// tenantPool connects to db as the API's tenant pool does.
func tenantPool(t *testing.T, db *testdb.DB) *pgxpool.Pool {
	t.Helper()
	pool, err := postgres.Open(context.Background(), postgres.PoolConfig{URL: db.URL, MaxConns: 2, Role: postgres.TenantRole})
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

func submit(t *testing.T, store *postgres.APIStore, p auth.Principal, payload string, visibility ...string) task.Task {
	t.Helper()
	sub, err := task.NewSubmission(task.SubmitInput{Type: "demo.noop", Payload: json.RawMessage(payload), Visibility: visibility},
		task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	res, err := store.Submit(context.Background(), p, sub, nil)
	require.NoError(t, err)
	return res.Task
}

// A connection of the tenant role that no caller's scope was set on sees
// no org's rows and can write none: forgetting the scope fails closed.
func TestTenantRoleWithoutAScopeSeesNothing(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	_, admin := db.Admin(t)
	submit(t, postgres.NewAPIStore(db.Pool, nil), admin, `{"n":1}`)

	pool := tenantPool(t, db)
	ctx := context.Background()
	for _, table := range []string{"tasks", "task_events", "task_idempotency_keys", "orgs", "users", "api_keys",
		"org_roles", "org_role_memberships", "api_key_roles", "outbox"} {
		var n int
		require.NoError(t, pool.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n), table)
		require.Zero(t, n, table)
	}
	_, err := pool.Exec(ctx, `INSERT INTO tasks (id, org_id, type) VALUES ($1, $2, 'demo.noop')`, uuid.New(), admin.OrgID)
	require.ErrorContains(t, err, "row-level security")
	for _, change := range []string{`UPDATE outbox SET attempts = 0`, `DELETE FROM outbox`} {
		_, err = pool.Exec(ctx, change)
		require.ErrorContains(t, err, "permission denied", "the API only adds to the outbox (and counts its own rows)")
	}
}

// Inside a caller's scope, a statement that names no org at all — the
// forgotten WHERE — still sees only the caller's org, and of its tasks only
// those the caller may see, with their events and results.
func TestScopeKeepsEveryTableInsideTheOrg(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	store := postgres.NewAPIStore(db.Pool, nil)
	_, adminA := db.Key(t, "org-a", auth.Admin)
	_, financeA := db.Key(t, "org-a", auth.Reader, "finance")
	_, readerA := db.Key(t, "org-a", auth.Reader)
	_, adminB := db.Key(t, "org-b", auth.Admin)
	open := submit(t, store, adminA, `{"n":1}`)
	restricted := submit(t, store, adminA, `{"n":2}`, "finance")
	submit(t, store, adminB, `{"n":1}`)
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO task_results (task_id, org_id, payload) VALUES ($1, $2, '{}'), ($3, $2, '{}')`,
		open.ID, adminA.OrgID, restricted.ID)
	require.NoError(t, err)

	pool := tenantPool(t, db)
	count := func(p auth.Principal, table string) int {
		var n int
		err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
			sc := p.Scope()
			seeAll := "off"
			if sc.SeeAll {
				seeAll = "on"
			}
			if _, err := tx.Exec(context.Background(), `SELECT set_config('conveyor.org_id', $1, true),
				set_config('conveyor.roles', $2, true), set_config('conveyor.see_all', $3, true)`,
				sc.OrgID.String(), strings.Join(sc.Roles, ","), seeAll); err != nil {
				return err
			}
			return tx.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n)
		})
		require.NoError(t, err)
		return n
	}
	for _, c := range []struct {
		who                   string
		p                     auth.Principal
		tasks, events, result int
	}{
		{"admin of A", adminA, 2, 2, 2},
		{"finance member of A", financeA, 2, 2, 2},
		{"reader of A", readerA, 1, 1, 1},
		{"admin of B", adminB, 1, 1, 0},
	} {
		require.Equal(t, c.tasks, count(c.p, "tasks"), c.who)
		require.Equal(t, c.events, count(c.p, "task_events"), c.who)
		require.Equal(t, c.result, count(c.p, "task_results"), c.who)
		require.Equal(t, c.tasks, count(c.p, "outbox"), c.who+": each task has its task.run message")
		require.Equal(t, 1, count(c.p, "orgs"), c.who)
	}
	require.Equal(t, 3, count(adminA, "api_keys"))
	require.Equal(t, 1, count(adminB, "api_keys"))

	// And the store's own reads agree.
	_, err = store.Get(context.Background(), readerA, restricted.ID)
	require.ErrorIs(t, err, task.ErrNotFound)
	_, err = store.Get(context.Background(), adminB, open.ID)
	require.ErrorIs(t, err, task.ErrNotFound)
	_, err = store.Events(context.Background(), adminB, open.ID, 10, 0)
	require.ErrorIs(t, err, task.ErrNotFound)
	got, err := store.Get(context.Background(), financeA, restricted.ID)
	require.NoError(t, err)
	require.Equal(t, []string{"finance"}, got.Visibility)
}

// Idempotency is per org: the same input in two orgs is two tasks, and
// the same key in two orgs names two tasks.
func TestIdempotencyIsPerOrg(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	store := postgres.NewAPIStore(db.Pool, nil)
	_, a := db.Key(t, "org-a", auth.Writer)
	_, b := db.Key(t, "org-b", auth.Writer)
	ta, tb := submit(t, store, a, `{"n":1}`), submit(t, store, b, `{"n":1}`)
	require.NotEqual(t, ta.ID, tb.ID)
	require.Equal(t, a.OrgID, ta.OrgID)
	require.Equal(t, b.OrgID, tb.OrgID)

	keyed := func(p auth.Principal) task.Submitted {
		sub, err := task.NewSubmission(task.SubmitInput{Type: "demo.noop", Payload: json.RawMessage(`{"k":1}`), IdempotencyKey: "k1"},
			task.Defaults{MaxAttempts: 3}, "")
		require.NoError(t, err)
		res, err := store.Submit(context.Background(), p, sub, nil)
		require.NoError(t, err)
		return res
	}
	ka, kb := keyed(a), keyed(b)
	require.True(t, ka.Created)
	require.True(t, kb.Created, "another org's key is no duplicate")
	require.NotEqual(t, ka.Task.ID, kb.Task.ID)
}

// The migration to orgs moves every existing row into an org per former
// tenant, losing none.
func TestMigrationMovesExistingRowsIntoAnOrg(t *testing.T) {
	t.Parallel()
	url := testdb.NewEmpty(t)
	ctx := context.Background()
	cc, err := pgx.ParseConfig(url)
	require.NoError(t, err)
	require.NoError(t, postgres.EnsureDatabase(ctx, cc))
	pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: url, MaxConns: 2})
	require.NoError(t, err)
	defer pool.Close()

	all, err := postgres.Migrations()
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`)
	require.NoError(t, err)
	for _, m := range all[:2] {
		_, err := pool.Exec(ctx, m.SQL)
		require.NoError(t, err, m.Name)
		_, err = pool.Exec(ctx, `INSERT INTO schema_migrations (version, name) VALUES ($1, $2)`, m.Version, m.Name)
		require.NoError(t, err)
	}
	_, err = pool.Exec(ctx, `
		INSERT INTO tasks (id, type, input_hash, idempotency_key) SELECT gen_random_uuid(), 'demo.noop', md5(g::text) || md5(g::text), 'k' || g
			FROM generate_series(1, 50) g;
		INSERT INTO task_events (task_id, status, state, progress, actor) SELECT id, 'PENDING', 'Queued', 0, 'API' FROM tasks;
		INSERT INTO task_results (task_id, payload) SELECT id, '{}' FROM tasks LIMIT 10;
		INSERT INTO task_idempotency_keys (tenant_id, type, key, task_id) SELECT tenant_id, type, idempotency_key, id FROM tasks;
		INSERT INTO outbox (kind, task_id, task_type, attempt, task_version) SELECT 'task.run', id, type, 0, 1 FROM tasks;`)
	require.NoError(t, err)

	applied, err := postgres.Migrate(ctx, pool, slog.New(slog.DiscardHandler))
	require.NoError(t, err)
	require.Contains(t, applied, 3)
	var orgs, tasks, events, results, keys, messages, orphans int
	require.NoError(t, pool.QueryRow(ctx, `SELECT (SELECT count(*) FROM orgs WHERE slug = 'default'), (SELECT count(*) FROM tasks),
		(SELECT count(*) FROM task_events), (SELECT count(*) FROM task_results), (SELECT count(*) FROM task_idempotency_keys),
		(SELECT count(*) FROM outbox),
		(SELECT count(*) FROM tasks t WHERE NOT EXISTS (SELECT 1 FROM orgs o WHERE o.id = t.org_id AND o.slug = 'default'))`).
		Scan(&orgs, &tasks, &events, &results, &keys, &messages, &orphans))
	require.Equal(t, []int{1, 50, 50, 10, 50, 50, 0}, []int{orgs, tasks, events, results, keys, messages, orphans})
}

// A pause is the org's, whoever asks for it: a writer's pause of a type
// withdraws its tasks restricted to roles the writer does not hold too,
// which would otherwise stay admitted and run while the rest wait.
func TestAWritersPauseHoldsBackTasksItCannotSee(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx := context.Background()
	store := postgres.NewAPIStore(db.Pool, nil)
	_, admin := db.Key(t, "org-a", auth.Admin)
	_, writer := db.Key(t, "org-a", auth.Writer)
	restricted := submit(t, store, admin, `{"n":1}`, "finance")
	open := submit(t, store, admin, `{"n":2}`)
	admitted := func() map[uuid.UUID]bool {
		rows, err := db.Pool.Query(ctx, `SELECT id, admitted FROM tasks WHERE id = ANY ($1)`, []uuid.UUID{restricted.ID, open.ID})
		require.NoError(t, err)
		m := map[uuid.UUID]bool{}
		var id uuid.UUID
		var a bool
		_, err = pgx.ForEachRow(rows, []any{&id, &a}, func() error { m[id] = a; return nil })
		require.NoError(t, err)
		return m
	}
	require.Equal(t, map[uuid.UUID]bool{restricted.ID: true, open.ID: true}, admitted())

	require.NoError(t, postgres.NewJobStore(tenantPool(t, db)).PauseType(ctx, writer, "demo.noop", true))
	require.Equal(t, map[uuid.UUID]bool{restricted.ID: false, open.ID: false}, admitted(),
		"every pending task of the type waits, the one the writer cannot see too")
}
