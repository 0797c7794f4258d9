package httpapi

import (
	_ "embed"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
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
		if err := s.Store.Ping(r.Context()); err != nil {
			s.Log.WarnContext(r.Context(), "not ready", "error", err)
			s.writeError(w, r, task.Errorf(task.ErrCodeUnavailable, "database unreachable"))
			return
		}
		s.respond(w, r, http.StatusOK, map[string]string{"status": "ready"})
	}
}

// propagationCarrier adapts a task.Carrier to OpenTelemetry's propagators.
type propagationCarrier = propagation.MapCarrier

type metrics struct {
	submittedTotal *prometheus.CounterVec
	requests       *prometheus.HistogramVec
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
		// The tracing middleware runs before routing; name the span after
		// the route now that it is known.
		span := trace.SpanFromContext(r.Context())
		span.SetName(r.Method + " " + route)
		span.SetAttributes(semconv.HTTPRoute(route))
		s.metrics.requests.WithLabelValues(route, r.Method, strconv.Itoa(sw.status)).Observe(time.Since(start).Seconds())
	})
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
