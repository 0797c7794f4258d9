package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/conveyorhq/conveyor/internal/testdb"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// One trace per task: the api, relay and worker processes export to a real
// OTLP/HTTP receiver in the test, and the trace must hold the API's server
// span, the relay's producer span under it and the worker's consumer span
// under that, with the claim's database span and the progress events
// beneath. A retry starts a new trace linked to the first.
func TestOneTracePerTaskAcrossProcesses(t *testing.T) {
	skipShort(t)
	t.Parallel()
	otlp := testenv.NewOTLPReceiver(t)
	otel := []string{
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + otlp.Endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf",
		"OTEL_BSP_SCHEDULE_DELAY=100",
	}
	db := testdb.New(t)
	b := setupWith(t, db.URL, db.Pool, testenv.NewVhost(t), otel...)
	// The worker's queue exists before the task is submitted, so its message
	// is published once (a message for a type without a queue is parked,
	// then published again: a second producer span).
	admin := testenv.FreeAddr(t)
	b.startWorker(t, "w1", append(otel, "WORKER_ADMIN_ADDR="+admin)...)
	testenv.WaitHTTP(t, "http://"+admin+"/readyz", 30*time.Second)

	id := b.sleepTask(t, 3, 20)
	b.waitStatus(t, id, "COMPLETED", 30*time.Second)
	traceID := b.traceID(t, id)

	var server, producer, consumer testenv.Span
	testenv.Eventually(t, 20*time.Second, func() error {
		spans := otlp.Trace(traceID)
		var ok bool
		if server, ok = find(spans, "conveyor-api", tracepb.Span_SPAN_KIND_SERVER, "POST /v1/tasks"); !ok {
			return fmt.Errorf("no api server span in %s", describe(spans))
		}
		if producer, ok = find(spans, "conveyor-relay", tracepb.Span_SPAN_KIND_PRODUCER, "publish conveyor.tasks"); !ok {
			return fmt.Errorf("no relay producer span in %s", describe(spans))
		}
		if consumer, ok = find(spans, "conveyor-worker", tracepb.Span_SPAN_KIND_CONSUMER, "process conveyor.task.demo.sleep"); !ok {
			return fmt.Errorf("no worker consumer span in %s", describe(spans))
		}
		return nil
	})
	spans := otlp.Trace(traceID)
	require.Empty(t, server.ParentSpanID, "the API's server span is the root")
	requireDescends(t, spans, producer, server.SpanID)
	require.Equal(t, producer.SpanID, consumer.ParentSpanID, "the consumer continues the producer")
	for _, s := range []testenv.Span{producer, consumer} {
		require.Equal(t, "rabbitmq", s.Attributes["messaging.system"])
		require.Equal(t, "conveyor.tasks", s.Attributes["messaging.destination.name"])
		require.Equal(t, "demo.sleep", s.Attributes["messaging.rabbitmq.destination.routing_key"])
		require.NotEmpty(t, s.Attributes["messaging.message.id"])
		require.Equal(t, id.String(), s.Attributes["conveyor.task_id"])
	}
	require.Equal(t, producer.Attributes["messaging.message.id"], consumer.Attributes["messaging.message.id"])
	require.Contains(t, consumer.Events, "progress")
	dbUnderConsumer := map[string]int{}
	for _, s := range spans {
		if s.Service == "conveyor-worker" && s.ParentSpanID == consumer.SpanID &&
			s.Kind == tracepb.Span_SPAN_KIND_CLIENT && s.Name != "pool.acquire" {
			dbUnderConsumer[s.Name]++
		}
	}
	require.NotZero(t, dbUnderConsumer["tasks.claim"], "the claim's database span, named after its statement, hangs under the consumer span: %s", describe(spans))
	require.NotZero(t, dbUnderConsumer["tasks.apply.complete"], "so do the outcome's: %s", describe(spans))

	// A retried task: its second attempt is a new trace linked to the first.
	retried := b.submit(t, "demo.sleep", map[string]any{"steps": 1, "step_ms": 1, "fail_times": 1}, 3)
	b.waitStatus(t, retried, "COMPLETED", 30*time.Second)
	second := b.traceID(t, retried)
	testenv.Eventually(t, 20*time.Second, func() error {
		spans := otlp.Trace(second)
		link, ok := find(spans, "conveyor-worker", tracepb.Span_SPAN_KIND_INTERNAL, "schedule retry")
		if !ok {
			return fmt.Errorf("no retry span in the second trace: %s", describe(spans))
		}
		if len(link.Links) != 1 || link.Links[0] == second {
			return fmt.Errorf("retry span links %v", link.Links)
		}
		first := otlp.Trace(link.Links[0])
		if _, ok := find(first, "conveyor-worker", tracepb.Span_SPAN_KIND_CONSUMER, "process conveyor.task.demo.sleep"); !ok {
			return fmt.Errorf("the linked trace holds no first attempt: %s", describe(first))
		}
		if _, ok := find(spans, "conveyor-worker", tracepb.Span_SPAN_KIND_CONSUMER, "process conveyor.task.demo.sleep"); !ok {
			return fmt.Errorf("no second attempt in the new trace: %s", describe(spans))
		}
		return nil
	})
}

// traceID is the trace the API reports for a task.
func (b *bundle) traceID(t *testing.T, id uuid.UUID) string {
	t.Helper()
	resp, err := b.client.Get(b.api + "/v1/tasks/" + id.String())
	require.NoError(t, err)
	defer resp.Body.Close()
	var v struct {
		TraceID  string `json:"trace_id"`
		TraceURL string `json:"trace_url"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&v))
	require.Len(t, v.TraceID, 32)
	require.True(t, strings.HasSuffix(v.TraceURL, "/trace/"+v.TraceID), v.TraceURL)
	return v.TraceID
}

func find(spans []testenv.Span, service string, kind tracepb.Span_SpanKind, name string) (testenv.Span, bool) {
	for _, s := range spans {
		if s.Service == service && s.Kind == kind && s.Name == name {
			return s, true
		}
	}
	return testenv.Span{}, false
}

// requireDescends checks that s hangs, directly or through spans of the
// same trace, under the span ancestor.
func requireDescends(t *testing.T, spans []testenv.Span, s testenv.Span, ancestor string) {
	t.Helper()
	byID := map[string]testenv.Span{}
	for _, x := range spans {
		byID[x.SpanID] = x
	}
	for cur := s; cur.ParentSpanID != ""; {
		if cur.ParentSpanID == ancestor {
			return
		}
		parent, ok := byID[cur.ParentSpanID]
		require.True(t, ok, "span %q has a parent outside the trace: %s", cur.Name, describe(spans))
		cur = parent
	}
	t.Fatalf("span %q does not descend from %s: %s", s.Name, ancestor, describe(spans))
}

func describe(spans []testenv.Span) string {
	var b strings.Builder
	for _, s := range spans {
		fmt.Fprintf(&b, "\n  %s %s %q span=%s parent=%s", s.Service, s.Kind, s.Name, s.SpanID, s.ParentSpanID)
	}
	return b.String()
}
