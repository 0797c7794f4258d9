package testenv

import (
	"fmt"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/rabbitmq"
)

// channel opens a connection and a channel to url, closed when the caller
// calls the returned function.
func channel(t testing.TB, url string) (*amqp.Channel, func()) {
	t.Helper()
	conn, err := amqp.Dial(url)
	if err != nil {
		t.Fatalf("testenv: dial: %v", err)
	}
	ch, err := conn.Channel()
	if err != nil {
		_ = conn.Close()
		t.Fatalf("testenv: channel: %v", err)
	}
	return ch, func() { _ = conn.Close() }
}

// Message is a message drained from a queue by a test.
type Message struct {
	ID       string
	Priority uint8
	Mode     uint8
	Type     string
	Headers  map[string]any
	Body     []byte
}

// DeclareTaskQueue declares the exchanges and the queue of a task type, as a
// worker of the type does when it starts.
func DeclareTaskQueue(t testing.TB, url, taskType string) {
	t.Helper()
	ch, closeConn := channel(t, url)
	defer closeConn()
	if err := rabbitmq.DeclareExchanges(ch); err != nil {
		t.Fatalf("testenv: %v", err)
	}
	if err := rabbitmq.DeclareTaskQueue(ch, taskType); err != nil {
		t.Fatalf("testenv: %v", err)
	}
}

// QueueDepth returns the number of ready messages in queue, or -1 when the
// queue does not exist.
func QueueDepth(t testing.TB, url, queue string) int {
	t.Helper()
	ch, closeConn := channel(t, url)
	defer closeConn()
	q, err := ch.QueueDeclarePassive(queue, true, false, false, false, nil)
	if err != nil {
		return -1
	}
	return q.Messages
}

// Drain takes (and acks) every message waiting in queue.
func Drain(t testing.TB, url, queue string) []Message {
	t.Helper()
	ch, closeConn := channel(t, url)
	defer closeConn()
	var out []Message
	for {
		d, ok, err := ch.Get(queue, true)
		if err != nil {
			t.Fatalf("testenv: get from %s: %v", queue, err)
		}
		if !ok {
			return out
		}
		out = append(out, Message{ID: d.MessageId, Priority: d.Priority, Mode: d.DeliveryMode,
			Type: d.Type, Headers: d.Headers, Body: d.Body})
	}
}

// WaitForDepth waits until queue holds want ready messages.
func WaitForDepth(t testing.TB, url, queue string, want int, timeout time.Duration) {
	t.Helper()
	Eventually(t, timeout, func() error {
		if got := QueueDepth(t, url, queue); got != want {
			return &depthError{queue: queue, got: got, want: want}
		}
		return nil
	})
}

type depthError struct {
	queue     string
	got, want int
}

func (e *depthError) Error() string {
	return fmt.Sprintf("queue %s holds %d messages, want %d", e.queue, e.got, e.want)
}

// PurgeQueue deletes every ready message of queue, as an operator (or a
// broker losing its data) would, and returns how many went.
func PurgeQueue(t testing.TB, url, queue string) int {
	t.Helper()
	ch, closeConn := channel(t, url)
	defer closeConn()
	n, err := ch.QueuePurge(queue, false)
	if err != nil {
		t.Fatalf("testenv: purge %s: %v", queue, err)
	}
	return n
}
