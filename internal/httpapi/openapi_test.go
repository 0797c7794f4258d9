package httpapi

import (
	"io"
	"log/slog"
	"net/http"
	"sort"
	"strings"
	"testing"

	"github.com/go-chi/chi/v5"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace/noop"
	"gopkg.in/yaml.v3"
)

// TestOpenAPIMatchesRoutes keeps openapi.yaml true: every route the router
// serves is documented with its method, and nothing else is.
func TestOpenAPIMatchesRoutes(t *testing.T) {
	t.Parallel()
	var doc struct {
		OpenAPI string                    `yaml:"openapi"`
		Paths   map[string]map[string]any `yaml:"paths"`
	}
	require.NoError(t, yaml.Unmarshal(openAPI, &doc))
	require.True(t, strings.HasPrefix(doc.OpenAPI, "3.1"))
	var documented []string
	for path, ops := range doc.Paths {
		for method := range ops {
			if method == "parameters" {
				continue
			}
			documented = append(documented, strings.ToUpper(method)+" "+path)
		}
	}

	s := &server{Deps: Deps{Log: slog.New(slog.NewTextHandler(io.Discard, nil)), TracerProvider: noop.NewTracerProvider(),
		Propagator: propagation.TraceContext{}, Registry: prometheus.NewRegistry()}}
	s.metrics = newMetrics(s.Registry)
	var served []string
	require.NoError(t, chi.Walk(s.router(), func(method, route string, _ http.Handler, _ ...func(http.Handler) http.Handler) error {
		served = append(served, method+" "+route)
		return nil
	}))
	sort.Strings(documented)
	sort.Strings(served)
	require.Equal(t, served, documented)
}
