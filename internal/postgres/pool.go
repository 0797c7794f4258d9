// Package postgres is Conveyor's PostgreSQL adapter: the pool, the embedded
// migrations, and every SQL statement the system runs, in stores named for
// the role that uses them — api_store.go (the HTTP API), relay_store.go (the
// outbox relay), worker_store.go (a worker's claims, writes and registry),
// maintenance_store.go (the elected maintenance leader), org_store.go (the
// admin API's keys, users and roles), directory.go (finding a key or a user
// before any org is known), registry_store.go (the worker registry, as the
// API shows it) — the one statement that applies a lifecycle
// transition (lifecycle.go), and the caller's scope every API transaction
// opens with (scope.go). Stores
// return domain types; pgx stays inside, except for the *pgxpool.Pool that
// Open hands to the binaries to build the stores with.
package postgres

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/exaring/otelpgx"
	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/task"
)

// Plans is how the server plans a pool's prepared statements.
type Plans uint8

const (
	// PlansAuto is PostgreSQL's default: five plans for the values of
	// their calls, then one for any values if it costs no more. The plan
	// kept was made for the tables as they were then.
	PlansAuto Plans = iota
	// PlansGeneric plans each statement once per connection: for
	// statements keyed by ids (the worker's claims and outcomes, the
	// relay's), whose best plan does not change with the tables' size and
	// which cost more to plan than to run.
	PlansGeneric
	// PlansCustom plans each statement at every call, for its values and
	// the tables' size at that moment: for background statements that
	// search tables by status (maintenance, scheduling), whose best plan
	// changes as a backlog comes and goes. A plan made while tasks was
	// small scans the whole table later, on every pass.
	PlansCustom
)

// planCacheModes are the plan_cache_mode settings of the Plans.
var planCacheModes = map[Plans]string{PlansGeneric: "force_generic_plan", PlansCustom: "force_custom_plan"}

// PoolConfig sizes and tunes a connection pool.
type PoolConfig struct {
	URL      string
	MaxConns int32
	// StatementTimeout, when set, bounds every statement on the server.
	StatementTimeout time.Duration
	// IdleTxTimeout, when set, ends a session left idle in a transaction
	// for longer, on the server (its locks are released).
	IdleTxTimeout time.Duration
	// Plans says how the server plans the pool's prepared statements.
	Plans Plans
	// WarmUp names statements (WorkerHotStatements, RelayHotStatements)
	// to plan on every new connection before it serves, and MinConns
	// connections are opened at once: the first tasks after a start do
	// not wait for connections and planning.
	WarmUp   []string
	MinConns int32
	// Role, when set, is the role every connection takes at start
	// (TenantRole for the API's org-scoped work: a statement run without a
	// caller's scope then sees no org's rows).
	Role string
	// TracerProvider, when set, traces every query, each span named after
	// its statement.
	TracerProvider trace.TracerProvider
}

// Open returns a pool connected to the database cfg.URL names, checked with
// a ping. It never creates the database: a mistyped DATABASE_URL must fail,
// not start an empty system (EnsureDatabase, used by `api migrate`, creates
// it on purpose).
func Open(ctx context.Context, cfg PoolConfig) (*pgxpool.Pool, error) {
	pc, err := pgxpool.ParseConfig(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("parse DATABASE_URL: %w", err)
	}
	if cfg.MaxConns > 0 {
		pc.MaxConns = cfg.MaxConns
	}
	// A cancelled context cancels the statement on the server too (pgx's
	// default only drops the socket, and the server would finish the
	// statement — and commit it — after the caller gave up).
	pc.ConnConfig.BuildContextWatcherHandler = func(conn *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.CancelRequestContextWatcherHandler{Conn: conn, DeadlineDelay: 5 * time.Second}
	}
	if mode, ok := planCacheModes[cfg.Plans]; ok {
		pc.ConnConfig.RuntimeParams["plan_cache_mode"] = mode
	}
	if cfg.Role != "" {
		pc.ConnConfig.RuntimeParams["role"] = cfg.Role
	}
	if cfg.StatementTimeout > 0 {
		pc.ConnConfig.RuntimeParams["statement_timeout"] = strconv.FormatInt(cfg.StatementTimeout.Milliseconds(), 10)
	}
	if cfg.IdleTxTimeout > 0 {
		pc.ConnConfig.RuntimeParams["idle_in_transaction_session_timeout"] = strconv.FormatInt(cfg.IdleTxTimeout.Milliseconds(), 10)
	}
	if cfg.TracerProvider != nil {
		pc.ConnConfig.Tracer = otelpgx.NewTracer(otelpgx.WithTracerProvider(cfg.TracerProvider),
			otelpgx.WithSpanNameFunc(spanName))
	}
	var warm func(context.Context, *pgx.Conn) error
	if len(cfg.WarmUp) > 0 {
		pc.MinConns = min(cfg.MinConns, pc.MaxConns)
		warm = warmUp(cfg.WarmUp)
	}
	pc.AfterConnect = afterConnect(warm)
	pool, err := pgxpool.NewWithConfig(ctx, pc)
	if err != nil {
		return nil, fmt.Errorf("create pool: %w", err)
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		if pgCode(err) == codeNoDatabase {
			return nil, fmt.Errorf("database %q does not exist: check DATABASE_URL, or create it with `api migrate`: %w", pc.ConnConfig.Database, err)
		}
		return nil, fmt.Errorf("ping database: %w", err)
	}
	return pool, nil
}

// warmUps are the hot statements of the worker and the relay, each with an
// input that makes it change nothing (empty arrays, a zero limit).
var warmUps = map[string][]any{
	"tasks.claim": {[]uuid.UUID{}, "", 0, "", "", ""},
	"tasks.apply." + string(task.Complete): {[]uuid.UUID{}, []int{}, []string{}, []int{}, []string{}, []string{},
		[]string{}, []int64{}, []int64{}, []string{}, []string{}, []string{}},
	"outbox.delete":         {[]int64{}},
	"tasks.stamp_published": {[]uuid.UUID{}},
}

// WorkerHotStatements and RelayHotStatements name what PoolConfig.WarmUp
// plans for each: what every task or every batch runs. A worker's other
// writes (progress, renewals, failures, batches that mix transitions) are
// planned on a connection when it first needs them: planning them all as
// well (the mixed batch's statement alone about 20 ms) held up each
// worker process's first tasks, on the cores those tasks needed.
var (
	WorkerHotStatements = []string{"tasks.claim", "tasks.apply." + string(task.Complete)}
	RelayHotStatements  = []string{"outbox.delete", "tasks.stamp_published"}
)

// warmUp runs the named statements once on a new connection, with an input
// that changes nothing, inside a transaction it rolls back: the server has
// then parsed and planned them before the first task needs them.
func warmUp(names []string) func(context.Context, *pgx.Conn) error {
	byName := map[string]string{}
	for _, st := range statements {
		byName[st.Name] = st.SQL
	}
	return func(ctx context.Context, conn *pgx.Conn) error {
		tx, err := conn.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(ctx) }()
		for _, name := range names {
			if _, err := tx.Exec(ctx, byName[name], warmUps[name]...); err != nil {
				return fmt.Errorf("warm up %s: %w", name, err)
			}
		}
		return nil
	}
}

// spanName names a database span after its statement, or after the SQL's
// first word for SQL of other origin (the migration runner's).
func spanName(sql string) string {
	if name := StatementName(sql); name != "" {
		return name
	}
	word, _, _ := strings.Cut(strings.TrimSpace(sql), " ")
	return strings.ToUpper(word)
}

// EnsureDatabase creates the database cc names when it does not exist. It is
// safe to call from several processes at once.
func EnsureDatabase(ctx context.Context, cc *pgx.ConnConfig) error {
	conn, err := pgx.ConnectConfig(ctx, cc)
	if err == nil {
		return conn.Close(ctx)
	}
	if pgCode(err) != codeNoDatabase {
		return fmt.Errorf("connect to database %q: %w", cc.Database, err)
	}
	admin := cc.Copy()
	admin.Database = "postgres"
	adminConn, err := pgx.ConnectConfig(ctx, admin)
	if err != nil {
		return fmt.Errorf("connect to maintenance database to create %q: %w", cc.Database, err)
	}
	defer adminConn.Close(ctx)
	_, err = adminConn.Exec(ctx, "CREATE DATABASE "+pgx.Identifier{cc.Database}.Sanitize())
	switch pgCode(err) {
	case "", "42P04", "23505": // created, or another process won the race
		return nil
	default:
		return fmt.Errorf("create database %q: %w", cc.Database, err)
	}
}

// EnsureDatabaseURL is EnsureDatabase for a connection URL.
func EnsureDatabaseURL(ctx context.Context, url string) error {
	cc, err := pgx.ParseConfig(url)
	if err != nil {
		return fmt.Errorf("parse DATABASE_URL: %w", err)
	}
	return EnsureDatabase(ctx, cc)
}

// Now is the database clock's idea of the time, for tests and diagnostics.
func Now(ctx context.Context, pool *pgxpool.Pool) (time.Time, error) {
	var now time.Time
	err := pool.QueryRow(ctx, "SELECT now()").Scan(&now)
	return now, err
}

// querier is what a pool, a connection and a transaction all offer.
type querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
	SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults
}
