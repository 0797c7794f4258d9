// Package service starts what every Conveyor binary needs, in one place:
// the logger, tracing and the propagator, the metrics registry, and the
// database pool. Each binary's run function calls Start and defers Close.
package service

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/telemetry"
	"github.com/conveyorhq/conveyor/internal/wait"
)

// Options says what a binary needs beyond the common configuration.
type Options struct {
	// Name is the service name in logs and traces (conveyor-api, ...).
	Name string
	// MaxConns sizes the database pool; 0 takes DATABASE_MAX_CONNS, then
	// pgx's default.
	MaxConns int32
	// StatementTimeout bounds every statement on the server; 0: none.
	StatementTimeout time.Duration
	// Plans says how the server plans the main pool's statements (see
	// postgres.Plans).
	Plans postgres.Plans
	// WarmUp names the hot statements to plan on every new connection,
	// a few of which are opened at once (see postgres.PoolConfig).
	WarmUp []string
	// Migrate applies the embedded migrations before the pools open.
	// Without it, Start waits while the database's schema is behind this
	// binary's (another process migrates it); either way it refuses a
	// schema a newer release migrated.
	Migrate bool
	// TenantPool opens Runtime.TenantPool, sized like the main pool, and
	// leaves the main pool small: for the API, whose own-user work (key
	// lookups, wake-ups) is light.
	TenantPool bool
	// BackgroundPool opens Runtime.BackgroundPool, a small pool whose
	// statements are planned at every call (postgres.PlansCustom).
	BackgroundPool bool
	// LogAttrs are added to every log record.
	LogAttrs []any
}

// Runtime is a started service's shared equipment.
type Runtime struct {
	Log            *slog.Logger
	TracerProvider trace.TracerProvider
	// Propagator carries W3C trace context between processes; baggage
	// is deliberately not carried.
	Propagator propagation.TextMapPropagator
	Registry   *prometheus.Registry
	Pool       *pgxpool.Pool
	// TenantPool's connections are postgres.TenantRole: only a caller's
	// scope shows them any org's rows.
	TenantPool *pgxpool.Pool
	// BackgroundPool is for maintenance and scheduling, kept apart from
	// the hot statements' generic plans.
	BackgroundPool *pgxpool.Pool

	shutdownTracing func(context.Context) error
}

// Start sets up logging, tracing, metrics and the database pool.
func Start(ctx context.Context, cfg config.Common, stdout io.Writer, o Options) (*Runtime, error) {
	tuneGC()
	r := &Runtime{
		Log:        telemetry.NewLogger(stdout, cfg.LogLevel, cfg.LogFormat).With(append([]any{"service", o.Name}, o.LogAttrs...)...),
		Propagator: propagation.TraceContext{},
		Registry:   prometheus.NewRegistry(),
	}
	r.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// OpenTelemetry's own errors (a collector refusing or not answering)
	// go to the JSON log, not to stderr in Go's plain log format.
	otel.SetErrorHandler(otel.ErrorHandlerFunc(func(err error) {
		r.Log.Warn("opentelemetry", "error", err)
	}))
	tp, shutdown, err := telemetry.SetupTracing(ctx, telemetry.TraceConfig{ServiceName: o.Name, Export: cfg.ExportTraces()})
	if err != nil {
		return nil, err
	}
	r.TracerProvider, r.shutdownTracing = tp, shutdown
	maxConns := o.MaxConns
	if cfg.DatabaseMaxConns > 0 {
		maxConns = cfg.DatabaseMaxConns
	}
	// A database that is starting or restarting is waited for; one that
	// will never answer (missing, refusing the credentials) stops the start.
	b := wait.Backoff(100*time.Millisecond, 5*time.Second)
	for {
		err = r.connect(ctx, cfg, o, maxConns)
		if err == nil {
			return r, nil
		}
		retry := b.NextBackOff()
		// A schema not migrated yet is waited for too: the api or a
		// worker starting beside this process migrates it.
		waitable := postgres.Transient(err) || errors.Is(err, postgres.ErrSchemaBehind)
		if !waitable || ctx.Err() != nil {
			_ = shutdown(context.WithoutCancel(ctx))
			return nil, err
		}
		r.Log.WarnContext(ctx, "database not ready; retrying", "error", err, "retry_in", retry)
		wait.Sleep(ctx, retry)
	}
}

func (r *Runtime) connect(ctx context.Context, cfg config.Common, o Options, maxConns int32) error {
	pc := postgres.PoolConfig{
		URL: cfg.DatabaseURL, MaxConns: maxConns, StatementTimeout: o.StatementTimeout, Plans: o.Plans,
		WarmUp: o.WarmUp, MinConns: 2, TracerProvider: r.TracerProvider, IdleTxTimeout: cfg.DatabaseIdleTxTimeout,
	}
	if err := r.schema(ctx, pc, o.Migrate, postgres.MigrateConfig{LockTimeout: cfg.MigrationLockTimeout}); err != nil {
		return err
	}
	main := pc
	if o.TenantPool {
		main.MaxConns = 4
	}
	pool, err := postgres.Open(ctx, main)
	if err != nil {
		return err
	}
	if o.TenantPool {
		pc.Role = postgres.TenantRole
		tenant, err := postgres.Open(ctx, pc)
		if err != nil {
			closePools(pool)
			return err
		}
		r.TenantPool = tenant
	}
	if o.BackgroundPool {
		background, err := postgres.Open(ctx, postgres.PoolConfig{URL: cfg.DatabaseURL, MaxConns: backgroundConns,
			StatementTimeout: o.StatementTimeout, Plans: postgres.PlansCustom, TracerProvider: r.TracerProvider,
			IdleTxTimeout: cfg.DatabaseIdleTxTimeout})
		if err != nil {
			closePools(r.TenantPool, pool)
			return err
		}
		r.BackgroundPool = background
	}
	r.Pool = pool
	return nil
}

// schema brings the database's schema to this binary's (migrate), or
// checks that it is there, on a connection of its own and before the
// service's pools open: their connections plan the hot statements as they
// connect (WarmUp), against the schema as this binary knows it, and fail on
// a database that is empty or that an older release migrated.
func (r *Runtime) schema(ctx context.Context, pc postgres.PoolConfig, migrate bool, mc postgres.MigrateConfig) error {
	pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: pc.URL, MaxConns: 1,
		TracerProvider: pc.TracerProvider, IdleTxTimeout: pc.IdleTxTimeout})
	if err != nil {
		return err
	}
	defer pool.Close()
	if migrate {
		_, err = postgres.MigrateWith(ctx, pool, r.Log, mc)
		return err
	}
	return postgres.CheckSchema(ctx, pool)
}

// backgroundConns sizes a BackgroundPool: maintenance and scheduling run
// one pass at a time each.
const backgroundConns = 4

// Close closes the pools, for at most poolCloseTimeout, and flushes the
// traces, for at most traceFlushTimeout: a database or a collector that
// does not answer must not hold a stopping process past its shutdown
// timeout.
func (r *Runtime) Close(ctx context.Context) {
	closed := make(chan struct{})
	go func() {
		defer close(closed)
		closePools(r.TenantPool, r.BackgroundPool, r.Pool)
	}()
	t := time.NewTimer(poolCloseTimeout)
	select {
	case <-closed:
		t.Stop()
	case <-t.C:
		r.Log.WarnContext(ctx, "database connections not closed in time; leaving them to the exit", "timeout", poolCloseTimeout)
	}
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), traceFlushTimeout)
	defer cancel()
	_ = r.shutdownTracing(fctx)
}

// poolCloseTimeout bounds the closing of the pools at exit. pgx waits for
// every connection in use to come back, and closes each with up to 15 s of
// cancel request and goodbye: a database that stopped answering (a host
// gone without closing its sockets) held a stopped api for as long.
const poolCloseTimeout = 5 * time.Second

// traceFlushTimeout bounds the flush of the last spans at exit.
const traceFlushTimeout = 5 * time.Second

// closePools closes the pools that were opened (nil ones were not).
func closePools(pools ...*pgxpool.Pool) {
	for _, p := range pools {
		if p != nil {
			p.Close()
		}
	}
}

// gcPercent is the services' GOGC unless the environment sets one. They
// keep a small live heap (tens of MiB) and allocate per task: at Go's
// default of 100 the collector ran many times a second and took a third of
// a busy worker's CPU. Four times the live heap is still little memory.
const gcPercent = 400

// tuneGC sets gcPercent when GOGC is unset or empty: the runtime reads an
// empty GOGC as its default of 100, as if it were unset.
func tuneGC() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(gcPercent)
	}
}
