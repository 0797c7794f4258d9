package worker

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/trace"
)

// batcher turns calls made at about the same time into one database
// statement: while a batch is being written, new calls queue up, and the
// next batch takes them all. A lone call goes at once, with no added wait;
// under load, batches grow and the commits per task shrink.
type batcher[Req, Res any] struct {
	in      chan batchCall[Req, Res]
	max     int
	timeout time.Duration
	flush   func(ctx context.Context, reqs []Req) ([]Res, []error)
}

type batchCall[Req, Res any] struct {
	req  Req
	span trace.Span
	done chan batchResult[Res]
}

type batchResult[Res any] struct {
	res Res
	err error
}

// newBatcher returns a batcher of at most max calls per flush, each flush
// bounded by timeout. flush gets the requests in call order and returns one
// result and one error per request.
func newBatcher[Req, Res any](max int, timeout time.Duration, flush func(context.Context, []Req) ([]Res, []error)) *batcher[Req, Res] {
	return &batcher[Req, Res]{in: make(chan batchCall[Req, Res], max), max: max, timeout: timeout, flush: flush}
}

// do queues req and waits for its result. The batch is written whatever
// happens to ctx; ctx only bounds the wait to get into one.
func (b *batcher[Req, Res]) do(ctx context.Context, req Req) (Res, error) {
	c := batchCall[Req, Res]{req: req, span: trace.SpanFromContext(ctx), done: make(chan batchResult[Res], 1)}
	select {
	case b.in <- c:
	case <-ctx.Done():
		var zero Res
		return zero, context.Cause(ctx)
	}
	r := <-c.done
	return r.res, r.err
}

// run writes batches until ctx is done. Callers must be finished by then.
func (b *batcher[Req, Res]) run(ctx context.Context) {
	calls := make([]batchCall[Req, Res], 0, b.max)
	reqs := make([]Req, 0, b.max)
	for {
		calls, reqs = calls[:0], reqs[:0]
		select {
		case <-ctx.Done():
			return
		case c := <-b.in:
			calls = append(calls, c)
		}
	more:
		for len(calls) < b.max {
			select {
			case c := <-b.in:
				calls = append(calls, c)
			default:
				break more
			}
		}
		for _, c := range calls {
			reqs = append(reqs, c.req)
		}
		// The statement's spans hang under the first caller's span: a lone
		// call (the common case at low load) is traced where it was made.
		fctx, cancel := context.WithTimeout(trace.ContextWithSpan(context.WithoutCancel(ctx), calls[0].span), b.timeout)
		res, errs := b.flush(fctx, reqs)
		cancel()
		for i, c := range calls {
			c.done <- batchResult[Res]{res: res[i], err: errs[i]}
		}
	}
}
