package testenv

import (
	"compress/gzip"
	"encoding/hex"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync"
	"testing"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"
)

// Span is a span as an OTLP receiver decoded it.
type Span struct {
	Service      string
	Name         string
	Kind         tracepb.Span_SpanKind
	TraceID      string
	SpanID       string
	ParentSpanID string
	Attributes   map[string]string
	Events       []string
	// Links are the trace ids this span links to.
	Links []string
}

// OTLPReceiver is a real OTLP/HTTP (protobuf) trace receiver in the test
// process: point OTEL_EXPORTER_OTLP_ENDPOINT at Endpoint.
type OTLPReceiver struct {
	Endpoint string
	mu       sync.Mutex
	spans    []Span
}

// NewOTLPReceiver starts a receiver, closed when t ends.
func NewOTLPReceiver(t testing.TB) *OTLPReceiver {
	t.Helper()
	r := &OTLPReceiver{}
	srv := httptest.NewServer(http.HandlerFunc(r.handle))
	t.Cleanup(srv.Close)
	r.Endpoint = srv.URL
	return r
}

func (r *OTLPReceiver) handle(w http.ResponseWriter, req *http.Request) {
	if req.URL.Path != "/v1/traces" {
		w.WriteHeader(http.StatusOK) // metrics and logs are not collected
		return
	}
	var body io.Reader = req.Body
	if req.Header.Get("Content-Encoding") == "gzip" {
		gz, err := gzip.NewReader(req.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		defer gz.Close()
		body = gz
	}
	data, err := io.ReadAll(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var msg coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(data, &msg); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.mu.Lock()
	for _, rs := range msg.GetResourceSpans() {
		service := attrs(rs.GetResource().GetAttributes())["service.name"]
		for _, ss := range rs.GetScopeSpans() {
			for _, s := range ss.GetSpans() {
				span := Span{
					Service: service, Name: s.GetName(), Kind: s.GetKind(),
					TraceID: hex.EncodeToString(s.GetTraceId()), SpanID: hex.EncodeToString(s.GetSpanId()),
					ParentSpanID: hex.EncodeToString(s.GetParentSpanId()), Attributes: attrs(s.GetAttributes()),
				}
				for _, e := range s.GetEvents() {
					span.Events = append(span.Events, e.GetName())
				}
				for _, l := range s.GetLinks() {
					span.Links = append(span.Links, hex.EncodeToString(l.GetTraceId()))
				}
				r.spans = append(r.spans, span)
			}
		}
	}
	r.mu.Unlock()
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

// Spans returns every span received so far.
func (r *OTLPReceiver) Spans() []Span {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Span(nil), r.spans...)
}

// Trace returns the spans of one trace.
func (r *OTLPReceiver) Trace(traceID string) []Span {
	var out []Span
	for _, s := range r.Spans() {
		if s.TraceID == traceID {
			out = append(out, s)
		}
	}
	return out
}

func attrs(kvs []*commonpb.KeyValue) map[string]string {
	m := make(map[string]string, len(kvs))
	for _, kv := range kvs {
		switch v := kv.GetValue().GetValue().(type) {
		case *commonpb.AnyValue_StringValue:
			m[kv.GetKey()] = v.StringValue
		case *commonpb.AnyValue_IntValue:
			m[kv.GetKey()] = strconv.FormatInt(v.IntValue, 10)
		case *commonpb.AnyValue_BoolValue:
			m[kv.GetKey()] = strconv.FormatBool(v.BoolValue)
		default:
			m[kv.GetKey()] = kv.GetValue().String()
		}
	}
	return m
}
