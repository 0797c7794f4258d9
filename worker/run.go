package worker

import (
	"context"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/exaring/otelpgx"
	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/propagation"
	"golang.org/x/sync/errgroup"

	"github.com/conveyorhq/conveyor"
	"github.com/conveyorhq/conveyor/internal/admin"
	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/telemetry"
	runner "github.com/conveyorhq/conveyor/internal/worker"
)

// run wires a worker and runs it until ctx is done.
func run(ctx context.Context, cfg config.Worker, stdout io.Writer, handlers []conveyor.Handler) error {
	hostname, _ := os.Hostname()
	if cfg.ID == "" {
		cfg.ID = fmt.Sprintf("%s-%d-%s", hostname, os.Getpid(), uuid.NewString()[:6])
	}
	log := telemetry.NewLogger(stdout, cfg.LogLevel, cfg.LogFormat).With("service", "conveyor-worker", "worker_id", cfg.ID)
	tp, shutdownTracing, err := telemetry.SetupTracing(ctx, telemetry.TraceConfig{
		ServiceName: "conveyor-worker", Export: cfg.ExportTraces(),
	})
	if err != nil {
		return err
	}
	defer func() { _ = shutdownTracing(context.WithoutCancel(ctx)) }()

	maxConns := cfg.DatabaseMaxConns
	if maxConns == 0 {
		// Writes are short, but every running task makes them.
		maxConns = int32(min(cfg.Concurrency/2+4, 64))
	}
	pool, err := postgres.Open(ctx, postgres.PoolConfig{
		URL: cfg.DatabaseURL, MaxConns: maxConns,
		Tracer: otelpgx.NewTracer(otelpgx.WithTracerProvider(tp)),
	})
	if err != nil {
		return err
	}
	defer pool.Close()
	// A worker may start before any api: it brings the schema up too (the
	// runner is safe to run from many processes).
	if _, err := postgres.Migrate(ctx, pool, log); err != nil {
		return err
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := runner.NewMetrics(reg)
	notifier := postgres.NewNotifier(pool, 2*time.Millisecond, log)
	store := postgres.NewWorkStore(pool, notifier.Poke)
	w, err := runner.New(runner.Config{
		Info: postgres.WorkerInfo{
			ID: cfg.ID, Hostname: hostname, PID: os.Getpid(), Concurrency: cfg.Concurrency,
			Version: telemetry.Version,
		},
		AMQPURL:             cfg.AMQPURL,
		Concurrency:         cfg.Concurrency,
		Lease:               cfg.LeaseDuration,
		Heartbeat:           cfg.HeartbeatInterval,
		ProgressInterval:    cfg.ProgressInterval,
		BackoffBase:         cfg.RetryBackoffBase,
		BackoffMax:          cfg.RetryBackoffMax,
		ShutdownTimeout:     cfg.ShutdownTimeout,
		ReconnectBackoffMax: cfg.ReconnectBackoffMax,
	}, store, handlers, log, tp,
		propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}), metrics)
	if err != nil {
		return err
	}
	maintainer := runner.NewMaintainer(runner.MaintenanceConfig{
		WorkerID: cfg.ID, Interval: cfg.MaintenanceInterval, LeaderTTL: cfg.LeaderTTL,
		RepublishAfter: cfg.RepublishAfter, Retention: cfg.Retention, DeadAfter: cfg.WorkerDeadAfter,
	}, store, log, metrics)

	adm, err := admin.Listen(ctx, cfg.AdminAddr, reg, func(ctx context.Context) (bool, map[string]any) {
		ready, err := w.Ready(ctx)
		details := map[string]any{}
		if err != nil {
			details["error"] = err.Error()
		}
		return ready, details
	}, log)
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "worker started", "admin_addr", adm.Addr(), "types", w.Types(), "concurrency", cfg.Concurrency)

	// The notifier and admin server outlive ctx a little: the shutdown
	// hands tasks back (outbox rows to announce) and stays observable.
	bg, stopBG := context.WithCancel(context.WithoutCancel(ctx))
	defer stopBG()
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return adm.Run(bg) })
	g.Go(func() error { return notifier.Run(bg) })
	g.Go(func() error { return maintainer.Run(gctx) })
	g.Go(func() error {
		err := w.Run(gctx)
		stopBG()
		return err
	})
	err = g.Wait()
	log.InfoContext(ctx, "worker stopped")
	return err
}
