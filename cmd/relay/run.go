package main

import (
	"context"
	"fmt"
	"io"
	"os"

	"golang.org/x/sync/errgroup"

	"github.com/conveyorhq/conveyor/internal/admin"
	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/relay"
	"github.com/conveyorhq/conveyor/internal/service"
)

// run relays outbox rows until ctx is done, then finishes its in-flight
// batch and returns.
func run(ctx context.Context, cfg config.Relay, stdout io.Writer) error {
	rt, err := service.Start(ctx, cfg.Common, stdout, service.Options{
		Name: "conveyor-relay", Plans: postgres.PlansGeneric, WarmUp: postgres.RelayHotStatements,
	})
	if err != nil {
		return err
	}
	defer rt.Close(ctx)
	log := rt.Log

	hostname, _ := os.Hostname()
	name := fmt.Sprintf("conveyor-relay %s/%d", hostname, os.Getpid())
	r := relay.New(relay.Config{
		BatchSize:           cfg.BatchSize,
		Lanes:               cfg.Lanes,
		PollInterval:        cfg.PollInterval,
		ConfirmTimeout:      cfg.ConfirmTimeout,
		ReconnectBackoffMax: cfg.ReconnectBackoffMax,
		StatsInterval:       cfg.StatsInterval,
		ShutdownTimeout:     cfg.ShutdownTimeout,
	}, relay.Deps{
		Store: postgres.NewRelayStore(rt.Pool, cfg.RetryBackoffBase, cfg.RetryBackoffMax),
		Broker: relay.BrokerFunc(func(_ context.Context, batchSize int) (relay.Publisher, error) {
			p, err := rabbitmq.DialPublisher(cfg.AMQPURL, batchSize, name, cfg.TasksPerMessage)
			if err != nil {
				return nil, err
			}
			return p, nil
		}),
		Log:            log,
		TracerProvider: rt.TracerProvider,
		Propagator:     rt.Propagator,
		Metrics:        relay.NewMetrics(rt.Registry),
	})

	listener := postgres.NewListener(cfg.DatabaseURL, postgres.OutboxChannel, r.Wake, log)
	listener.MaxBackoff = cfg.ReconnectBackoffMax

	adm, err := admin.Listen(ctx, cfg.AdminAddr, rt.Registry, func(ctx context.Context) (bool, map[string]any) {
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
