package auth

import (
	"context"
	"sync"
	"time"
)

// flight runs one call of a fetch from the issuer at a time, to its end
// whether or not its callers wait for it (each waits only as long as its
// own context allows): an issuer slower than the requests' deadline is
// still heard, and a failure always speaks of the issuer, never of a
// caller that gave up. A failure is answered for discoveryRetry after it
// instead of a new call: while the issuer is down, every token would
// otherwise ask it again.
type flight struct {
	now func() time.Time

	mu       sync.Mutex
	failedAt time.Time
	failure  error
	// running is closed when the call under way ends; nil when none is.
	running chan struct{}
}

// wait returns nil once settled reports true (it is asked first, under
// the flight's lock), else the last failure if it is recent, else waits
// for the call under way or starts one with run. It returns ctx.Err() if
// ctx ends first.
func (f *flight) wait(ctx context.Context, settled func() bool, run func() error) error {
	f.mu.Lock()
	if settled() {
		f.mu.Unlock()
		return nil
	}
	if f.failure != nil && f.now().Sub(f.failedAt) < discoveryRetry {
		failure := f.failure
		f.mu.Unlock()
		return failure
	}
	done := f.running
	if done == nil {
		done = make(chan struct{})
		f.running = done
		go func() {
			err := run()
			f.mu.Lock()
			if err != nil {
				f.failedAt = f.now()
			}
			f.failure, f.running = err, nil
			f.mu.Unlock()
			close(done)
		}()
	}
	f.mu.Unlock()
	select {
	case <-done:
	case <-ctx.Done():
		return ctx.Err()
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if settled() {
		return nil
	}
	return f.failure
}
