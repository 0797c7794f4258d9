package telemetry

import (
	"bytes"
	"context"
	"encoding/json"
	"log/slog"
	"strings"
	"testing"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// durationValuer is a LogValuer whose value is a duration.
type durationValuer time.Duration

func (d durationValuer) LogValue() slog.Value { return slog.DurationValue(time.Duration(d)) }

func logDurations(log *slog.Logger) {
	log.With("timeout", 30*time.Second).
		WithGroup("g").
		Info("retrying",
			"retry_in", 1500*time.Millisecond,
			slog.Duration("backoff", 250*time.Microsecond),
			slog.Any("elapsed", 2*time.Minute+3*time.Second),
			"lazy", durationValuer(90*time.Millisecond),
			slog.Group("inner", slog.Duration("wait", time.Hour)),
			"attempt", 3,
		)
}

func TestNewLoggerJSONWritesReadableDurations(t *testing.T) {
	var buf bytes.Buffer
	logDurations(NewLogger(&buf, "info", "json"))

	line := buf.Bytes()
	if bytes.Count(line, []byte("\n")) != 1 {
		t.Fatalf("want one JSON line, got %q", line)
	}
	var got struct {
		Msg     string `json:"msg"`
		Timeout any    `json:"timeout"`
		G       struct {
			RetryIn any `json:"retry_in"`
			Backoff any `json:"backoff"`
			Elapsed any `json:"elapsed"`
			Lazy    any `json:"lazy"`
			Inner   struct {
				Wait any `json:"wait"`
			} `json:"inner"`
			Attempt any `json:"attempt"`
		} `json:"g"`
	}
	if err := json.Unmarshal(line, &got); err != nil {
		t.Fatalf("decode %q: %v", line, err)
	}
	for _, c := range []struct {
		name string
		got  any
		want string
	}{
		{"timeout (With)", got.Timeout, "30s"},
		{"g.retry_in (key-value pair)", got.G.RetryIn, "1.5s"},
		{"g.backoff (slog.Duration)", got.G.Backoff, "250µs"},
		{"g.elapsed (slog.Any)", got.G.Elapsed, "2m3s"},
		{"g.lazy (LogValuer)", got.G.Lazy, "90ms"},
		{"g.inner.wait (nested group)", got.G.Inner.Wait, "1h0m0s"},
	} {
		if s, ok := c.got.(string); !ok || s != c.want {
			t.Errorf("%s = %#v, want %q in %s", c.name, c.got, c.want, line)
		}
	}
	if got.Msg != "retrying" {
		t.Errorf("msg = %q, want retrying", got.Msg)
	}
	// Other kinds are left alone.
	if n, ok := got.G.Attempt.(float64); !ok || n != 3 {
		t.Errorf("g.attempt = %#v, want the number 3", got.G.Attempt)
	}
}

func TestNewLoggerTextWritesReadableDurations(t *testing.T) {
	var buf bytes.Buffer
	logDurations(NewLogger(&buf, "info", "text"))

	line := buf.String()
	for _, want := range []string{
		"timeout=30s", "g.retry_in=1.5s", "g.backoff=250µs", "g.elapsed=2m3s",
		"g.lazy=90ms", "g.inner.wait=1h0m0s", "g.attempt=3",
	} {
		if !strings.Contains(line, want) {
			t.Errorf("text line lacks %q: %s", want, line)
		}
	}
}

func TestNewLoggerKeepsTraceIDsAndLevel(t *testing.T) {
	var buf bytes.Buffer
	log := NewLogger(&buf, "warn", "json")
	log.Info("dropped", "retry_in", time.Second)
	if buf.Len() != 0 {
		t.Fatalf("info logged at level warn: %s", buf.Bytes())
	}
	sc := trace.NewSpanContext(trace.SpanContextConfig{
		TraceID:    trace.TraceID{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16},
		SpanID:     trace.SpanID{1, 2, 3, 4, 5, 6, 7, 8},
		TraceFlags: trace.FlagsSampled,
	})
	log.WarnContext(trace.ContextWithSpanContext(context.Background(), sc), "kept", "retry_in", time.Second)
	var got map[string]any
	if err := json.Unmarshal(buf.Bytes(), &got); err != nil {
		t.Fatalf("decode %q: %v", buf.Bytes(), err)
	}
	if got["retry_in"] != "1s" || got["level"] != "WARN" {
		t.Errorf("got %v, want retry_in 1s at WARN", got)
	}
	if got["trace_id"] != sc.TraceID().String() || got["span_id"] != sc.SpanID().String() {
		t.Errorf("got %v, want trace_id %s and span_id %s", got, sc.TraceID(), sc.SpanID())
	}
}
