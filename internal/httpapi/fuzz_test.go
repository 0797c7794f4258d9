package httpapi

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// recordingStore stands in for PostgreSQL in the fuzz test (the handler's
// decoding and validation are under test, not the database): it checks
// that whatever reaches it obeys the submission rules.
type recordingStore struct {
	Store
	t *testing.T
}

func (s recordingStore) Submit(_ context.Context, _ auth.Principal, sub task.Submission, _ task.Carrier) (task.Submitted, error) {
	s.check(sub)
	return task.Submitted{Task: fromSubmission(sub), Created: true}, nil
}

func (s recordingStore) SubmitBatch(_ context.Context, _ auth.Principal, subs []task.Submission, _ task.Carrier) ([]task.Submitted, error) {
	out := make([]task.Submitted, len(subs))
	for i, sub := range subs {
		s.check(sub)
		out[i] = task.Submitted{Task: fromSubmission(sub), Created: true}
	}
	return out, nil
}

func (recordingStore) KnownTypes(context.Context) ([]string, error) { return []string{"a"}, nil }

func (s recordingStore) check(sub task.Submission) {
	if task.ValidateType(sub.Type) != nil || sub.Priority < 0 || sub.Priority > task.MaxPriority ||
		sub.MaxAttempts < 1 || !json.Valid(sub.Payload) || !json.Valid(sub.Metadata) ||
		sub.Payload[0] != '{' || len(sub.InputHash) != 64 || len(sub.RequestHash) != 64 {
		s.t.Fatalf("an invalid submission reached the store: %+v", sub)
	}
}

func fromSubmission(sub task.Submission) task.Task {
	now := time.Now()
	return task.Task{ID: uuid.Must(uuid.NewV7()), Type: sub.Type, Status: task.StatusPending, Payload: sub.Payload,
		Metadata: sub.Metadata, Priority: sub.Priority, MaxAttempts: sub.MaxAttempts, CreatedAt: now, UpdatedAt: now}
}

// FuzzSubmit throws arbitrary bodies at both submit endpoints: the answer is
// always a 2xx or a 4xx problem document, never a 5xx or a panic, and only
// valid submissions reach the store.
func FuzzSubmit(f *testing.F) {
	for _, seed := range []string{
		`{"type":"demo.sleep","payload":{"steps":3}}`,
		`{"type":"a","priority":9,"max_attempts":100,"dedupe":false,"metadata":{"k":[1,2.5e10,null]}}`,
		`{"type":"a","payload":{"s":"\u00e9\ud83d\ude00"}}`,
		`{"tasks":[{"type":"a"},{"type":"b","idempotency_key":"k"}]}`,
		`{"type":"a","payload":[[[[[]]]]]}`, `{"type":7}`, `{"type":"a"} {}`, `[]`, `null`, ``,
		"{\"type\":\"a\",\"payload\":{\"s\":\"\xff\"}}",
	} {
		f.Add(seed, false)
		f.Add(seed, true)
	}
	f.Fuzz(func(t *testing.T, body string, batch bool) {
		h := NewHandler(Config{MaxBodyBytes: 1 << 16, Defaults: task.Defaults{MaxAttempts: 3}, JaegerUIURL: "http://j"},
			Deps{Store: recordingStore{t: t}, Auth: DevMode(auth.Principal{Kind: auth.KindDev, Role: auth.Writer}), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
				TracerProvider: noop.NewTracerProvider(), Propagator: propagation.TraceContext{},
				Registry: prometheus.NewRegistry()})
		path := "/v1/tasks"
		if batch {
			path = "/v1/tasks/batch"
		}
		req := httptest.NewRequest(http.MethodPost, path, bytes.NewBufferString(body))
		req.Header.Set("Content-Type", "application/json")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		switch code := rec.Code; {
		case code == http.StatusOK || code == http.StatusCreated:
			if !json.Valid(rec.Body.Bytes()) {
				t.Fatalf("%d with a body that is not JSON: %q", code, rec.Body)
			}
		case code >= 400 && code < 500:
			if ct := rec.Header().Get("Content-Type"); ct != "application/problem+json" {
				t.Fatalf("%d answered as %q", code, ct)
			}
		default:
			t.Fatalf("status %d for body %q: %s", code, body, rec.Body)
		}
	})
}

// Client input alone never names a span: a request's server span is named
// after its method and route, and a method of the client's own making is
// "other", as in the metrics. Tracing backends index span names (Jaeger's
// operations): one per made-up method would grow without bound.
func TestMadeUpMethodsNameNoSpan(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	h := NewHandler(Config{MaxBodyBytes: 1 << 16, Defaults: task.Defaults{MaxAttempts: 3}, JaegerUIURL: "http://j"},
		Deps{Store: recordingStore{t: t}, Auth: DevMode(auth.Principal{Kind: auth.KindDev, Role: auth.Writer}), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
			TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)), Propagator: propagation.TraceContext{},
			Registry: prometheus.NewRegistry()})
	for _, method := range []string{"BREW0", "BREW1", http.MethodPost} {
		req := httptest.NewRequest(method, "/v1/tasks", bytes.NewBufferString(`{"type":"a"}`))
		req.Header.Set("Content-Type", "application/json")
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	var names []string
	for _, s := range rec.Ended() {
		names = append(names, s.Name())
	}
	if want := []string{"other unmatched", "other unmatched", "POST /v1/tasks"}; !slices.Equal(names, want) {
		t.Fatalf("span names %q, want %q", names, want)
	}
}
