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
		// A lane's batch holds a connection through its wait for the
		// broker's confirms: one for each lane, and two for the outbox
		// stats and the readiness probe's ping.
		MaxConns: int32(cfg.Lanes) + 2,
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
		Broker: relay.BrokerFunc(func(ctx context.Context, batchSize int) (relay.Publisher, error) {
			// A dial takes no context and may wait out its 30-second
			// handshake on a broker that never answers: a stopping relay
			// does not wait for it (the publisher it may still bring is
			// closed).
			type dialed struct {
				p   *rabbitmq.Publisher
				err error
			}
			done := make(chan dialed, 1)
			go func() {
				p, err := rabbitmq.DialPublisher(cfg.AMQPURL, batchSize, name, cfg.TasksPerMessage)
				done <- dialed{p, err}
			}()
			select {
			case d := <-done:
				if d.err != nil {
					return nil, d.err
				}
				return d.p, nil
			case <-ctx.Done():
				go func() {
					if d := <-done; d.p != nil {
						_ = d.p.Close()
					}
				}()
				return nil, ctx.Err()
			}
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
