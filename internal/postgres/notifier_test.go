package postgres_test

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/testdb"
)

// A notifier serves several channels: each poke reaches the listeners of
// its own channel only, and pokes of both channels before a send go out
// together.
func TestNotifierWakesTheChannelsPoked(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	conn := listen(t, ctx, db.URL, postgres.OutboxChannel, postgres.EventsChannel)
	// received waits for notifications until none comes for a while.
	received := func() map[string]int {
		got := map[string]int{}
		for {
			wctx, wcancel := context.WithTimeout(ctx, 300*time.Millisecond)
			n, err := conn.WaitForNotification(wctx)
			wcancel()
			if err != nil {
				require.NoError(t, ctx.Err())
				return got
			}
			got[n.Channel]++
		}
	}

	n := postgres.NewNotifier(db.Pool, 0, slog.New(slog.NewTextHandler(io.Discard, nil)),
		postgres.OutboxChannel, postgres.EventsChannel)
	outbox, events := n.Poker(postgres.OutboxChannel), n.Poker(postgres.EventsChannel)
	require.Panics(t, func() { n.Poker("no_such_channel") })

	outbox()
	go func() { _ = n.Run(ctx) }()
	require.Equal(t, map[string]int{postgres.OutboxChannel: 1}, received())

	events()
	require.Equal(t, map[string]int{postgres.EventsChannel: 1}, received())

	// Both poked while the notifier is busy elsewhere: the next send
	// names both, once each.
	n2 := postgres.NewNotifier(db.Pool, 0, slog.New(slog.NewTextHandler(io.Discard, nil)),
		postgres.OutboxChannel, postgres.EventsChannel)
	n2.Poker(postgres.OutboxChannel)()
	n2.Poker(postgres.EventsChannel)()
	n2.Poker(postgres.OutboxChannel)()
	go func() { _ = n2.Run(ctx) }()
	require.Equal(t, map[string]int{postgres.OutboxChannel: 1, postgres.EventsChannel: 1}, received())
}

// Under a stream of pokes, a notifier sends the first at once and then one
// statement an interval, whatever the number of pokes between.
func TestNotifierSendsOneStatementAnInterval(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := listen(t, ctx, db.URL, postgres.EventsChannel)

	const interval = 300 * time.Millisecond
	n := postgres.NewNotifier(db.Pool, interval, slog.New(slog.NewTextHandler(io.Discard, nil)), postgres.EventsChannel)
	poke := n.Poker(postgres.EventsChannel)
	go func() { _ = n.Run(ctx) }()

	start := time.Now()
	stop := make(chan struct{})
	go func() {
		for {
			poke()
			select {
			case <-stop:
				return
			case <-time.After(time.Millisecond):
			}
		}
	}()
	_, err := conn.WaitForNotification(ctx)
	require.NoError(t, err)
	first := time.Since(start)
	time.Sleep(3*interval - first)
	close(stop)
	// Pokes over three intervals: the first send, one at the end of each
	// interval, and the last pokes' own.
	sends := 1
	for {
		wctx, wcancel := context.WithTimeout(ctx, 2*interval)
		_, err := conn.WaitForNotification(wctx)
		wcancel()
		if err != nil {
			require.NoError(t, ctx.Err())
			break
		}
		sends++
	}
	require.Less(t, first, interval, "the first poke after a quiet spell is sent at once")
	require.GreaterOrEqual(t, sends, 3)
	require.LessOrEqual(t, sends, 5, "about 3,000 pokes over three intervals")
}

// listen opens a connection to url that listens on channels, closed when
// the test ends.
func listen(t *testing.T, ctx context.Context, url string, channels ...string) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close(context.Background()) })
	for _, ch := range channels {
		_, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{ch}.Sanitize())
		require.NoError(t, err)
	}
	return conn
}

// A notifier that stops sends what was poked since its last send: a
// stopping worker's last writes (its tasks handed back) wake the relays
// and the streams at once, not at their next poll.
func TestNotifierSendsThePendingPokesWhenItStops(t *testing.T) {
	t.Parallel()
	db := testdb.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn := listen(t, ctx, db.URL, postgres.OutboxChannel)

	n := postgres.NewNotifier(db.Pool, time.Hour, slog.New(slog.NewTextHandler(io.Discard, nil)), postgres.OutboxChannel)
	poke := n.Poker(postgres.OutboxChannel)
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- n.Run(runCtx) }()
	poke()
	_, err := conn.WaitForNotification(ctx)
	require.NoError(t, err, "the first poke is sent at once")

	// Within the interval: held back, then the notifier stops.
	poke()
	stop()
	require.NoError(t, <-done)
	wctx, wcancel := context.WithTimeout(ctx, 5*time.Second)
	defer wcancel()
	_, err = conn.WaitForNotification(wctx)
	require.NoError(t, err, "the poke pending when the notifier stopped is sent")
}
