package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"

	"golang.org/x/sync/errgroup"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/httpapi"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/service"
	"github.com/conveyorhq/conveyor/internal/task"
)

// run serves the API until ctx is done, then shuts down within the timeout.
func run(ctx context.Context, cfg config.API, stdout io.Writer) error {
	rt, err := service.Start(ctx, cfg.Common, stdout, service.Options{
		Name: "conveyor-api", StatementTimeout: cfg.RequestTimeout, Migrate: true,
	})
	if err != nil {
		return err
	}
	defer rt.Close(ctx)
	log := rt.Log

	notifier := postgres.NewNotifier(rt.Pool, cfg.NotifyDebounce, log)
	handler := httpapi.NewHandler(httpapi.Config{
		MaxBodyBytes:      cfg.MaxBodyBytes,
		Defaults:          task.Defaults{MaxAttempts: cfg.DefaultMaxAttempts},
		JaegerUIURL:       cfg.JaegerUIURL,
		RequestTimeout:    cfg.RequestTimeout,
		TrustTraceContext: cfg.TrustTraceContext,
	}, httpapi.Deps{
		Store:          postgres.NewAPIStore(rt.Pool, notifier.Poke),
		Log:            log,
		TracerProvider: rt.TracerProvider,
		Propagator:     rt.Propagator,
		Registry:       rt.Registry,
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
