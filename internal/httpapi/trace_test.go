package httpapi

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
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
