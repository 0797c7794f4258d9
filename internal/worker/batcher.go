package worker

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// A batcher queues calls made at about the same time for one database
// statement; a pair's loop writes them. While a batch is being written,
// new calls queue up, and the next batch takes them all. A lone call goes
// at once, with no added wait; under load, batches grow and the commits
// per task shrink.
type batcher[Req, Res any] struct {
	in  chan batchCall[Req, Res]
	max int
	// wait, when set, bounds the wait to get into a batch, besides the
	// caller's context.
	wait time.Duration
}

type batchCall[Req, Res any] struct {
	req  Req
	span trace.Span
	done chan batchResult[Res]
	// linked: writing req may lock rows other than its own (see pair).
	linked bool
}

type batchResult[Res any] struct {
	res Res
	err error
}

// newBatcher returns a batcher of at most max calls per batch, whose
// callers wait at most wait (0: as long as their context lets them) to get
// into one.
func newBatcher[Req, Res any](max int, wait time.Duration) *batcher[Req, Res] {
	return &batcher[Req, Res]{in: make(chan batchCall[Req, Res], max), max: max, wait: wait}
}

// errQueueFull is a call that found the queue full for the batcher's
// whole wait.
var errQueueFull = errors.New("no room in the batch queue")

// do queues req and waits for its result. The batch is written whatever
// happens to ctx; ctx and the batcher's wait only bound the wait to get
// into one, and a timer is made only when the queue is full.
func (b *batcher[Req, Res]) do(ctx context.Context, req Req) (Res, error) {
	return b.call(ctx, req, false)
}

// doLinked is do for a request whose write may lock rows other than its
// own: a pair writes no two batches holding such requests at once.
func (b *batcher[Req, Res]) doLinked(ctx context.Context, req Req) (Res, error) {
	return b.call(ctx, req, true)
}

func (b *batcher[Req, Res]) call(ctx context.Context, req Req, linked bool) (Res, error) {
	c := batchCall[Req, Res]{req: req, span: trace.SpanFromContext(ctx), done: make(chan batchResult[Res], 1), linked: linked}
	select {
	case b.in <- c:
	default:
		// The queue is full: only now is a bound needed.
		if err := b.enqueue(ctx, c); err != nil {
			var zero Res
			return zero, err
		}
	}
	r := <-c.done
	return r.res, r.err
}

// enqueue waits for room in the queue.
func (b *batcher[Req, Res]) enqueue(ctx context.Context, c batchCall[Req, Res]) error {
	var expired <-chan time.Time
	if b.wait > 0 {
		t := time.NewTimer(b.wait)
		defer t.Stop()
		expired = t.C
	}
	select {
	case b.in <- c:
		return nil
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-expired:
		return errQueueFull
	}
}

// take adds to calls what is queued, without waiting, up to max.
func (b *batcher[Req, Res]) take(calls []batchCall[Req, Res]) []batchCall[Req, Res] {
	for len(calls) < b.max {
		select {
		case c := <-b.in:
			calls = append(calls, c)
		default:
			return calls
		}
	}
	return calls
}

// answer hands each call its result.
func answer[Req, Res any](calls []batchCall[Req, Res], res []Res, errs []error) {
	for i, c := range calls {
		c.done <- batchResult[Res]{res: res[i], err: errs[i]}
	}
}

// A pair of batchers is written by one loop: whatever both hold when it
// turns goes in one flush (one round trip and one commit for a worker's
// completions and its next claims). One flush at a time is in flight,
// unless flights allows more: a further flush starts beside those in
// flight only once join calls wait, so that an idle moment's small
// batches do not split into smaller ones, and, if it holds a linked call,
// only while no write in flight holds one. Two writes in flight lock their
// own rows, which no two share, but a linked call may lock others too
// (settling a child locks its parent and its workflow run, in the order
// of the children): two such writes at once could each wait for the
// other.
type pair[A, RA, B, RB any] struct {
	a       *batcher[A, RA]
	b       *batcher[B, RB]
	timeout time.Duration
	flights int
	join    int
	// flush writes as and bs and answers one result and one error for
	// each; either may be empty, not both.
	flush func(ctx context.Context, as []A, bs []B) ([]RA, []error, []RB, []error)
}

// run writes batches until ctx is done. Callers must be finished by then.
func (p *pair[A, RA, B, RB]) run(ctx context.Context) {
	flights := max(p.flights, 1)
	join := max(p.join, 1)
	// landed tells a write's end, and whether it held linked calls.
	landed := make(chan bool, flights)
	inFlight, linkedInFlight := 0, false
	var as []batchCall[A, RA]
	var bs []batchCall[B, RB]
	linked, seenA, seenB := false, 0, 0
	for {
		if len(as)+len(bs) > 0 {
			as, bs = p.a.take(as), p.b.take(bs)
			for _, c := range as[seenA:] {
				linked = linked || c.linked
			}
			for _, c := range bs[seenB:] {
				linked = linked || c.linked
			}
			seenA, seenB = len(as), len(bs)
			if inFlight == 0 || inFlight < flights && len(as)+len(bs) >= join && (!linked || !linkedInFlight) {
				inFlight++
				linkedInFlight = linkedInFlight || linked
				go p.write(ctx, as, bs, linked, landed)
				as, bs, linked, seenA, seenB = nil, nil, false, 0, 0
			}
		}
		// Wait for calls or a write to land; calls gathered are written
		// whatever happens to ctx.
		var stop <-chan struct{}
		if len(as)+len(bs) == 0 {
			stop = ctx.Done()
		}
		ain, bin := p.a.in, p.b.in
		if len(as) >= p.a.max {
			ain = nil
		}
		if len(bs) >= p.b.max {
			bin = nil
		}
		select {
		case <-stop:
			return
		case l := <-landed:
			inFlight--
			linkedInFlight = linkedInFlight && !l
		case c := <-ain:
			as = append(as, c)
		case c := <-bin:
			bs = append(bs, c)
		}
	}
}

// write flushes one batch and answers its calls.
func (p *pair[A, RA, B, RB]) write(ctx context.Context, as []batchCall[A, RA], bs []batchCall[B, RB], linked bool, landed chan<- bool) {
	// The statements' spans hang under the first traced caller's span: a
	// lone call (the common case at low load) is traced where it was made,
	// and an untraced call (a renewal) first in a batch does not hide the
	// others'.
	span := firstRecording(as, bs)
	fctx, cancel := context.WithTimeout(trace.ContextWithSpan(context.WithoutCancel(ctx), span), p.timeout)
	ra, ea, rb, eb := p.flush(fctx, reqs(as), reqs(bs))
	cancel()
	answer(as, ra, ea)
	answer(bs, rb, eb)
	landed <- linked
}

// firstRecording is the span of a batch's first call whose span records,
// or the first call's when none does.
func firstRecording[A, RA, B, RB any](as []batchCall[A, RA], bs []batchCall[B, RB]) trace.Span {
	for _, c := range as {
		if c.span != nil && c.span.IsRecording() {
			return c.span
		}
	}
	for _, c := range bs {
		if c.span != nil && c.span.IsRecording() {
			return c.span
		}
	}
	if len(as) > 0 {
		return as[0].span
	}
	return bs[0].span
}

func reqs[Req, Res any](calls []batchCall[Req, Res]) []Req {
	out := make([]Req, len(calls))
	for i, c := range calls {
		out[i] = c.req
	}
	return out
}
