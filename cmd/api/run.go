package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"

	"golang.org/x/sync/errgroup"

	"github.com/conveyorhq/conveyor/internal/admin"
	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/httpapi"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/service"
	"github.com/conveyorhq/conveyor/internal/stream"
	"github.com/conveyorhq/conveyor/internal/task"
)

// run serves the API until ctx is done, then shuts down within the timeout.
func run(ctx context.Context, cfg config.API, stdout io.Writer) error {
	rt, err := service.Start(ctx, cfg.Common, stdout, service.Options{
		Name: "conveyor-api", StatementTimeout: cfg.RequestTimeout, Migrate: true, TenantPool: true,
	})
	if err != nil {
		return err
	}
	defer rt.Close(ctx)
	log := rt.Log

	// One hub per instance feeds every live stream: it reads each event
	// once, woken by the NOTIFYs of whoever wrote it (this instance too).
	notifier := postgres.NewNotifier(rt.Pool, cfg.NotifyDebounce, log, postgres.OutboxChannel, postgres.EventsChannel)
	outboxPoke, eventsPoke := notifier.Poker(postgres.OutboxChannel), notifier.Poker(postgres.EventsChannel)
	hub := stream.NewHub(postgres.NewEventFeed(rt.Pool), stream.Config{
		Buffer: cfg.StreamBuffer, GapTimeout: cfg.StreamGapTimeout, Encode: httpapi.EventFrame,
	}, log, rt.Registry)
	listener := postgres.NewListener(cfg.DatabaseURL, postgres.EventsChannel, hub.Wake, log)
	authn, touch, err := authenticator(ctx, cfg, rt)
	if err != nil {
		return err
	}
	store := postgres.NewAPIStore(rt.TenantPool, outboxPoke)
	store.OnEvents = eventsPoke
	// Jobs' changes (a limit raised, a resume) wake the scheduler through
	// the events channel it listens on.
	jobs := postgres.NewJobStore(rt.TenantPool)
	jobs.OnChange, jobs.OnOutbox, jobs.OnEvents = eventsPoke, outboxPoke, eventsPoke
	handler := httpapi.NewHandler(httpapi.Config{
		MaxBodyBytes:      cfg.MaxBodyBytes,
		Defaults:          task.Defaults{MaxAttempts: cfg.DefaultMaxAttempts},
		JaegerUIURL:       cfg.JaegerUIURL,
		RequestTimeout:    cfg.RequestTimeout,
		TrustTraceContext: cfg.TrustTraceContext,
		RateLimit:         cfg.RateLimit,
		RateBurst:         cfg.RateBurst,
		AuthFailureLimit:  cfg.AuthFailureLimit,
		AuthFailureBurst:  cfg.AuthFailureBurst,
		MaxUnservedTypes:  cfg.MaxUnservedTypes,
		StreamHeartbeat:   cfg.StreamHeartbeat,
		MaxStreams:        cfg.StreamMax,
		MaxOrgStreams:     cfg.StreamMaxPerOrg,
		WriteTimeout:      cfg.WriteTimeout,
		NoMetrics:         cfg.AdminAddr != "",
	}, httpapi.Deps{
		Store:          store,
		Admin:          store,
		Jobs:           jobs,
		Workflows:      jobs,
		Auth:           authn,
		Log:            log,
		TracerProvider: rt.TracerProvider,
		Propagator:     rt.Propagator,
		Registry:       rt.Registry,
		Hub:            hub,
		Workers:        postgres.NewRegistryStore(rt.Pool),
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
	if cfg.AdminAddr != "" {
		adm, err := admin.Listen(ctx, cfg.AdminAddr, rt.Registry, func(ctx context.Context) (bool, map[string]any) {
			if err := rt.Pool.Ping(ctx); err != nil {
				return false, map[string]any{"error": err.Error()}
			}
			return true, nil
		}, log)
		if err != nil {
			_ = ln.Close()
			return fmt.Errorf("API_ADMIN_ADDR: %w", err)
		}
		log.InfoContext(ctx, "api admin listening", "addr", adm.Addr())
		g.Go(func() error { return adm.Run(gctx) })
	}
	g.Go(func() error {
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			return fmt.Errorf("serve: %w", err)
		}
		return nil
	})
	g.Go(func() error { return notifier.Run(gctx) })
	g.Go(func() error { return listener.Run(gctx) })
	// When the hub stops it ends the live streams, which would otherwise
	// hold the server's shutdown open.
	g.Go(func() error { return hub.Run(gctx) })
	g.Go(func() error { return touch(gctx) })
	g.Go(func() error {
		<-gctx.Done()
		log.InfoContext(ctx, "api shutting down")
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), cfg.ShutdownTimeout)
		defer cancel()
		return srv.Shutdown(sctx)
	})
	return g.Wait()
}

// authenticator returns how requests are let in, and the loop that records
// when keys were last used.
func authenticator(ctx context.Context, cfg config.API, rt *service.Runtime) (httpapi.Authenticator, func(context.Context) error, error) {
	dir := postgres.NewDirectory(rt.Pool)
	if cfg.AuthDisabled {
		org, err := dir.EnsureOrg(ctx, cfg.DevOrg)
		if err != nil {
			return nil, nil, fmt.Errorf("AUTH_DISABLED: org %q: %w", cfg.DevOrg, err)
		}
		rt.Log.WarnContext(ctx, "AUTHENTICATION IS DISABLED (AUTH_DISABLED=true): every request, from anyone, "+
			"acts as an admin of org "+cfg.DevOrg+". Never run this outside a developer's machine.", "org", cfg.DevOrg)
		p := auth.Principal{Kind: auth.KindDev, Name: "AUTH_DISABLED", OrgID: org, OrgSlug: cfg.DevOrg, Role: auth.Admin}
		return httpapi.DevMode(p), func(ctx context.Context) error { <-ctx.Done(); return nil }, nil
	}
	var verifier auth.Verifier
	if cfg.OIDCIssuerURL != "" {
		verifier = auth.NewOIDC(cfg.OIDCIssuerURL, cfg.OIDCAudience)
		rt.Log.InfoContext(ctx, "accepting OpenID Connect tokens", "issuer", cfg.OIDCIssuerURL, "audience", cfg.OIDCAudience)
	}
	a := auth.New(dir, auth.Config{CacheTTL: cfg.AuthCacheTTL, OIDC: verifier, Log: rt.Log})
	return a, a.Run, nil
}
