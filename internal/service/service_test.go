package service_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/service"
	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// A collector that accepts connections and never answers (a black-holed
// OTEL_EXPORTER_OTLP_ENDPOINT) must not hold a stopping process long past
// SHUTDOWN_TIMEOUT: the flush of the last spans is bounded.
func TestCloseBoundsTheFlushOfTraces(t *testing.T) {
	// t.Setenv: not parallel.
	silent, _ := testenv.SilentAddr(t)
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://"+silent)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
	db := testdb.New(t)
	cfg := config.Common{DatabaseURL: db.URL, LogLevel: "error", LogFormat: "json",
		ShutdownTimeout: time.Second, OTLPEndpoint: "http://" + silent}
	ctx, cancel := context.WithCancel(context.Background())
	rt, err := service.Start(ctx, cfg, io.Discard, service.Options{Name: "conveyor-test"})
	require.NoError(t, err)
	_, span := rt.TracerProvider.Tracer("test").Start(ctx, "work")
	span.End()
	cancel() // SIGTERM
	start := time.Now()
	rt.Close(ctx)
	require.Less(t, time.Since(start), 8*time.Second, "Close waited on a collector that never answers")
}

// A collector that refuses the spans is an operator's to see in the logs,
// which are JSON: OpenTelemetry's own errors went to stderr in Go's plain
// log format, a line no log pipeline parses, with no level.
func TestTraceExportErrorsAreLoggedAsJSON(t *testing.T) {
	// t.Setenv: not parallel.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	endpoint := "http://" + ln.Addr().String()
	require.NoError(t, ln.Close()) // nothing listens there: connections are refused
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
	t.Setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
	db := testdb.New(t)
	cfg := config.Common{DatabaseURL: db.URL, LogLevel: "info", LogFormat: "json",
		ShutdownTimeout: time.Second, OTLPEndpoint: endpoint}
	var out syncBuffer
	rt, err := service.Start(context.Background(), cfg, &out, service.Options{Name: "conveyor-test"})
	require.NoError(t, err)
	_, span := rt.TracerProvider.Tracer("test").Start(context.Background(), "work")
	span.End()
	rt.Close(context.Background()) // flushes the span: its export fails
	var found bool
	for _, line := range strings.Split(strings.TrimSpace(out.String()), "\n") {
		if line == "" {
			continue
		}
		var rec map[string]any
		require.NoError(t, json.Unmarshal([]byte(line), &rec), "not JSON: %s", line)
		if rec["level"] == "WARN" && strings.Contains(fmt.Sprint(rec["error"]), "connection refused") {
			found = true
		}
	}
	require.True(t, found, "no JSON warning of the failed export in:\n%s", out.String())
}

// syncBuffer is a bytes.Buffer safe for a logger's writes from other
// goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
