package rabbitmq_test

import (
	"context"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/outbox"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// Deliveries settled out of order, from two queues whose deliveries share
// the channel's tags, some requeued on the way: the settler's multiple acks
// never cover a delivery that is not settled, nor name a settled one (the
// broker would close the channel), and every ack lands: once the consumer
// is closed, nothing is left to requeue.
func TestConsumerSettlesOutOfOrderWithoutLosingOrRepeatingAnAck(t *testing.T) {
	t.Parallel()
	v := newVhost(t)
	c, err := rabbitmq.DialConsumer(v.url, "test-consumer", rabbitmq.ClassicQueues, []string{"a", "b"}, 64, 64)
	require.NoError(t, err)
	defer func() { _ = c.Close() }()
	p := dialPublisher(t, v)

	const n = 400
	msgs := make([]outbox.Message, n)
	for i := range msgs {
		msgs[i] = runMessage(int64(i+1), []string{"a", "b"}[i%2])
	}
	require.Len(t, p.Publish(context.Background(), msgs).Published, n)

	acked := map[string]bool{}
	requeued := map[string]bool{}
	for len(acked) < n {
		// Take what the prefetch window holds, then settle it shuffled.
		window := []outbox.Delivery{next(t, c, c.Deliveries(), "delivery")}
	more:
		for len(window) < 64 {
			select {
			case d := <-c.Deliveries():
				window = append(window, d)
			default:
				break more
			}
		}
		rand.Shuffle(len(window), func(i, j int) { window[i], window[j] = window[j], window[i] })
		for _, d := range window {
			require.False(t, acked[d.MessageID], "message %s delivered again after its ack", d.MessageID)
			if !requeued[d.MessageID] && rand.IntN(10) == 0 {
				requeued[d.MessageID] = true
				require.NoError(t, d.Requeue())
				continue
			}
			acked[d.MessageID] = true
			require.NoError(t, d.Ack())
		}
		requireOpen(t, c)
	}
	require.NotEmpty(t, requeued)
	require.NoError(t, c.Close())
	for _, typ := range []string{"a", "b"} {
		require.Zero(t, testenv.QueueDepth(t, v.url, rabbitmq.QueueName(typ)), "unacked deliveries went back to %s", typ)
	}
}
