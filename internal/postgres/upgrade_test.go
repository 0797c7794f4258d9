package postgres_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
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

// migratedTo returns a pool on a new database migrated by hand up to
// version k, as a release of that time left it. Not postgres.Open: it
// prepares statements of the schema as it is now.
func migratedTo(t *testing.T, k int) (string, *pgxpool.Pool) {
	t.Helper()
	url := testdb.NewEmpty(t)
	ctx := context.Background()
	require.NoError(t, postgres.EnsureDatabaseURL(ctx, url))
	pool, err := pgxpool.New(ctx, url)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	all, err := postgres.Migrations()
	require.NoError(t, err)
	_, err = pool.Exec(ctx, `CREATE TABLE schema_migrations (version integer PRIMARY KEY, name text NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`)
	require.NoError(t, err)
	for _, m := range all {
		if m.Version > k {
			break
		}
		require.NoError(t, pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name)
			return err
		}), "migration %d", m.Version)
	}
	return url, pool
}

// upgradeTask is a task written before the upgrade, as the release of the
// time wrote it.
type upgradeTask struct {
	id      uuid.UUID
	status  string
	payload string
	hash    string
	key     string
}

// fillAt writes, in plain SQL matching the schema at version k, what a
// system running that release holds: tasks in every status (some with an
// input hash, some with an idempotency key, some restricted), their
// events, results and outbox messages, workers, and from the versions
// that have them orgs, users, roles, keys, jobs, waiting tasks, workflow
// runs, their nodes and datasets, and a parent waiting for its child.
func fillAt(t *testing.T, pool *pgxpool.Pool, k int) []upgradeTask {
	t.Helper()
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		t.Helper()
		_, err := pool.Exec(ctx, sql, args...)
		require.NoError(t, err, "%s", sql)
	}
	org := "'default'"
	orgCol := ""
	if k >= 3 {
		exec(`INSERT INTO orgs (slug, name) VALUES ('acme', 'Acme')`)
		org = "(SELECT id FROM orgs WHERE slug = 'acme')"
		orgCol = ", org_id"
		exec(`INSERT INTO users (org_id, external_id, email, role) VALUES (` + org + `, 'sub-1', 'a@acme.test', 'admin')`)
		exec(`INSERT INTO org_roles (org_id, slug, name) VALUES (` + org + `, 'ops', 'Ops')`)
		exec(`INSERT INTO org_role_memberships (role_id, user_id, org_id)
			SELECT r.id, u.id, r.org_id FROM org_roles r, users u`)
		exec(`INSERT INTO api_keys (org_id, name, role, prefix, secret_hash)
			VALUES (` + org + `, 'svc', 'writer', 'cvk_upgrade', sha256('secret'))`)
		exec(`INSERT INTO api_key_roles (key_id, role_id, org_id) SELECT k.id, r.id, k.org_id FROM api_keys k, org_roles r`)
		exec(`INSERT INTO org_task_types (org_id, type) VALUES (` + org + `, 'report.build')`)
	}
	exec(`INSERT INTO workers (id, hostname, pid, concurrency, types) VALUES ('w1', 'host', 1, 8, '{report.build}')`)
	exec(`INSERT INTO leaders (name, leader_id, expires_at) VALUES ('maintenance', 'w1', now() + interval '1 minute')`)
	if k >= 2 {
		exec(`INSERT INTO task_types (name) VALUES ('report.build')`)
	}

	var tasks []upgradeTask
	seq := 0
	for _, s := range []struct {
		status, state string
		progress      int
	}{{"PENDING", "Queued", 0}, {"IN_PROGRESS", "Running", 40}, {"COMPLETED", "Completed", 100},
		{"FAILED", "Failed", 10}, {"CANCELLED", "Cancelled", 0}} {
		for i := 1; i <= 3; i++ {
			seq++
			ut := upgradeTask{id: uuid.Must(uuid.NewV7()), status: s.status, payload: fmt.Sprintf(`{"n":%d}`, seq)}
			sub, err := task.NewSubmission(task.SubmitInput{Type: "report.build", Payload: []byte(ut.payload)},
				task.Defaults{MaxAttempts: 3}, "")
			require.NoError(t, err)
			switch i {
			case 1:
				ut.hash = sub.InputHash
			case 2:
				ut.key = fmt.Sprintf("key-%d", seq)
			}
			cols := `id, type, status, state, progress, payload, input_hash, idempotency_key, error, attempt, worker_id,
				lease_expires_at, started_at, completed_at`
			vals := `$1, 'report.build', $2, $3, $4, $5, nullif($6, ''), nullif($7, ''),
				CASE WHEN $2 = 'FAILED' THEN 'boom' END, CASE WHEN $2 = 'PENDING' THEN 0 ELSE 1 END,
				CASE WHEN $2 <> 'PENDING' THEN 'w1' END,
				CASE WHEN $2 = 'IN_PROGRESS' THEN now() + interval '1 minute' END,
				CASE WHEN $2 <> 'PENDING' THEN now() END,
				CASE WHEN $2 IN ('COMPLETED', 'FAILED', 'CANCELLED') THEN now() END`
			if k >= 3 {
				cols += ", org_id, visibility"
				vals += ", " + org + ", CASE WHEN $8 THEN '{ops}'::text[] ELSE '{}' END"
			}
			args := []any{ut.id, s.status, s.state, s.progress, ut.payload, ut.hash, ut.key}
			if k >= 3 {
				args = append(args, i == 3)
			}
			exec(`INSERT INTO tasks (`+cols+`) VALUES (`+vals+`)`, args...)
			tasks = append(tasks, ut)
		}
	}
	if k >= 6 {
		exec(`INSERT INTO jobs (org_id, name, type, schedule, config_hash, definition, next_tick_at, max_concurrency)
			VALUES (` + org + `, 'nightly', 'report.build', '0 3 * * *', repeat('a', 64), '{}', now(), 1)`)
		exec(`INSERT INTO type_limits (org_id, type, max_concurrency) VALUES (` + org + `, 'report.build', 5)`)
		// A tick of the job waiting for its slot, with a concurrency key.
		exec(`INSERT INTO tasks (id, org_id, type, status, state, admitted, job_id, scheduled_at, concurrency_key)
			VALUES (gen_random_uuid(), ` + org + `, 'report.build', 'PENDING', 'Waiting', false,
				(SELECT id FROM jobs), date_trunc('day', now()), 'k1')`)
	}
	if k >= 7 {
		exec(`INSERT INTO workflows (org_id, name, definition, config_hash) VALUES (` + org + `, 'etl', '{}', repeat('b', 64))`)
		running, done, failed := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
		extract, load, bad := uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7()), uuid.Must(uuid.NewV7())
		for _, r := range []struct {
			id     uuid.UUID
			status string
		}{{running, "RUNNING"}, {done, "COMPLETED"}, {failed, "FAILED"}} {
			exec(`INSERT INTO workflow_runs (id, org_id, workflow_id, workflow, status, on_failure, memoize, finished_at)
				VALUES ($1, `+org+`, (SELECT id FROM workflows), 'etl', $2, 'stop', true,
					CASE WHEN $2 <> 'RUNNING' THEN now() END)`, r.id, r.status)
		}
		node := `INSERT INTO tasks (id, org_id, type, status, state, progress, run_id, node, inputs, job_id,
			completed_at, worker_id, lease_expires_at, error)
			VALUES ($1, ` + org + `, 'report.build', $2, $3, 0, $4, $5, '{"params": {}}', (SELECT id FROM jobs),
				CASE WHEN $2 IN ('COMPLETED', 'FAILED') THEN now() END, CASE WHEN $2 = 'IN_PROGRESS' THEN 'w1' END,
				CASE WHEN $2 = 'IN_PROGRESS' THEN now() + interval '1 minute' END, CASE WHEN $2 = 'FAILED' THEN 'boom' END)`
		exec(node, extract, "COMPLETED", "Completed", running, "extract")
		exec(node, load, "IN_PROGRESS", "Running", running, "load")
		exec(node, bad, "FAILED", "Failed", failed, "extract")
		nodes := `INSERT INTO run_nodes (run_id, node, org_id, position, job_id, job, depends_on, output_datasets,
			state, task_id, memo_key, memoized_from)
			VALUES ($1, $2, ` + org + `, $3, (SELECT id FROM jobs), 'nightly', $4, $5, $6, $7, repeat('c', 64), $8)`
		exec(nodes, running, "extract", 0, []string{}, []string{"raw"}, "SUBMITTED", extract, nil)
		exec(nodes, running, "load", 1, []string{"extract"}, []string{}, "SUBMITTED", load, nil)
		exec(nodes, running, "report", 2, []string{"load"}, []string{}, "WAITING", nil, nil)
		// Memoized from the running run's task, naming (before 016, which
		// corrects it) another run as its source.
		source := running
		if k < 16 {
			source = failed
		}
		exec(nodes, done, "extract", 0, []string{}, []string{"raw"}, "MEMOIZED", extract, source)
		exec(nodes, failed, "extract", 0, []string{}, []string{}, "SUBMITTED", bad, nil)
		exec(nodes, failed, "load", 1, []string{"extract"}, []string{}, "SKIPPED", nil, nil)
		exec(`INSERT INTO dataset_versions (org_id, dataset, run_id, node, task_id) VALUES (`+org+`, 'raw', $1, 'extract', $2)`,
			running, extract)
		exec(`INSERT INTO task_inputs (task_id, org_id, input_dataset, input_version)
			VALUES ($1, `+org+`, 'raw', (SELECT max(id) FROM dataset_versions))`, load)
		// A parent waiting for its child.
		parent := uuid.Must(uuid.NewV7())
		exec(`INSERT INTO tasks (id, org_id, type, status, state, admitted, attempt)
			VALUES ($1, `+org+`, 'report.build', 'PENDING', 'Waiting for children', false, 1)`, parent)
		exec(`INSERT INTO tasks (id, org_id, type, status, state, parent_id, child_key)
			VALUES (gen_random_uuid(), `+org+`, 'report.build', 'PENDING', 'Queued', $1, 'c1')`, parent)
	}

	// Every task's first event, and its latest where it moved on.
	exec(`INSERT INTO task_events (task_id, status, state, progress, actor` + orgCol + `)
		SELECT id, 'PENDING', 'Queued', 0, 'API'` + orgCol + ` FROM tasks`)
	eventErr := ""
	if k >= 4 {
		eventErr = ", error"
	}
	exec(`INSERT INTO task_events (task_id, status, state, progress, actor` + orgCol + eventErr + `)
		SELECT id, status, state, progress, 'WORKER'` + orgCol + eventErr + ` FROM tasks WHERE status <> 'PENDING'`)
	exec(`INSERT INTO task_results (task_id, payload` + orgCol + `)
		SELECT id, '{"rows": 3}'` + orgCol + ` FROM tasks WHERE status = 'COMPLETED'`)

	// The messages not relayed yet: runs of queued tasks, cancels of
	// running ones, and (before orgs) one of a task retention deleted.
	admitted := ""
	if k >= 6 {
		admitted = " AND admitted"
	}
	if k == 1 {
		exec(`INSERT INTO outbox (kind, task_id, routing_key, priority, body)
			SELECT 'task.run', id, type, priority, jsonb_build_object('task_id', id, 'type', type, 'attempt', attempt)
			FROM tasks WHERE status = 'PENDING'`)
		exec(`INSERT INTO outbox (kind, task_id, routing_key, priority, body)
			SELECT 'task.cancel', id, '', 9, jsonb_build_object('task_id', id, 'type', type, 'attempt', attempt)
			FROM tasks WHERE status = 'IN_PROGRESS'`)
		exec(`INSERT INTO outbox (kind, task_id, routing_key, priority, body)
			VALUES ('task.run', gen_random_uuid(), 'gone', 5, '{"type": "gone", "attempt": 0}')`)
	} else {
		exec(`INSERT INTO outbox (kind, task_id, task_type, attempt, task_version, priority` + orgCol + `)
			SELECT 'task.run', id, type, attempt, version, priority` + orgCol + ` FROM tasks WHERE status = 'PENDING'` + admitted)
		exec(`INSERT INTO outbox (kind, task_id, task_type, attempt, task_version, priority` + orgCol + `)
			SELECT 'task.cancel', id, type, attempt, version, 9` + orgCol + ` FROM tasks WHERE status = 'IN_PROGRESS'`)
		if k == 2 {
			exec(`INSERT INTO outbox (kind, task_id, task_type, attempt, task_version, priority)
				VALUES ('task.run', gen_random_uuid(), 'gone', 0, 1, 5)`)
		}
	}

	// Idempotency keys: the key a task was made with, and a second key
	// that found the same task by its input.
	switch {
	case k == 2:
		exec(`INSERT INTO task_idempotency_keys (tenant_id, type, key, task_id)
			SELECT 'default', type, k.key, id FROM tasks, LATERAL (VALUES (idempotency_key), ('alias-' || idempotency_key)) k(key)
			WHERE idempotency_key IS NOT NULL`)
	case k >= 3:
		exec(`INSERT INTO task_idempotency_keys (org_id, type, key, task_id)
			SELECT org_id, type, k.key, id FROM tasks, LATERAL (VALUES (idempotency_key), ('alias-' || idempotency_key)) k(key)
			WHERE idempotency_key IS NOT NULL`)
	}
	if k >= 11 {
		exec(`INSERT INTO task_input_hashes (org_id, type, input_hash, task_id)
			SELECT org_id, type, input_hash, id FROM tasks WHERE input_hash IS NOT NULL`)
	}
	return tasks
}

// An upgrade from every earlier version, with data in it: each later
// migration applies to the rows the release of the time wrote, and leaves
// them whole and consistent, and the current statements then serve them
// (a repeated input or key finds its task, a failed task is retried).
func TestUpgradeWithDataFromEarlierVersions(t *testing.T) {
	t.Parallel()
	for _, k := range []int{1, 2, 6, 10, 14, 18} {
		t.Run(fmt.Sprintf("from_%03d", k), func(t *testing.T) {
			t.Parallel()
			ctx := context.Background()
			url, raw := migratedTo(t, k)
			tasks := fillAt(t, raw, k)
			count := func(table string) int {
				t.Helper()
				var n int
				require.NoError(t, raw.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n))
				return n
			}
			before := map[string]int{}
			for _, table := range []string{"tasks", "task_events", "task_results", "outbox"} {
				before[table] = count(table)
			}
			ran, err := postgres.Migrate(ctx, raw, slog.New(slog.NewTextHandler(io.Discard, nil)))
			require.NoError(t, err)
			all, err := postgres.Migrations()
			require.NoError(t, err)
			require.Len(t, ran, len(all)-k)

			// Nothing lost but the messages of tasks already gone.
			orphans := 0
			if k < 3 {
				orphans = 1
			}
			require.Equal(t, before["tasks"], count("tasks"))
			require.Equal(t, before["task_events"], count("task_events"))
			require.Equal(t, before["task_results"], count("task_results"))
			require.Equal(t, before["outbox"]-orphans, count("outbox"))

			// Each backfill is complete and agrees with the tasks.
			for name, sql := range map[string]string{
				"unlisted task": `SELECT count(*) FROM tasks t
					WHERE NOT EXISTS (SELECT 1 FROM task_listing l WHERE l.org_id = t.org_id AND l.id = t.id AND l.type = t.type)`,
				"hash without its row": `SELECT count(*) FROM tasks t WHERE t.input_hash IS NOT NULL AND NOT EXISTS (
					SELECT 1 FROM task_input_hashes h WHERE (h.org_id, h.type, h.input_hash, h.task_id) = (t.org_id, t.type, t.input_hash, t.id))`,
				"key without its row": `SELECT count(*) FROM tasks t WHERE t.idempotency_key IS NOT NULL AND NOT EXISTS (
					SELECT 1 FROM task_idempotency_keys k WHERE (k.org_id, k.type, k.key, k.task_id) = (t.org_id, t.type, t.idempotency_key, t.id))`,
				"event of another org":  `SELECT count(*) FROM task_events e JOIN tasks t ON t.id = e.task_id WHERE e.org_id <> t.org_id`,
				"result of another org": `SELECT count(*) FROM task_results r JOIN tasks t ON t.id = r.task_id WHERE r.org_id <> t.org_id`,
				"message of another org or none": `SELECT count(*) FROM outbox o LEFT JOIN tasks t ON t.id = o.task_id
					WHERE t.org_id IS DISTINCT FROM o.org_id`,
				"key of another org": `SELECT count(*) FROM task_idempotency_keys k JOIN tasks t ON t.id = k.task_id WHERE k.org_id <> t.org_id`,
				"node memoized from elsewhere": `SELECT count(*) FROM run_nodes n JOIN tasks t ON t.id = n.task_id
					WHERE n.state = 'MEMOIZED' AND n.memoized_from IS DISTINCT FROM t.run_id`,
				"index not valid": `SELECT count(*) FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
					WHERE c.relnamespace = 'public'::regnamespace AND NOT (i.indisvalid AND i.indisready)`,
			} {
				var n int
				require.NoError(t, raw.QueryRow(ctx, sql).Scan(&n), name)
				require.Zero(t, n, name)
			}
			rows, err := raw.Query(ctx, `SELECT conname FROM pg_constraint
				WHERE connamespace = 'public'::regnamespace AND NOT convalidated ORDER BY conname`)
			require.NoError(t, err)
			unvalidated, err := pgx.CollectRows(rows, pgx.RowTo[string])
			require.NoError(t, err)
			require.Equal(t, []string{"task_results_payload_size"}, unvalidated, "only the bound left unchecked on purpose")
			var slug string
			require.NoError(t, raw.QueryRow(ctx, `SELECT string_agg(DISTINCT o.slug, ',') FROM tasks t JOIN orgs o ON o.id = t.org_id`).Scan(&slug))
			if k < 3 {
				require.Equal(t, "default", slug, "the tasks of the default tenant moved into its org")
			} else {
				require.Equal(t, "acme", slug)
			}

			// The current release serves them.
			pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: url})
			require.NoError(t, err)
			defer pool.Close()
			dir := postgres.NewDirectory(pool)
			orgID, err := dir.EnsureOrg(ctx, slug)
			require.NoError(t, err)
			admin := auth.Principal{Kind: auth.KindDev, Name: "upgrade", OrgID: orgID, OrgSlug: slug, Role: auth.Admin}
			store := postgres.NewAPIStore(pool, nil)
			listed, err := store.List(ctx, admin, task.ListFilter{Limit: 500})
			require.NoError(t, err)
			require.Len(t, listed, before["tasks"])
			_, err = store.Overview(ctx, admin, nil)
			require.NoError(t, err)
			for _, ut := range tasks {
				got, err := store.Get(ctx, admin, ut.id)
				require.NoError(t, err)
				require.Equal(t, ut.status, string(got.Status))
				if ut.status != "PENDING" || (ut.hash == "" && ut.key == "") {
					continue
				}
				again, err := store.Submit(ctx, admin, submission(t, orgID, ut), nil)
				require.NoError(t, err)
				require.False(t, again.Created, "the repeated submission of %s made a new task", ut.payload)
				require.Equal(t, ut.id, again.Task.ID)
			}
			for _, ut := range tasks {
				if ut.status == "FAILED" {
					retried, err := store.Retry(ctx, admin, ut.id, nil)
					require.NoError(t, err)
					require.Equal(t, task.StatusPending, retried.Status)
					break
				}
			}
			if k >= 3 {
				rec, err := dir.KeyByPrefix(ctx, "cvk_upgrade")
				require.NoError(t, err)
				require.Equal(t, orgID, rec.OrgID)
				require.Equal(t, auth.Writer, rec.Role)
			}
		})
	}
}

// submission is ut submitted again, as a client retrying it would.
func submission(t *testing.T, org uuid.UUID, ut upgradeTask) task.Submission {
	t.Helper()
	sub, err := task.NewSubmission(task.SubmitInput{Type: "report.build", Payload: []byte(ut.payload),
		IdempotencyKey: ut.key}, task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	sub.OrgID = org
	return sub
}
