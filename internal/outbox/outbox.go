// Package outbox defines the messages Conveyor sends through the broker: how
// they wait in PostgreSQL's outbox table until a relay has published them,
// what their body says, and how a consumer receives them. The database and
// broker adapters share these types; neither owns them.
package outbox

import (
	"encoding/json"
	"time"

	jsonv2 "github.com/go-json-experiment/json"
	"github.com/google/uuid"
)

// Kind says what a message asks of the workers.
type Kind string

// The kinds of message.
const (
	// KindRun asks a worker to run the task.
	KindRun Kind = "task.run"
	// KindCancel tells every worker that a running task was cancelled.
	KindCancel Kind = "task.cancel"
)

// Message is one outbox row on its way to the broker.
type Message struct {
	// ID is the outbox row id, published as the AMQP message_id.
	ID   int64
	Kind Kind
	// OrgID is the task's org, named in the message's PRODUCER span.
	OrgID    uuid.UUID
	TaskID   uuid.UUID
	TaskType string
	// Attempt is the task's attempt count when the message was written.
	Attempt int
	// TaskVersion is the task's version when the message was written: a
	// cancel message names the run it cancels by it.
	TaskVersion int
	Priority    uint8
	// Headers carry the W3C trace context (traceparent, tracestate).
	Headers   map[string]string
	Attempts  int
	CreatedAt time.Time
	// DueAt is when the row became due (available_at when it was claimed):
	// its commit, or later for a task submitted for later, a retry after
	// its backoff or a parked row released.
	DueAt time.Time
}

// Body is what the message says, as the consumer reads it.
func (m Message) Body() Body {
	return Body{TaskID: m.TaskID, Type: m.TaskType, Attempt: m.Attempt, Version: m.TaskVersion}
}

// EncodeBody is the JSON body of the message: the one place it is built.
func (m Message) EncodeBody() []byte {
	b, _ := json.Marshal(m.Body()) // a struct of plain fields always encodes
	return b
}

// Body is the JSON body of every task message.
type Body struct {
	TaskID  uuid.UUID `json:"task_id"`
	Type    string    `json:"type"`
	Attempt int       `json:"attempt"`
	Version int       `json:"version"`
}

// Packed is one task of a packed message, a task.run message that carries
// several tasks of one type and priority: the task's body and its own
// trace context.
type Packed struct {
	Body
	Headers map[string]string `json:"headers,omitempty"`
}

// EncodePacked is the JSON body of a packed message of msgs: an array of
// their Packed.
func EncodePacked(msgs []Message) []byte {
	tasks := make([]Packed, len(msgs))
	for i, m := range msgs {
		tasks[i] = Packed{Body: m.Body(), Headers: m.Headers}
	}
	b, _ := json.Marshal(tasks) // plain fields always encode
	return b
}

// Bodies are decoded by the prototype of encoding/json/v2, which reads
// them in half the time of encoding/json (a worker decodes every task's;
// encoding/json still encodes them faster). It matches names exactly, as
// the encoders write them, and refuses duplicate names and invalid UTF-8,
// which no body of ours holds.

// DecodeBody reads the JSON body of a message.
func DecodeBody(data []byte) (Body, error) {
	var b Body
	err := jsonv2.Unmarshal(data, &b)
	return b, err
}

// DecodePacked reads the JSON body of a packed message.
func DecodePacked(data []byte) ([]Packed, error) {
	var tasks []Packed
	err := jsonv2.Unmarshal(data, &tasks)
	return tasks, err
}

// Outcome is what became of a batch: the ids the broker confirmed (their
// rows are deleted), the ids no queue took (their rows are parked until a
// worker for the type declares its queue) and the ids that failed otherwise,
// with why (their rows wait for a later try).
type Outcome struct {
	Published  []int64
	Unroutable map[int64]string
	Failed     map[int64]string
	// Messages counts the broker messages that carried Published: fewer
	// than its ids when tasks were packed together.
	Messages int
	// Envelopes names, for each id that went out packed with others, the
	// message that carried it: where it went and its message id (its
	// first row's), which is what the consumer sees.
	Envelopes map[int64]Envelope
}

// Envelope is the broker message that carried a packed task.
type Envelope struct {
	Exchange  string
	MessageID string
}

// Fail records a failed message.
func (o *Outcome) Fail(id int64, reason string) {
	if o.Failed == nil {
		o.Failed = map[int64]string{}
	}
	o.Failed[id] = reason
}

// Unroute records a message the broker returned because no queue is bound
// for its routing key.
func (o *Outcome) Unroute(id int64, reason string) {
	if o.Unroutable == nil {
		o.Unroutable = map[int64]string{}
	}
	o.Unroutable[id] = reason
}

// Stats describes the backlog.
type Stats struct {
	// Due is the number of rows ready to publish.
	Due int64
	// OldestDueAge is how long the oldest due row has waited.
	OldestDueAge time.Duration
	// Parked is the number of rows waiting for a worker of their type.
	Parked int64
}

// Acknowledger settles a delivery with the broker.
type Acknowledger interface {
	// Ack tells the broker the message was handled.
	Ack() error
	// Requeue hands the message back for another consumer.
	Requeue() error
	// Reject drops a message that can never be handled.
	Reject() error
}

// Delivery is a task.run message as a consumer received it.
type Delivery struct {
	Body      Body
	MessageID string
	// Exchange and Queue name where the message came from.
	Exchange string
	Queue    string
	// Headers carry the W3C trace context the relay wrote.
	Headers     map[string]string
	Redelivered bool
	// Packed says the task came in a packed message, with other tasks.
	Packed bool
	// Err is set when the body could not be read; such a delivery can only
	// be rejected.
	Err error
	Acknowledger
}

// Cancel is a task.cancel broadcast as a worker received it: the task, and
// the version at which its cancellation was requested, so that a late
// broadcast never stops a later run of the same task.
type Cancel struct {
	TaskID  uuid.UUID
	Version int
}
