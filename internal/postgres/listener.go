package postgres

import (
	"context"
	"log/slog"
	"time"

	"github.com/cenkalti/backoff/v5"
	"github.com/jackc/pgx/v5"
)

// Listener holds its own long-lived connection, LISTENs on a channel and
// calls wake on every notification and after every (re)connect, so that the
// caller catches up on anything it missed while disconnected.
type Listener struct {
	url     string
	channel string
	wake    func()
	log     *slog.Logger
	// MaxBackoff caps the wait between reconnects.
	MaxBackoff time.Duration
}

// NewListener returns a listener on channel.
func NewListener(url, channel string, wake func(), log *slog.Logger) *Listener {
	return &Listener{url: url, channel: channel, wake: wake, log: log, MaxBackoff: 5 * time.Second}
}

// Run listens until ctx is done, reconnecting with backoff.
func (l *Listener) Run(ctx context.Context) error {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval = 50*time.Millisecond, l.MaxBackoff
	for ctx.Err() == nil {
		err := l.listen(ctx, b)
		if ctx.Err() != nil {
			return nil //nolint:nilerr // the connection ended because we are stopping
		}
		wait := b.NextBackOff()
		l.log.WarnContext(ctx, "listen connection lost; reconnecting", "channel", l.channel, "error", err, "retry_in", wait)
		select {
		case <-ctx.Done():
		case <-time.After(wait):
		}
	}
	return nil
}

func (l *Listener) listen(ctx context.Context, b *backoff.ExponentialBackOff) error {
	conn, err := pgx.Connect(ctx, l.url)
	if err != nil {
		return err
	}
	defer conn.Close(context.WithoutCancel(ctx))
	if _, err := conn.Exec(ctx, "LISTEN "+pgx.Identifier{l.channel}.Sanitize()); err != nil {
		return err
	}
	b.Reset()
	l.wake() // catch up on what was committed while not listening
	for {
		if _, err := conn.WaitForNotification(ctx); err != nil {
			return err
		}
		l.wake()
	}
}
