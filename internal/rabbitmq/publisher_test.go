package rabbitmq_test

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// declareQueue declares taskType's queue, as a worker of the type does.
func declareQueue(t *testing.T, v vhost, taskType string) {
	t.Helper()
	ch := channel(t, v)
	require.NoError(t, rabbitmq.DeclareExchanges(ch))
	require.NoError(t, rabbitmq.DeclareTaskQueue(ch, taskType))
}

// A batch mixing a type whose queue a worker declared and a type with no
// queue: the first is published, the second unroutable (not failed), the
// broadcast published; the relay declares no queue, and the declared queue
// holds exactly the published message.
func TestPublishReturnsTypesWithoutQueue(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	declareQueue(t, v, "known")
	p := dialPublisher(t, v)

	known, unknown, cancel := runMessage(1, "known"), runMessage(2, "unknown"), runMessage(3, "known")
	cancel.Kind = outbox.KindCancel
	out := p.Publish(context.Background(), []outbox.Message{known, unknown, cancel})

	require.ElementsMatch(t, []int64{1, 3}, out.Published)
	require.Len(t, out.Unroutable, 1)
	require.Contains(t, out.Unroutable[2], "312 NO_ROUTE")
	require.Empty(t, out.Failed)

	in := rabbitmq.NewInspector(v.url, "test-inspector")
	defer func() { _ = in.Close() }()
	_, exists, err := in.QueueReady(context.Background(), "unknown")
	require.NoError(t, err)
	require.False(t, exists, "the publisher declared a task queue")

	ch := channel(t, v)
	d, ok, err := ch.Get(rabbitmq.QueueName("known"), true)
	require.NoError(t, err)
	require.True(t, ok, "the published message is not in its queue")
	_, more, err := ch.Get(rabbitmq.QueueName("known"), true)
	require.NoError(t, err)
	require.False(t, more, "the queue holds more than the published message")

	require.Equal(t, "1", d.MessageId)
	require.Equal(t, string(outbox.KindRun), d.Type)
	require.Equal(t, "application/json", d.ContentType)
	require.Equal(t, uint8(amqp.Persistent), d.DeliveryMode)
	require.Equal(t, known.Priority, d.Priority)
	require.Equal(t, known.CreatedAt.Unix(), d.Timestamp.Unix())
	require.Equal(t, known.Headers["traceparent"], d.Headers["traceparent"])
	var body map[string]any
	require.NoError(t, json.Unmarshal(d.Body, &body))
	require.Equal(t, map[string]any{
		"task_id": known.TaskID.String(), "type": "known", "attempt": 2.0, "version": 5.0,
	}, body)
}

// Returns are read while confirms are awaited: a batch with more unroutable
// messages than the returns buffer holds still reports every one of them
// (amqp091 would otherwise drop a return it cannot hand over, and the
// message would pass for published).
func TestPublishMoreReturnsThanBuffered(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	declareQueue(t, v, "known")
	p, err := rabbitmq.DialPublisher(v.url, 1, "test-publisher", 1)
	require.NoError(t, err)
	defer func() { _ = p.Close() }()

	var msgs []outbox.Message
	for i := range 30 {
		msgs = append(msgs, runMessage(int64(i+1), "type"+strconv.Itoa(i)))
	}
	msgs = append(msgs, runMessage(100, "known"))
	out := p.Publish(context.Background(), msgs)

	require.Equal(t, []int64{100}, out.Published)
	require.Len(t, out.Unroutable, 30)
	require.Empty(t, out.Failed)
}

// What a publisher cannot survive is a channel exception: publishing to an
// exchange deleted under it closes the channel, and the batch fails whole.
func TestPublishFailsBatchOnChannelException(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	declareQueue(t, v, "known")
	p := dialPublisher(t, v)
	require.NoError(t, channel(t, v).ExchangeDelete(rabbitmq.TasksExchange, false, false))

	out := p.Publish(context.Background(), []outbox.Message{runMessage(1, "known"), runMessage(2, "known")})
	require.Empty(t, out.Published)
	require.Empty(t, out.Unroutable)
	require.Len(t, out.Failed, 2)
	within(t, p.Done(), wait, "publisher Done")
	var ae *amqp.Error
	require.ErrorAs(t, p.Err(), &ae)
	require.Equal(t, amqp.NotFound, ae.Code)
}

// A broker under a resource alarm reads nothing from a connection it
// blocked, so it never answers the close: Close must give up waiting and
// drop the connection, or a relay that is stopping would wait for the
// alarm to clear. The node is private: the test raises an alarm on it.
func TestPublisherCloseDoesNotWaitForABlockedBroker(t *testing.T) {
	t.Parallel()
	node := testenv.StartRabbit(t)
	testenv.DeclareTaskQueue(t, node.URL(), "demo.noop")
	node.Ctl(t, "set_vm_memory_high_watermark", "0.000001")
	p, err := rabbitmq.DialPublisher(node.URL(), 10, t.Name(), 1)
	require.NoError(t, err)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	out := p.Publish(ctx, []outbox.Message{runMessage(1, "demo.noop"), runMessage(2, "demo.noop")})
	require.Empty(t, out.Published, "the broker blocks publishers")
	eventually(t, wait, func() error {
		if !p.Blocked() {
			return errors.New("the broker has not blocked the connection")
		}
		return nil
	})

	closed := make(chan error, 1)
	go func() { closed <- p.Close() }()
	// Close says the broker did not answer; that it returns is the point.
	_ = within(t, closed, 2*wait, "Close on a blocked connection")
	within(t, p.Done(), wait, "Done")
}

// A broker under a resource alarm blocks a connection at its first publish
// and reads nothing more from it: a batch written to it waits in the
// connection's buffers and is routed when the alarm clears, though the
// publisher reported it failed and the relay publishes its rows again. A
// connection dialled during an alarm (the relay dials again when a write
// blocked by the alarm times out) must write no batch before the broker
// has taken a message from it. The node is private: the test raises an
// alarm on it.
func TestABatchOnAConnectionDialledDuringAnAlarmIsNotRoutedLater(t *testing.T) {
	t.Parallel()
	node := testenv.StartRabbit(t)
	testenv.DeclareTaskQueue(t, node.URL(), "demo.noop")
	node.Ctl(t, "set_vm_memory_high_watermark", "0.000001")
	p, err := rabbitmq.DialPublisher(node.URL(), 10, t.Name(), 1)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	out := p.Publish(ctx, []outbox.Message{runMessage(1, "demo.noop"), runMessage(2, "demo.noop")})
	require.Len(t, out.Failed, 2, "the broker blocks publishers")

	node.Ctl(t, "set_vm_memory_high_watermark", "0.4")
	// The broker answers the close once it has read everything sent on
	// the connection before it.
	require.NoError(t, p.Close())
	p2, err := rabbitmq.DialPublisher(node.URL(), 10, t.Name(), 1)
	require.NoError(t, err)
	defer func() { _ = p2.Close() }()
	retried := []outbox.Message{runMessage(1, "demo.noop"), runMessage(2, "demo.noop")}
	out = p2.Publish(context.Background(), retried)
	require.Len(t, out.Published, 2, "%+v", out)
	var ids []string
	for _, m := range testenv.Drain(t, node.URL(), rabbitmq.QueueName("demo.noop")) {
		ids = append(ids, m.ID)
	}
	require.ElementsMatch(t, []string{"1", "2"}, ids, "each row once")
}
