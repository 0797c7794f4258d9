package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/propagation"
	"golang.org/x/sync/errgroup"

	"github.com/conveyorhq/conveyor/internal/admin"
	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/relay"
	"github.com/conveyorhq/conveyor/internal/telemetry"
)

// run relays outbox rows until ctx is done, then finishes its in-flight
// batch and returns.
func run(ctx context.Context, cfg config.Relay, stdout io.Writer) error {
	log := telemetry.NewLogger(stdout, cfg.LogLevel, cfg.LogFormat).With("service", "conveyor-relay")
	tp, shutdownTracing, err := telemetry.SetupTracing(ctx, telemetry.TraceConfig{
		ServiceName: "conveyor-relay", Export: cfg.ExportTraces(),
	})
	if err != nil {
		return err
	}
	defer func() { _ = shutdownTracing(context.WithoutCancel(ctx)) }()

	pool, err := postgres.Open(ctx, postgres.PoolConfig{URL: cfg.DatabaseURL, MaxConns: cfg.DatabaseMaxConns})
	if err != nil {
		return err
	}
	defer pool.Close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	hostname, _ := os.Hostname()
	r := relay.New(relay.Config{
		AMQPURL:             cfg.AMQPURL,
		Name:                fmt.Sprintf("conveyor-relay %s/%d", hostname, os.Getpid()),
		BatchSize:           cfg.BatchSize,
		PollInterval:        cfg.PollInterval,
		ConfirmTimeout:      cfg.ConfirmTimeout,
		ReconnectBackoffMax: cfg.ReconnectBackoffMax,
		StatsInterval:       cfg.StatsInterval,
	}, postgres.NewOutboxStore(pool, cfg.RetryBackoffBase, cfg.RetryBackoffMax), log, tp,
		propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}),
		relay.NewMetrics(reg))

	listener := postgres.NewListener(cfg.DatabaseURL, postgres.OutboxChannel, r.Wake, log)
	listener.MaxBackoff = cfg.ReconnectBackoffMax

	adm, err := admin.Listen(ctx, cfg.AdminAddr, reg, func(ctx context.Context) (bool, map[string]any) {
		ready, blocked, err := r.Ready(ctx)
		details := map[string]any{"broker_blocked": blocked}
		if err != nil {
			details["error"] = err.Error()
		}
		return ready, details
	}, log)
	if err != nil {
		return err
	}
	log.InfoContext(ctx, "relay started", "admin_addr", adm.Addr(), "batch_size", cfg.BatchSize)

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return adm.Run(gctx) })
	g.Go(func() error { return listener.Run(gctx) })
	g.Go(func() error { return r.Run(gctx) })
	err = g.Wait()
	log.InfoContext(ctx, "relay stopped")
	return err
}
