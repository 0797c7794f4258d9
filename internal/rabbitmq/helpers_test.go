package rabbitmq_test

import (
	"fmt"
	"net/url"
	"os/exec"
	"strings"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// vhost is a vhost of the shared broker, created for one test.
type vhost struct {
	name string
	url  string
}

// newVhost creates a vhost on the shared broker for t (deleted when t ends).
func newVhost(t *testing.T) vhost {
	t.Helper()
	raw := testenv.NewVhost(t)
	u, err := url.Parse(raw)
	require.NoError(t, err)
	return vhost{name: strings.TrimPrefix(u.Path, "/"), url: raw}
}

// ctl runs rabbitmqctl against the shared broker.
func ctl(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput()
	require.NoError(t, err, "rabbitmqctl %v: %s", args, out)
	return string(out)
}

// eventually polls cond until it returns nil, failing t with its last error
// once timeout has passed.
func eventually(t *testing.T, timeout time.Duration, cond func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		err := cond()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("condition not met within %s: %v", timeout, err)
		}
		<-tick.C
	}
}

// within waits for ch to be closed or yield, failing t after timeout.
func within[T any](t *testing.T, ch <-chan T, timeout time.Duration, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(timeout):
		t.Fatalf("%s: nothing within %s", what, timeout)
		var zero T
		return zero
	}
}

// channel opens a connection of the test's own and a channel on it.
func channel(t *testing.T, v vhost) *amqp.Channel {
	t.Helper()
	conn, err := amqp.Dial(v.url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	ch, err := conn.Channel()
	require.NoError(t, err)
	return ch
}

// controlQueue is the name of the one server-named (control) queue of v.
func controlQueue(t *testing.T, v vhost) string {
	t.Helper()
	var names []string
	for _, line := range strings.Split(ctl(t, "list_queues", "-p", v.name, "name", "--no-table-headers"), "\n") {
		if name := strings.TrimSpace(line); strings.HasPrefix(name, "amq.gen-") {
			names = append(names, name)
		}
	}
	require.Len(t, names, 1, fmt.Sprintf("control queues of %s", v.name))
	return names[0]
}
