package postgres

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// OutboxChannel is the LISTEN/NOTIFY channel that wakes relays when outbox
// rows are committed.
const OutboxChannel = "conveyor_outbox"

// Notifier wakes listeners after writes: relays after outbox writes
// (OutboxChannel), the API's stream hubs and the scheduler after event
// writes (EventsChannel). NOTIFY takes a database-wide lock at commit, so
// instead of notifying inside every write transaction, writers poke it
// after their commit and it sends at most one statement per interval,
// outside any transaction, naming every channel poked since the last: a
// submit that pokes both channels costs one round trip, not two.
type Notifier struct {
	pool     *pgxpool.Pool
	channels []string
	pending  []atomic.Bool
	interval time.Duration
	log      *slog.Logger
	poke     chan struct{}
}

// NewNotifier returns a notifier on channels that sends at most one
// statement per interval.
func NewNotifier(pool *pgxpool.Pool, interval time.Duration, log *slog.Logger, channels ...string) *Notifier {
	return &Notifier{pool: pool, channels: channels, pending: make([]atomic.Bool, len(channels)),
		interval: interval, log: log, poke: make(chan struct{}, 1)}
}

// Poker returns the function that asks for a NOTIFY on channel soon; it
// never blocks. channel must be one the notifier was made with.
func (n *Notifier) Poker(channel string) func() {
	for i, c := range n.channels {
		if c == channel {
			return func() {
				n.pending[i].Store(true)
				select {
				case n.poke <- struct{}{}:
				default:
				}
			}
		}
	}
	panic("postgres: notifier has no channel " + channel)
}

// sqlNotify notifies each of the channels given.
const sqlNotify = `SELECT pg_notify(c, '') FROM unnest($1::text[]) AS c`

// notifyOnStop bounds the last send of a stopping notifier.
const notifyOnStop = time.Second

// Run sends the NOTIFYs until ctx is done, then sends those still pending
// once: a stopping process's last writes (a worker's tasks handed back)
// would otherwise wait for the listeners' next poll.
func (n *Notifier) Run(ctx context.Context) error {
	due := make([]string, 0, len(n.channels))
	for {
		select {
		case <-ctx.Done():
			n.flushOnStop(ctx)
			return nil
		case <-n.poke:
		}
		n.send(ctx, due)
		if n.interval > 0 {
			select {
			case <-ctx.Done():
				n.flushOnStop(ctx)
				return nil
			case <-time.After(n.interval):
			}
		}
	}
}

// send notifies the channels poked since the last send, if any.
func (n *Notifier) send(ctx context.Context, due []string) {
	due = due[:0]
	for i := range n.pending {
		if n.pending[i].Swap(false) {
			due = append(due, n.channels[i])
		}
	}
	if len(due) == 0 {
		return // an earlier send took this poke's channels along
	}
	if _, err := n.pool.Exec(ctx, sqlNotify, due); err != nil && ctx.Err() == nil {
		// Listeners also poll, so a lost wake-up only costs latency.
		n.log.WarnContext(ctx, "notify", "channels", due, "error", err)
	}
}

// flushOnStop sends what is pending once ctx is done.
func (n *Notifier) flushOnStop(ctx context.Context) {
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), notifyOnStop)
	defer cancel()
	n.send(fctx, make([]string, 0, len(n.channels)))
}
