package httpapi

import (
	"context"
	_ "embed"
	"log/slog"
	"net/http"
	"strconv"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	semconv "go.opentelemetry.io/otel/semconv/v1.26.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/conveyorhq/conveyor/internal/task"
)

//go:embed openapi.yaml
var openAPI []byte

func (s *server) handleOpenAPI() http.HandlerFunc {
	return func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/yaml")
		_, _ = w.Write(openAPI)
	}
}

func (s *server) handleHealthz() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		s.respond(w, r, http.StatusOK, map[string]string{"status": "ok"})
	}
}

func (s *server) handleReadyz() http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if err := pingWithin(r.Context(), s.Store.Ping, readyTimeout); err != nil {
			s.Log.WarnContext(r.Context(), "not ready", "error", err)
			s.writeError(w, r, task.Errorf(task.ErrCodeUnavailable, "database unreachable"))
			return
		}
		s.respond(w, r, http.StatusOK, map[string]string{"status": "ready"})
	}
}

// readyTimeout bounds /readyz, as on the relay's and the worker's admin
// servers: a probe gives up after a few seconds, and should read why.
const readyTimeout = 2 * time.Second

// pingWithin returns ping's answer, or a timeout once d has passed. A
// database that stops answering holds a statement past its context by the
// pool's cancel delay (5 s more), so the ping is not waited for: it ends
// on its own.
func pingWithin(ctx context.Context, ping func(context.Context) error, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	errc := make(chan error, 1)
	go func() {
		defer cancel()
		errc <- ping(ctx)
	}()
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

type metrics struct {
	submittedTotal *prometheus.CounterVec
	requests       *prometheus.HistogramVec
	authFailures   *prometheus.CounterVec
	rateLimited    prometheus.Counter
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		submittedTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "conveyor_tasks_submitted_total",
			Help: "Tasks submitted through the API, by type and result (created or duplicate).",
		}, []string{"type", "result"}),
		requests: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "conveyor_http_request_duration_seconds",
			Help:    "API request latency by route, method and status code.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}, []string{"route", "method", "code"}),
	}
	reg.MustRegister(m.submittedTotal, m.requests)
	m.authFailures, m.rateLimited = newAuthMetrics(reg)
	return m
}

func (m *metrics) submitted(typ string, created bool) {
	result := "duplicate"
	if created {
		result = "created"
	}
	m.submittedTotal.WithLabelValues(typ, result).Inc()
}

// instrument records every request's latency under its route pattern.
func (s *server) instrument(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		start := time.Now()
		sw := &statusWriter{ResponseWriter: w, status: http.StatusOK}
		next.ServeHTTP(sw, r)
		route := routePattern(r)
		method := methodLabel(r.Method)
		// The tracing middleware runs before routing; name the span after
		// the route now that it is known (and, as the metrics, after a
		// method HTTP defines: span names are indexed too).
		span := trace.SpanFromContext(r.Context())
		span.SetName(method + " " + route)
		span.SetAttributes(semconv.HTTPRoute(route))
		s.metrics.requests.WithLabelValues(route, method, strconv.Itoa(sw.status)).Observe(time.Since(start).Seconds())
	})
}

// methodLabel is the metric label of a request's method, and the first
// word of its span's name: the method when HTTP defines it, "other" for
// any a client makes up, so that client input alone never creates a
// series or a span name.
func methodLabel(method string) string {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete,
		http.MethodConnect, http.MethodOptions, http.MethodTrace:
		return method
	}
	return "other"
}

// timeout bounds every request's work: a request stuck on a lock or a
// slow database answers 503 instead of holding its connection.
func (s *server) timeout(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if s.cfg.RequestTimeout <= 0 {
			next.ServeHTTP(w, r)
			return
		}
		ctx, cancel := context.WithTimeout(r.Context(), s.cfg.RequestTimeout)
		defer cancel()
		next.ServeHTTP(w, r.WithContext(ctx))
	})
}

// typeLabels maps a task type to its metric label: the type itself once a
// worker has declared its queue, "other" before. Client input alone never
// creates a label. The known types are read again at most every
// typeLabelsTTL, in the background.
type typeLabels struct {
	load     func(context.Context) ([]string, error)
	log      *slog.Logger
	mu       sync.Mutex
	known    map[string]bool
	loadedAt time.Time
	loading  bool
}

const typeLabelsTTL = 10 * time.Second

// otherType is the label of every type no worker has declared yet.
const otherType = "other"

func (l *typeLabels) label(typ string) string {
	l.mu.Lock()
	if l.loadedAt.IsZero() {
		// The first use waits for the list, so that known types are
		// labelled right from the start.
		l.mu.Unlock()
		l.refresh()
		l.mu.Lock()
	}
	stale := !l.loading && time.Since(l.loadedAt) > typeLabelsTTL
	if stale {
		l.loading = true
	}
	known := l.known[typ]
	l.mu.Unlock()
	if stale {
		go l.refresh()
	}
	if known {
		return typ
	}
	return otherType
}

func (l *typeLabels) refresh() {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	names, err := l.load(ctx)
	l.mu.Lock()
	defer l.mu.Unlock()
	l.loading, l.loadedAt = false, time.Now()
	if err != nil {
		l.log.WarnContext(ctx, "read known task types", "error", err)
		return
	}
	l.known = make(map[string]bool, len(names))
	for _, n := range names {
		l.known[n] = true
	}
}

type statusWriter struct {
	http.ResponseWriter
	status int
}

func (w *statusWriter) WriteHeader(code int) {
	w.status = code
	w.ResponseWriter.WriteHeader(code)
}

func (w *statusWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }
