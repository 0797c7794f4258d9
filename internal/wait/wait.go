// Package wait holds the two waiting helpers every long-running part uses:
// a sleep that a context cuts short, and the exponential backoff between
// retries of a connection or a statement.
package wait

import (
	"context"
	"time"

	"github.com/cenkalti/backoff/v5"
)

// Sleep waits for d or until ctx is done, whichever comes first, and
// reports whether it waited the whole d.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// Backoff returns an exponential backoff (randomised, doubling) from
// initial up to max, that never gives up: the caller decides when to stop.
func Backoff(initial, max time.Duration) *backoff.ExponentialBackOff {
	b := backoff.NewExponentialBackOff()
	b.InitialInterval, b.MaxInterval = initial, max
	return b
}
