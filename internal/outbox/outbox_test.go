package outbox

import (
	"testing"

	"github.com/google/uuid"
)

func TestBodiesReadBackAsWritten(t *testing.T) {
	msgs := []Message{
		{ID: 1, Kind: KindRun, TaskID: uuid.New(), TaskType: "email.send", Attempt: 2, TaskVersion: 5,
			Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}},
		{ID: 2, Kind: KindRun, TaskID: uuid.New(), TaskType: "email.send", TaskVersion: 1},
	}
	b, err := DecodeBody(msgs[0].EncodeBody())
	if err != nil || b != msgs[0].Body() {
		t.Fatalf("DecodeBody = %+v, %v; want %+v", b, err, msgs[0].Body())
	}
	packed, err := DecodePacked(EncodePacked(msgs))
	if err != nil || len(packed) != len(msgs) {
		t.Fatalf("DecodePacked = %+v, %v", packed, err)
	}
	for i, p := range packed {
		if p.Body != msgs[i].Body() || len(p.Headers) != len(msgs[i].Headers) ||
			p.Headers["traceparent"] != msgs[i].Headers["traceparent"] {
			t.Errorf("task %d = %+v; want %+v with headers %v", i, p, msgs[i].Body(), msgs[i].Headers)
		}
	}
}

func TestBodiesIgnoreFieldsTheyDoNotKnow(t *testing.T) {
	// A relay of a later version may write more than this one reads.
	id := uuid.New()
	b, err := DecodeBody([]byte(`{"task_id": "` + id.String() + `", "type": "t", "version": 3, "shard": 7}`))
	if err != nil || b != (Body{TaskID: id, Type: "t", Version: 3}) {
		t.Fatalf("DecodeBody = %+v, %v", b, err)
	}
}

func TestMalformedBodiesFail(t *testing.T) {
	for _, body := range []string{
		`{"task_id": 7}`,
		`{"task_id": "not a uuid"}`,
		`{"task_id": "` + uuid.NewString() + `", "attempt": "one"}`,
		`[{"task_id": "` + uuid.NewString() + `"`,
	} {
		if _, err := DecodeBody([]byte(body)); err == nil {
			t.Errorf("DecodeBody(%q) succeeded", body)
		}
		if _, err := DecodePacked([]byte("[" + body + "]")); err == nil {
			t.Errorf("DecodePacked([%s]) succeeded", body)
		}
	}
}

// BenchmarkDecodePacked reads a packed message of 64 tasks, each with its
// trace context: a worker's share of every task it receives.
func BenchmarkDecodePacked(b *testing.B) {
	msgs := make([]Message, 64)
	for i := range msgs {
		msgs[i] = Message{Kind: KindRun, TaskID: uuid.New(), TaskType: "demo.noop", TaskVersion: 1,
			Headers: map[string]string{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}
	}
	body := EncodePacked(msgs)
	for b.Loop() {
		if _, err := DecodePacked(body); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(msgs)), "ns/task")
}
