package postgres

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/wait"
	"github.com/conveyorhq/conveyor/migrations"
)

// migrationLockKey is the advisory lock that serialises migration runners;
// the number is "conveyor" read as ASCII.
const migrationLockKey = 0x636f6e7665796f72

var migrationName = regexp.MustCompile(`^(\d+)_([a-z0-9_]+)\.sql$`)

// ErrSchemaNewer is returned by Migrate when the database holds migrations
// this binary does not know: a newer release migrated it.
var ErrSchemaNewer = errors.New("the database schema is newer than this binary")

// ErrSchemaBehind is returned by CheckSchema while migrations this binary
// needs are not applied yet.
var ErrSchemaBehind = errors.New("the database schema is not migrated to this binary's yet")

// Migration is one embedded schema change.
type Migration struct {
	Version int
	Name    string
	SQL     string
}

// Migrations lists the embedded migrations in version order.
func Migrations() ([]Migration, error) {
	entries, err := fs.ReadDir(migrations.FS, ".")
	if err != nil {
		return nil, fmt.Errorf("read migrations: %w", err)
	}
	var out []Migration
	for _, e := range entries {
		m := migrationName.FindStringSubmatch(e.Name())
		if m == nil {
			continue
		}
		version, _ := strconv.Atoi(m[1])
		body, err := fs.ReadFile(migrations.FS, e.Name())
		if err != nil {
			return nil, fmt.Errorf("read migration %s: %w", e.Name(), err)
		}
		out = append(out, Migration{Version: version, Name: m[2], SQL: string(body)})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Version < out[j].Version })
	for i := 1; i < len(out); i++ {
		if out[i].Version == out[i-1].Version {
			return nil, fmt.Errorf("two migrations numbered %d", out[i].Version)
		}
	}
	return out, nil
}

// MigrateConfig bounds how long a migration may queue for a table's lock.
// A statement that waits for a lock makes every later statement on the
// table wait behind it: an ALTER TABLE on tasks queued behind a long
// transaction (a report, a psql session left open) would stop every
// submission, claim and listing for as long as that transaction lasts.
// So each migration runs with a short lock_timeout; one that runs out is
// rolled back, the table is given back to the service, and the migration
// is tried again after a backoff, up to LockTries times.
type MigrateConfig struct {
	// LockTimeout is each migration's lock_timeout: the longest one of its
	// statements waits for a lock, and so the longest the statements
	// queued behind it wait, per try. 0: DefaultMigrationLockTimeout.
	LockTimeout time.Duration
	// LockTries is how many times a migration whose lock wait runs out is
	// tried before Migrate gives up. 0: 10.
	LockTries int
	// LockBackoff is the first wait between two tries, doubled (with
	// jitter) at each try up to 30 s. 0: 1 s.
	LockBackoff time.Duration
}

// DefaultMigrationLockTimeout is a migration's lock_timeout when
// MigrateConfig leaves it unset.
const DefaultMigrationLockTimeout = 5 * time.Second

const (
	defaultMigrationLockTries   = 10
	defaultMigrationLockBackoff = time.Second
	maxMigrationLockBackoff     = 30 * time.Second
)

// codeLockNotAvailable: a statement's lock wait ran out (lock_timeout).
const codeLockNotAvailable = "55P03"

// Migrate applies every embedded migration not yet recorded in
// schema_migrations, with MigrateConfig's defaults (see MigrateWith).
func Migrate(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger) ([]int, error) {
	return MigrateWith(ctx, pool, log, MigrateConfig{})
}

// MigrateWith applies every embedded migration not yet recorded in
// schema_migrations, each in its own transaction, under a session advisory
// lock so that any number of processes may call it at once. A migration
// waits for the locks it needs at most cfg.LockTimeout per try (see
// MigrateConfig). It returns the versions it applied.
func MigrateWith(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger, cfg MigrateConfig) ([]int, error) {
	all, err := Migrations()
	if err != nil {
		return nil, err
	}
	return migrate(ctx, pool, log, cfg, all)
}

// migrate applies those of all not yet applied.
func migrate(ctx context.Context, pool *pgxpool.Pool, log *slog.Logger, cfg MigrateConfig, all []Migration) ([]int, error) {
	cfg.LockTimeout = cmp.Or(cfg.LockTimeout, DefaultMigrationLockTimeout)
	cfg.LockTries = cmp.Or(cfg.LockTries, defaultMigrationLockTries)
	cfg.LockBackoff = cmp.Or(cfg.LockBackoff, defaultMigrationLockBackoff)
	conn, err := pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("acquire connection for migrations: %w", err)
	}
	defer conn.Release()

	// The pool's statement timeout (the API's request timeout) is not a
	// migration's: on a large table a migration runs for minutes, and the
	// other runners wait for the lock as long. The connection gets the
	// pool's timeout back before it returns to the pool.
	if _, err := conn.Exec(ctx, "SET statement_timeout = 0"); err != nil {
		return nil, fmt.Errorf("lift statement timeout for migrations: %w", err)
	}
	defer func() {
		if _, err := conn.Exec(context.WithoutCancel(ctx), "RESET statement_timeout"); err != nil {
			// Never hand the pool a connection without its bound.
			_ = conn.Conn().Close(context.WithoutCancel(ctx))
		}
	}()

	if _, err := conn.Exec(ctx, "SELECT pg_advisory_lock($1)", int64(migrationLockKey)); err != nil {
		return nil, fmt.Errorf("take migration lock: %w", err)
	}
	defer func() {
		// A fresh context: the lock must go even when ctx is done.
		_, _ = conn.Exec(context.WithoutCancel(ctx), "SELECT pg_advisory_unlock($1)", int64(migrationLockKey))
	}()

	if _, err := conn.Exec(ctx, `CREATE TABLE IF NOT EXISTS schema_migrations (
		version    integer PRIMARY KEY,
		name       text        NOT NULL,
		applied_at timestamptz NOT NULL DEFAULT now())`); err != nil {
		return nil, fmt.Errorf("create schema_migrations: %w", err)
	}
	rows, err := conn.Query(ctx, "SELECT version FROM schema_migrations")
	if err != nil {
		return nil, fmt.Errorf("read schema_migrations: %w", err)
	}
	applied, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return nil, fmt.Errorf("read schema_migrations: %w", err)
	}
	if err := schemaNotNewer(applied, all); err != nil {
		return nil, err
	}
	done := make(map[int]bool, len(applied))
	for _, v := range applied {
		done[v] = true
	}

	var watch *lockWatch
	defer func() { watch.close(context.WithoutCancel(ctx)) }()
	var ran []int
	for _, m := range all {
		if done[m.Version] {
			continue
		}
		if watch == nil {
			watch = watchLocks(ctx, pool, int32(conn.Conn().PgConn().PID()), cfg.LockTimeout, log)
		}
		if err := applyMigration(ctx, conn.Conn(), m, cfg, watch, log); err != nil {
			return ran, fmt.Errorf("apply migration %03d_%s: %w", m.Version, m.Name, err)
		}
		log.InfoContext(ctx, "applied migration", "version", m.Version, "name", m.Name)
		ran = append(ran, m.Version)
	}
	return ran, nil
}

// applyMigration runs m and records it, in one transaction, again while
// its lock_timeout runs out, up to cfg.LockTries times.
func applyMigration(ctx context.Context, conn *pgx.Conn, m Migration, cfg MigrateConfig, watch *lockWatch, log *slog.Logger) error {
	b := wait.Backoff(cfg.LockBackoff, maxMigrationLockBackoff)
	// In whole milliseconds, and never 0, which would be no timeout.
	lockTimeout := strconv.FormatInt(max(cfg.LockTimeout.Milliseconds(), 1), 10) + "ms"
	// The sessions last seen blocking m, in this try or an earlier one.
	var blockers string
	for try := 1; ; try++ {
		watch.start(ctx)
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			// Local to the transaction: the advisory lock above is
			// waited for as long as another runner migrates.
			if _, err := tx.Exec(ctx, "SELECT set_config('lock_timeout', $1, true)", lockTimeout); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, m.SQL); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", m.Version, m.Name)
			return err
		})
		if seen := watch.stop(); seen != "" {
			blockers = seen
		}
		if pgCode(err) != codeLockNotAvailable {
			return err
		}
		held := cmp.Or(blockers, "another session (which one was not seen)")
		if try >= cfg.LockTries {
			return fmt.Errorf("gave up after %d tries, each waiting %s for a lock held by %s: "+
				"end that session's transaction, or migrate again once it is done: %w", try, cfg.LockTimeout, held, err)
		}
		retry := b.NextBackOff()
		log.WarnContext(ctx, "migration waiting for a lock held by another session; rolled back to let the others through, retrying",
			"version", m.Version, "name", m.Name, "try", try, "tries", cfg.LockTries, "lock_timeout", cfg.LockTimeout,
			"blocked_by", held, "retry_in", retry)
		if !wait.Sleep(ctx, retry) {
			return fmt.Errorf("waiting for a lock held by %s: %w", held, context.Cause(ctx))
		}
	}
}

// lockWatch reads, from a session of its own, which sessions the
// migration's session waits for while it waits: pg_blocking_pids answers
// only during the wait, and once the lock_timeout ends it the error does
// not say who held the lock. A nil lockWatch (no second session could be
// opened) sees nothing.
type lockWatch struct {
	conn  *pgx.Conn
	pid   int32
	every time.Duration

	cancel context.CancelFunc
	done   chan struct{}
	seen   string
}

// blockersSQL describes the sessions that $1 waits for. It leaves out
// their statements, which may carry data. Without pg_read_all_stats,
// another role's session shows no client, state or transaction start.
const blockersSQL = `SELECT a.pid, coalesce(a.usename, ''), coalesce(a.application_name, ''),
	CASE WHEN a.client_port = -1 THEN 'local socket' ELSE coalesce(host(a.client_addr), 'unknown') END,
	coalesce(a.state, 'state unknown'), extract(epoch FROM now() - a.xact_start)::float8
FROM pg_stat_activity a WHERE a.pid = ANY (pg_blocking_pids($1)) ORDER BY a.pid`

// watchLocks opens the watching session, or returns nil (and says so) if
// it cannot: the migrations run all the same.
func watchLocks(ctx context.Context, pool *pgxpool.Pool, pid int32, lockTimeout time.Duration, log *slog.Logger) *lockWatch {
	cc := pool.Config().ConnConfig.Copy()
	cc.Tracer = nil
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err != nil {
		log.WarnContext(ctx, "cannot open a session to watch the migrations' lock waits; a wait that runs out will not name its blocker",
			"error", err)
		return nil
	}
	// Several looks per lock_timeout, so that a wait is seen.
	return &lockWatch{conn: conn, pid: pid, every: min(max(lockTimeout/4, 10*time.Millisecond), time.Second)}
}

// start looks, until stop, at what the migration's session waits for.
func (w *lockWatch) start(ctx context.Context) {
	if w == nil {
		return
	}
	ctx, w.cancel = context.WithCancel(ctx)
	w.done, w.seen = make(chan struct{}), ""
	go func() {
		defer close(w.done)
		t := time.NewTicker(w.every)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if seen := w.blockers(ctx); seen != "" {
				w.seen = seen
			}
		}
	}()
}

// stop ends the looking and returns the sessions last seen blocking the
// migration, or "".
func (w *lockWatch) stop() string {
	if w == nil {
		return ""
	}
	w.cancel()
	<-w.done
	return w.seen
}

func (w *lockWatch) close(ctx context.Context) {
	if w != nil {
		_ = w.conn.Close(ctx)
	}
}

// blockers describes the sessions the migration's session waits for, or
// returns "" when it waits for none (or they cannot be read).
func (w *lockWatch) blockers(ctx context.Context) string {
	// Not cut short by stop (a statement cancelled half-way could leave
	// its cancel request to hit the next one), only bounded.
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	rows, err := w.conn.Query(ctx, blockersSQL, w.pid)
	if err != nil {
		return ""
	}
	defer rows.Close()
	var out []string
	for rows.Next() {
		var (
			pid                  int32
			user, app, client, s string
			age                  *float64
		)
		if err := rows.Scan(&pid, &user, &app, &client, &s, &age); err != nil {
			return ""
		}
		open := ""
		if age != nil {
			open = fmt.Sprintf(", transaction open for %s", time.Duration(*age*float64(time.Second)).Round(time.Second))
		}
		out = append(out, fmt.Sprintf("session pid %d (user %q, application %q, client %s, %s%s)", pid, user, app, client, s, open))
	}
	if rows.Err() != nil {
		return ""
	}
	return strings.Join(out, ", ")
}

// schemaNotNewer refuses a database a newer release migrated. This binary's
// statements were written for its own schema: against a newer one they may
// fail, or worse, run and skip what the newer schema expects of them (an
// index a guarantee moved away from, a column a trigger no longer keeps),
// and there is no migration down. An operator rolling back restores the
// database from before the upgrade; one rolling forward runs the new
// release everywhere.
func schemaNotNewer(applied []int, known []Migration) error {
	if len(applied) == 0 {
		return nil
	}
	newest := slices.Max(applied)
	latest := 0
	if len(known) > 0 {
		latest = known[len(known)-1].Version
	}
	if newest > latest {
		return fmt.Errorf("%w: it is at migration %03d, this binary knows migrations up to %03d: run the release that migrated it, or a newer one",
			ErrSchemaNewer, newest, latest)
	}
	return nil
}

// CheckSchema says whether the database's schema is this binary's, for a
// service that does not migrate it (the relay): ErrSchemaBehind while
// migrations remain (the api, a worker or `api migrate` applies them),
// ErrSchemaNewer once a newer release has migrated it.
func CheckSchema(ctx context.Context, pool *pgxpool.Pool) error {
	all, err := Migrations()
	if err != nil {
		return err
	}
	rows, err := pool.Query(ctx, "SELECT version FROM schema_migrations")
	if err != nil {
		return schemaReadError(err)
	}
	applied, err := pgx.CollectRows(rows, pgx.RowTo[int])
	if err != nil {
		return schemaReadError(err)
	}
	if err := schemaNotNewer(applied, all); err != nil {
		return err
	}
	for _, m := range all {
		if !slices.Contains(applied, m.Version) {
			return fmt.Errorf("%w: migration %03d_%s is not applied", ErrSchemaBehind, m.Version, m.Name)
		}
	}
	return nil
}

func schemaReadError(err error) error {
	if pgCode(err) == codeUndefinedTable {
		return fmt.Errorf("%w: no migration is applied", ErrSchemaBehind)
	}
	return fmt.Errorf("read schema_migrations: %w", err)
}
