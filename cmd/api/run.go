package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"

	"github.com/exaring/otelpgx"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.opentelemetry.io/otel/propagation"
	"golang.org/x/sync/errgroup"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/httpapi"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
	"github.com/conveyorhq/conveyor/internal/telemetry"
)

// run serves the API until ctx is done, then shuts down within the timeout.
func run(ctx context.Context, cfg config.API, stdout io.Writer) error {
	log := telemetry.NewLogger(stdout, cfg.LogLevel, cfg.LogFormat).With("service", "conveyor-api")
	tp, shutdownTracing, err := telemetry.SetupTracing(ctx, telemetry.TraceConfig{
		ServiceName: "conveyor-api", Export: cfg.ExportTraces(),
	})
	if err != nil {
		return err
	}
	defer func() { _ = shutdownTracing(context.WithoutCancel(ctx)) }()

	pool, err := postgres.Open(ctx, postgres.PoolConfig{
		URL: cfg.DatabaseURL, MaxConns: cfg.DatabaseMaxConns,
		Tracer: otelpgx.NewTracer(otelpgx.WithTracerProvider(tp)),
	})
	if err != nil {
		return err
	}
	defer pool.Close()
	if _, err := postgres.Migrate(ctx, pool, log); err != nil {
		return err
	}

	notifier := postgres.NewNotifier(pool, cfg.NotifyDebounce, log)
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	handler := httpapi.NewHandler(httpapi.Config{
		MaxBodyBytes: cfg.MaxBodyBytes,
		Defaults:     task.Defaults{MaxAttempts: cfg.DefaultMaxAttempts},
		JaegerUIURL:  cfg.JaegerUIURL,
	}, httpapi.Deps{
		Store:          postgres.NewTaskStore(pool, notifier.Poke),
		Log:            log,
		TracerProvider: tp,
		Propagator:     propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{}),
		Registry:       reg,
	})

	ln, err := new(net.ListenConfig).Listen(ctx, "tcp", cfg.Addr)
	if err != nil {
		return fmt.Errorf("listen on API_ADDR %q: %w", cfg.Addr, err)
	}
	srv := &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: cfg.ReadHeaderTimeout,
		ReadTimeout:       cfg.ReadTimeout,
		WriteTimeout:      cfg.WriteTimeout,
		IdleTimeout:       cfg.IdleTimeout,
		MaxHeaderBytes:    64 << 10,
	}
	log.InfoContext(ctx, "api listening", "addr", ln.Addr().String())

	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("serve: %w", err)
		}
		return nil
	})
	g.Go(func() error { return notifier.Run(gctx) })
	g.Go(func() error {
		<-gctx.Done()
		log.InfoContext(ctx, "api shutting down")
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
		defer cancel()
		return srv.Shutdown(sctx)
	})
	return g.Wait()
}
