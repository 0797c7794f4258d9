package postgres

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// OutboxChannel is the LISTEN/NOTIFY channel that wakes relays when outbox
// rows are committed.
const OutboxChannel = "conveyor_outbox"

// Notifier wakes listeners after writes: relays after outbox writes
// (OutboxChannel), the API's stream hubs after event writes
// (EventsChannel). NOTIFY takes a database-wide lock at commit, so instead
// of notifying inside every write transaction, writers Poke it after their
// commit and it sends at most one NOTIFY per interval, outside any
// transaction.
type Notifier struct {
	pool     *pgxpool.Pool
	channel  string
	interval time.Duration
	log      *slog.Logger
	poke     chan struct{}
}

// NewNotifier returns a notifier on channel that sends at most one NOTIFY
// per interval.
func NewNotifier(pool *pgxpool.Pool, channel string, interval time.Duration, log *slog.Logger) *Notifier {
	return &Notifier{pool: pool, channel: channel, interval: interval, log: log, poke: make(chan struct{}, 1)}
}

// Poke asks for a NOTIFY soon. It never blocks.
func (n *Notifier) Poke() {
	select {
	case n.poke <- struct{}{}:
	default:
	}
}

// Run sends the NOTIFYs until ctx is done.
func (n *Notifier) Run(ctx context.Context) error {
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-n.poke:
		}
		if _, err := n.pool.Exec(ctx, "SELECT pg_notify($1, '')", n.channel); err != nil && ctx.Err() == nil {
			// Listeners also poll, so a lost wake-up only costs latency.
			n.log.WarnContext(ctx, "notify", "channel", n.channel, "error", err)
		}
		if n.interval > 0 {
			select {
			case <-ctx.Done():
				return nil
			case <-time.After(n.interval):
			}
		}
	}
}
