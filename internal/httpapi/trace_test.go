package httpapi

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// duplicateStore answers every submission with a task made earlier, in
// another request's trace.
type duplicateStore struct {
	recordingStore
	traceparent string
}

func (s duplicateStore) Submit(_ context.Context, _ auth.Principal, sub task.Submission, _ task.Carrier) (task.Submitted, error) {
	return s.earlier(sub), nil
}

func (s duplicateStore) SubmitBatch(_ context.Context, _ auth.Principal, subs []task.Submission, _ task.Carrier) ([]task.Submitted, error) {
	out := make([]task.Submitted, len(subs))
	for i, sub := range subs {
		out[i] = s.earlier(sub)
	}
	return out, nil
}

func (s duplicateStore) earlier(sub task.Submission) task.Submitted {
	t := fromSubmission(sub)
	t.Traceparent = s.traceparent
	return task.Submitted{Task: t}
}

// A submission answered with an earlier task (a duplicate) is traced in a
// trace that holds none of the task's work: the task runs in the trace of
// the request that made it. The request's span says which task it found
// and links to that trace, so that the client's trace leads to the work.
func TestDuplicateSubmitLinksToTheTasksTrace(t *testing.T) {
	const original = "4bf92f3577b34da6a3ce929d0e0e4736"
	rec := tracetest.NewSpanRecorder()
	h := NewHandler(Config{MaxBodyBytes: 1 << 16, Defaults: task.Defaults{MaxAttempts: 3}, JaegerUIURL: "http://j"},
		Deps{Store: duplicateStore{recordingStore: recordingStore{t: t}, traceparent: "00-" + original + "-00f067aa0ba902b7-01"},
			Auth: DevMode(auth.Principal{Kind: auth.KindDev, Role: auth.Writer}), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
			TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)), Propagator: propagation.TraceContext{},
			Registry: prometheus.NewRegistry()})
	for _, c := range []struct{ path, body string }{
		{"/v1/tasks", `{"type":"a"}`},
		{"/v1/tasks/batch", `{"tasks":[{"type":"a"}]}`},
	} {
		req := httptest.NewRequest(http.MethodPost, c.path, bytes.NewBufferString(c.body))
		req.Header.Set("Content-Type", "application/json")
		w := httptest.NewRecorder()
		h.ServeHTTP(w, req)
		if w.Code != http.StatusOK {
			t.Fatalf("%s: status %d: %s", c.path, w.Code, w.Body)
		}
	}
	spans := rec.Ended()
	if len(spans) != 2 {
		t.Fatalf("%d spans, want the two requests'", len(spans))
	}
	for _, s := range spans {
		var linked []string
		for _, l := range s.Links() {
			linked = append(linked, l.SpanContext.TraceID().String())
		}
		if len(linked) != 1 || linked[0] != original {
			t.Errorf("span %q links to traces %v, want the task's %s", s.Name(), linked, original)
		}
	}
	single := map[string]string{}
	for _, a := range spans[0].Attributes() {
		single[string(a.Key)] = a.Value.String()
	}
	if single["conveyor.task_id"] == "" || single["conveyor.duplicate"] != "true" {
		t.Errorf("the submission's span does not name the duplicate's task: %v", single)
	}
}

// failingStore fails every submission as a database that went away does.
type failingStore struct{ recordingStore }

func (failingStore) Submit(context.Context, auth.Principal, task.Submission, task.Carrier) (task.Submitted, error) {
	return task.Submitted{}, errors.New("tasks.submit: connection reset by peer")
}

// A request's span says whose it is, the org of its principal, so that an
// org's traces can be found; and a request that failed on the server's
// side holds the error in its trace, not only a 500 whose reason is in the
// logs alone.
func TestRequestSpansNameTheOrgAndRecordServerErrors(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	org := uuid.New()
	h := NewHandler(Config{MaxBodyBytes: 1 << 16, Defaults: task.Defaults{MaxAttempts: 3}, JaegerUIURL: "http://j"},
		Deps{Store: failingStore{recordingStore{t: t}},
			Auth: DevMode(auth.Principal{Kind: auth.KindDev, OrgID: org, Role: auth.Writer}), Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
			TracerProvider: sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec)), Propagator: propagation.TraceContext{},
			Registry: prometheus.NewRegistry()})
	req := httptest.NewRequest(http.MethodPost, "/v1/tasks", bytes.NewBufferString(`{"type":"a"}`))
	req.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	require.Equal(t, http.StatusInternalServerError, w.Code, w.Body.String())
	require.NotContains(t, w.Body.String(), "connection reset", "the client is not told")

	spans := rec.Ended()
	require.Len(t, spans, 1)
	s := spans[0]
	attrs := map[string]string{}
	for _, a := range s.Attributes() {
		attrs[string(a.Key)] = a.Value.String()
	}
	require.Equal(t, org.String(), attrs["conveyor.org_id"], "the span names the principal's org")
	require.Equal(t, codes.Error, s.Status().Code)
	var recorded []string
	for _, e := range s.Events() {
		for _, a := range e.Attributes {
			if e.Name == "exception" && a.Key == "exception.message" {
				recorded = append(recorded, a.Value.AsString())
			}
		}
	}
	require.Equal(t, []string{"tasks.submit: connection reset by peer"}, recorded, "the span records the error")
}
