package rabbitmq_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
)

// queueStats reads type, ready and unacknowledged of the task queues of the
// vhost, by queue name, as rabbitmqctl prints them.
func queueStats(t *testing.T, v vhost) map[string]string {
	t.Helper()
	stats := map[string]string{}
	for line := range strings.SplitSeq(strings.TrimSpace(ctl(t, "list_queues", "-p", v.name, "--no-table-headers",
		"name", "type", "messages_ready", "messages_unacknowledged")), "\n") {
		if name, rest, ok := strings.Cut(line, "\t"); ok &&
			(strings.HasPrefix(name, rabbitmq.QueueName("")) || strings.HasPrefix(name, rabbitmq.PackedQueueName(""))) {
			stats[name] = rest
		}
	}
	return stats
}

// On quorum queues the prefetch is per consumer: each type's queue may
// have prefetch messages unacknowledged, not all of them together.
func TestQuorumConsumerGivesEachQueueTheCredit(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c, err := rabbitmq.DialConsumer(v.url, "test-consumer", rabbitmq.QuorumQueues, []string{"a", "b"}, 2, 2)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	p := dialPublisher(t, v)

	var msgs []outbox.Message
	for i := range 6 {
		msgs = append(msgs, runMessage(int64(i+1), []string{"a", "b"}[i%2]))
	}
	require.Len(t, p.Publish(context.Background(), msgs).Published, 6)

	want := map[string]string{
		rabbitmq.QueueName("a"):       "quorum\t1\t2",
		rabbitmq.QueueName("b"):       "quorum\t1\t2",
		rabbitmq.PackedQueueName("a"): "quorum\t0\t0",
		rabbitmq.PackedQueueName("b"): "quorum\t0\t0",
	}
	eventually(t, wait, func() error {
		if got := queueStats(t, v); fmt.Sprint(got) != fmt.Sprint(want) {
			return fmt.Errorf("queues (type, ready, unacked) are %v, want %v", got, want)
		}
		return nil
	})
	// The broker keeps the per-consumer credit a consumer started with: a
	// new prefetch is accepted but holds for the next connection's
	// consumers.
	require.NoError(t, c.SetPrefetch(1))
	for range 6 {
		d := next(t, c, c.Deliveries(), "delivery")
		require.NoError(t, d.Err)
		require.NoError(t, d.Ack())
	}
	requireOpen(t, c)
}

// A queue declared with one type, or one maximum priority, cannot be
// declared with another: the broker's PRECONDITION_FAILED comes back naming
// the variables to check.
func TestDeclareTaskQueueOfOtherArgumentsNamesTheVariables(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	fifo := rabbitmq.Queues{Type: rabbitmq.Classic}
	for _, tt := range []struct {
		name        string
		first, then rabbitmq.Queues
	}{
		{"classic", rabbitmq.ClassicQueues, rabbitmq.QuorumQueues},
		{"quorum", rabbitmq.QuorumQueues, rabbitmq.ClassicQueues},
		{"fifo", fifo, rabbitmq.ClassicQueues},
		{"priorities", rabbitmq.ClassicQueues, fifo},
	} {
		taskType := "declared-" + tt.name
		ch := channel(t, v)
		require.NoError(t, rabbitmq.DeclareExchanges(ch))
		require.NoError(t, rabbitmq.DeclareTaskQueueOf(ch, taskType, tt.first))
		require.NoError(t, rabbitmq.DeclareTaskQueueOf(ch, taskType, tt.first), "idempotent")

		err := rabbitmq.DeclareTaskQueueOf(ch, taskType, tt.then)
		require.ErrorContains(t, err, "check that AMQP_QUEUE_TYPE and AMQP_MAX_PRIORITY", tt.name)
		var ae *amqp.Error
		require.True(t, errors.As(err, &ae), "%v", err)
		require.Equal(t, amqp.PreconditionFailed, ae.Code)

		// A worker declaring otherwise fails the same way, before consuming.
		_, err = rabbitmq.DialConsumer(v.url, "test-consumer", tt.then, []string{taskType}, 4, 4)
		require.ErrorContains(t, err, "AMQP_MAX_PRIORITY", tt.name)
		require.True(t, rabbitmq.Refused(err), "%v", err)
	}
	stats := queueStats(t, v)
	require.Equal(t, "classic\t0\t0", stats[rabbitmq.QueueName("declared-classic")])
	require.Equal(t, "quorum\t0\t0", stats[rabbitmq.QueueName("declared-quorum")])
	require.Equal(t, "classic\t0\t0", stats[rabbitmq.QueueName("declared-fifo")])
}

func TestParseQueueType(t *testing.T) {
	t.Parallel()
	for s, want := range map[string]rabbitmq.QueueType{"classic": rabbitmq.Classic, "quorum": rabbitmq.Quorum} {
		got, err := rabbitmq.ParseQueueType(s)
		require.NoError(t, err)
		require.Equal(t, want, got)
	}
	for _, s := range []string{"", "stream", "Quorum"} {
		_, err := rabbitmq.ParseQueueType(s)
		require.Error(t, err, s)
	}
}

// A nacked publish makes the publisher give up its channel once the batch
// is done: on RabbitMQ 3.10.8 a channel that published to a quorum queue
// while its leader was lost had every later publish nacked, a new channel's
// confirmed. A full queue that rejects publishes nacks them too.
func TestPublisherGivesUpItsChannelAfterANack(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	ch := channel(t, v)
	require.NoError(t, rabbitmq.DeclareExchanges(ch))
	_, err := ch.QueueDeclare("full", true, false, false, false, amqp.Table{"x-max-length": int32(1), "x-overflow": "reject-publish"})
	require.NoError(t, err)
	require.NoError(t, ch.QueueBind("full", "full", rabbitmq.TasksExchange, false, nil))
	p := dialPublisher(t, v)

	out := p.Publish(context.Background(), []outbox.Message{runMessage(1, "full"), runMessage(2, "full")})
	require.Equal(t, []int64{1}, out.Published)
	require.Equal(t, map[int64]string{2: "nacked by the broker"}, out.Failed)
	within(t, p.Done(), wait, "Done")
	require.ErrorContains(t, p.Err(), "nacked by the broker: publishing on a new channel")

	// The owner dials again; nothing nacked, nothing given up.
	p = dialPublisher(t, v)
	_, err = ch.QueuePurge("full", false)
	require.NoError(t, err)
	require.Equal(t, []int64{3}, p.Publish(context.Background(), []outbox.Message{runMessage(3, "full")}).Published)
	require.NoError(t, p.Err())
}
