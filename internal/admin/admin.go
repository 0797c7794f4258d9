// Package admin serves the operational endpoints of the relay and the
// worker: /healthz (liveness), /readyz (dependencies reachable) and
// /metrics (Prometheus).
package admin

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Check reports readiness and details worth showing an operator.
type Check func(ctx context.Context) (ready bool, details map[string]any)

// Server is a running admin server.
type Server struct {
	srv *http.Server
	ln  net.Listener
	log *slog.Logger
}

// Listen binds addr and prepares the endpoints.
func Listen(ctx context.Context, addr string, reg *prometheus.Registry, ready Check, log *slog.Logger) (*Server, error) {
	ln, err := new(net.ListenConfig).Listen(ctx, "tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("listen on admin address %q: %w", addr, err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeJSON(w, http.StatusOK, map[string]any{"status": "ok"})
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		// A check stuck on a dependency that stops answering (the pool
		// waits 5 s past a statement's context before it drops the
		// connection) is not waited for: the probe reads 503 in time.
		type answer struct {
			ok      bool
			details map[string]any
		}
		answers := make(chan answer, 1)
		go func() {
			ok, details := ready(ctx)
			answers <- answer{ok, details}
		}()
		var ok bool
		var details map[string]any
		select {
		case a := <-answers:
			ok, details = a.ok, a.details
		case <-ctx.Done():
			details = map[string]any{"error": "readiness check timed out: " + ctx.Err().Error()}
		}
		if details == nil {
			details = map[string]any{}
		}
		status := http.StatusOK
		details["status"] = "ready"
		if !ok {
			status = http.StatusServiceUnavailable
			details["status"] = "not ready"
		}
		writeJSON(w, status, details)
	})
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	// Go's profiles, for finding where a process spends its time under
	// load: the admin address is an operator's port, like /metrics.
	mux.HandleFunc("GET /debug/pprof/", pprof.Index)
	mux.HandleFunc("GET /debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("GET /debug/pprof/trace", pprof.Trace)
	return &Server{
		srv: &http.Server{Handler: mux, ReadHeaderTimeout: 5 * time.Second},
		ln:  ln,
		log: log,
	}, nil
}

// Addr is the bound address.
func (s *Server) Addr() string { return s.ln.Addr().String() }

// Run serves until ctx is done.
func (s *Server) Run(ctx context.Context) error {
	go func() {
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = s.srv.Shutdown(sctx)
	}()
	if err := s.srv.Serve(s.ln); !errors.Is(err, http.ErrServerClosed) {
		return fmt.Errorf("admin server: %w", err)
	}
	return nil
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}
