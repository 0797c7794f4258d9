// Package outbox defines the messages that wait in PostgreSQL's outbox table
// until a relay has published them, shared by the database and broker
// adapters.
package outbox

import (
	"encoding/json"
	"time"

	"github.com/google/uuid"
)

// Kind says what a message asks of the workers.
type Kind string

// The kinds of SPEC 3.
const (
	// KindRun asks a worker to run the task.
	KindRun Kind = "task.run"
	// KindCancel tells every worker that a running task was cancelled.
	KindCancel Kind = "task.cancel"
)

// Message is one outbox row on its way to the broker.
type Message struct {
	// ID is the outbox row id, published as the AMQP message_id.
	ID         int64
	Kind       Kind
	TaskID     uuid.UUID
	RoutingKey string
	Priority   uint8
	Body       json.RawMessage
	// Headers carry the W3C trace context (traceparent, tracestate).
	Headers   map[string]string
	Attempts  int
	CreatedAt time.Time
}

// Body is the JSON body of every task message.
type Body struct {
	TaskID  uuid.UUID `json:"task_id"`
	Type    string    `json:"type"`
	Attempt int       `json:"attempt"`
}

// Outcome is what became of a batch: the ids the broker confirmed (their
// rows are deleted) and the ids that failed, with why (their rows wait for a
// later try).
type Outcome struct {
	Published []int64
	Failed    map[int64]string
}

// Fail records a failed message.
func (o *Outcome) Fail(id int64, reason string) {
	if o.Failed == nil {
		o.Failed = map[int64]string{}
	}
	o.Failed[id] = reason
}

// Stats describes the backlog.
type Stats struct {
	// Due is the number of rows ready to publish.
	Due int64
	// OldestDueAge is how long the oldest due row has waited.
	OldestDueAge time.Duration
}
