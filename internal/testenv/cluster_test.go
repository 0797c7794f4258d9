package testenv_test

import (
	"slices"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// A private cluster runs all its nodes; a quorum queue keeps a confirmed
// message through the SIGKILL of the node that leads it, and the killed
// node comes back into the cluster.
func TestPrivateRabbitClusterKeepsAQuorumQueueThroughAKill(t *testing.T) {
	if testing.Short() {
		t.Skip("starts three RabbitMQ nodes")
	}
	t.Parallel()
	nodes := testenv.StartRabbitCluster(t, 3)
	running, err := nodes[2].RunningNodes()
	require.NoError(t, err)
	require.Len(t, running, 3)

	// Declared through node 1, the queue is led from there.
	ch := dial(t, nodes[0].URL())
	_, err = ch.QueueDeclare("q", true, false, false, false, amqp.Table{amqp.QueueTypeArg: amqp.QueueTypeQuorum})
	require.NoError(t, err)
	require.NoError(t, ch.Confirm(false))
	confirmed := ch.NotifyPublish(make(chan amqp.Confirmation, 1))
	require.NoError(t, ch.Publish("", "q", false, false, amqp.Publishing{Body: []byte("kept")}))
	require.True(t, (<-confirmed).Ack)
	require.Contains(t, nodes[1].Ctl(t, "list_queues", "--no-table-headers", "name", "type", "leader"), "q\tquorum\t"+nodes[0].Name)

	nodes[0].Kill(t)
	require.Error(t, nodes[0].Ping(), "killed")
	ch = dial(t, nodes[1].URL())
	testenv.Eventually(t, 30*time.Second, func() error {
		_, err := ch.QueueDeclarePassive("q", true, false, false, false, nil)
		if err != nil {
			ch = dial(t, nodes[1].URL()) // the failed declare closed the channel
		}
		return err
	})
	var got amqp.Delivery
	testenv.Eventually(t, 30*time.Second, func() error {
		var ok bool
		got, ok, err = ch.Get("q", true)
		if err == nil && !ok {
			err = errEmpty
		}
		if err != nil && ch.IsClosed() {
			ch = dial(t, nodes[1].URL())
		}
		return err
	})
	require.Equal(t, "kept", string(got.Body))

	nodes[0].Start(t)
	testenv.Eventually(t, 60*time.Second, func() error {
		running, err := nodes[1].RunningNodes()
		if err == nil && !slices.Contains(running, nodes[0].Name) {
			err = errNotBack
		}
		return err
	})
	require.True(t, strings.HasPrefix(nodes[0].Ctl(t, "list_queues", "--no-table-headers", "name", "type"), "q\tquorum"))
}

type testError string

func (e testError) Error() string { return string(e) }

const (
	errEmpty   = testError("queue empty")
	errNotBack = testError("killed node not running in the cluster yet")
)

// dial opens a connection (closed when t ends) and a channel on it.
func dial(t *testing.T, url string) *amqp.Channel {
	t.Helper()
	conn, err := amqp.Dial(url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	return ch
}
