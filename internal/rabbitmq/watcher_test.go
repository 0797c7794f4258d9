package rabbitmq

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"
	"github.com/stretchr/testify/require"
)

// When a connection dies, amqp091 notifies its listeners, then its channels'
// listeners, then ends the deliveries; when the broker cancels a consumer,
// amqp091 notifies the cancel before it ends the deliveries. The watcher may
// see these in any order: whatever it sees first, Err names the cause.
func TestWatcherNamesTheCause(t *testing.T) {
	t.Parallel()
	forced := &amqp.Error{Code: amqp.ConnectionForced, Reason: "CONNECTION_FORCED - test"}
	for _, tc := range []struct {
		name string
		feed func(f *feeds)
		want string
	}{
		{
			name: "connection lost",
			feed: func(f *feeds) {
				f.conn <- forced
				f.tasks <- forced
				f.control <- forced
				f.tasksCancel <- "tag-x"
				f.lost <- "conveyor.task.x"
			},
			want: "rabbitmq: connection closed: " + forced.Error(),
		},
		{
			name: "task channel closed",
			feed: func(f *feeds) {
				f.tasks <- &amqp.Error{Code: amqp.PreconditionFailed, Reason: "unknown delivery tag"}
				f.lost <- "conveyor.task.x"
			},
			want: "rabbitmq: task channel closed: Exception (406) Reason: \"unknown delivery tag\"",
		},
		{
			name: "queue deleted",
			feed: func(f *feeds) {
				f.tasksCancel <- "tag-x"
				f.lost <- "conveyor.task.x"
			},
			want: "rabbitmq: consumer of conveyor.task.x cancelled by the broker",
		},
		{
			name: "control queue deleted",
			feed: func(f *feeds) {
				f.controlCancel <- "ctag"
				f.lost <- "amq.gen-q"
			},
			want: "rabbitmq: consumer of the control queue amq.gen-q cancelled by the broker",
		},
		{
			name: "deliveries ended",
			feed: func(f *feeds) { f.lost <- "conveyor.task.x" },
			want: "rabbitmq: deliveries of conveyor.task.x ended unexpectedly",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			for range 200 {
				c := &Consumer{
					single: lane{tags: map[string]string{"tag-x": "conveyor.task.x"}},
					lost:   make(chan string, 2),
					done:   make(chan struct{}),
					quit:   make(chan struct{}),
				}
				f := &feeds{
					conn: make(chan *amqp.Error, 1), tasks: make(chan *amqp.Error, 1), control: make(chan *amqp.Error, 1),
					tasksCancel: make(chan string, 1), controlCancel: make(chan string, 1), lost: c.lost,
				}
				tc.feed(f)
				w := &watcher{c: c, conn: f.conn, tasks: f.tasks, control: f.control,
					tasksCancel: f.tasksCancel, controlCancel: f.controlCancel, controlQueue: "amq.gen-q"}
				c.wg.Add(1)
				go w.run()
				<-c.done
				close(c.quit)
				c.wg.Wait()
				require.EqualError(t, c.Err(), tc.want)
			}
		})
	}
}

type feeds struct {
	conn, tasks, control       chan *amqp.Error
	tasksCancel, controlCancel chan string
	lost                       chan string
}
