package worker

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace"
)

func TestPairGroupsConcurrentCallsOfBothKindsAndAnswersEach(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	type flushed struct{ as, bs int }
	var mu sync.Mutex
	var flushes []flushed
	release := make(chan struct{})
	p := &pair[int, int, string, string]{a: newBatcher[int, int](8, 0), b: newBatcher[string, string](4, 0), timeout: time.Minute,
		flush: func(_ context.Context, as []int, bs []string) ([]int, []error, []string, []error) {
			<-release
			mu.Lock()
			flushes = append(flushes, flushed{len(as), len(bs)})
			mu.Unlock()
			ra, ea := make([]int, len(as)), make([]error, len(as))
			for i, a := range as {
				ra[i] = a * 10
				if a%5 == 0 {
					ea[i] = errors.New("five")
				}
			}
			rb, eb := make([]string, len(bs)), make([]error, len(bs))
			for i, b := range bs {
				rb[i] = b + "!"
			}
			return ra, ea, rb, eb
		}}
	go p.run(ctx)

	const calls = 20
	var wg sync.WaitGroup
	gotA, errA := make([]int, calls), make([]error, calls)
	gotB := make([]string, calls)
	for i := range calls {
		wg.Add(2)
		go func() {
			defer wg.Done()
			gotA[i], errA[i] = p.a.do(ctx, i)
		}()
		go func() {
			defer wg.Done()
			var err error
			gotB[i], err = p.b.do(ctx, string(rune('a'+i)))
			require.NoError(t, err)
		}()
	}
	// The first flush holds its calls until calls of both kinds queue
	// behind the batch the loop gathers meanwhile (which stops taking a
	// kind once it holds a batch's worth): the next flush then surely
	// takes calls of both kinds.
	deadline := time.Now().Add(10 * time.Second)
	for (len(p.a.in) == 0 || len(p.b.in) == 0) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	close(release)
	wg.Wait()
	totalA, totalB, both := 0, 0, 0
	for _, f := range flushes {
		require.LessOrEqual(t, f.as, 8)
		require.LessOrEqual(t, f.bs, 4)
		require.Positive(t, f.as+f.bs, "a flush writes something")
		totalA, totalB = totalA+f.as, totalB+f.bs
		if f.as > 0 && f.bs > 0 {
			both++
		}
	}
	require.Equal(t, calls, totalA)
	require.Equal(t, calls, totalB)
	require.Less(t, len(flushes), 2*calls, "calls made together share flushes")
	require.Positive(t, both, "calls of both kinds share a flush")
	for i := range calls {
		require.Equal(t, i*10, gotA[i])
		require.Equal(t, i%5 == 0, errA[i] != nil)
		require.Equal(t, string(rune('a'+i))+"!", gotB[i])
	}
}

// A call that finds the queue full waits for room no longer than the
// batcher's wait, or its context; one that finds room never times out.
func TestBatcherBoundsTheWaitForRoomInTheQueue(t *testing.T) {
	t.Parallel()
	b := newBatcher[int, int](1, 20*time.Millisecond)
	first := make(chan error, 1)
	go func() {
		_, err := b.do(context.Background(), 1)
		first <- err
	}()
	require.Eventually(t, func() bool { return len(b.in) == 1 }, 10*time.Second, time.Millisecond)

	_, err := b.do(context.Background(), 2)
	require.ErrorIs(t, err, errQueueFull)
	ctx, cancel := context.WithCancelCause(context.Background())
	cancel(errors.New("gone"))
	_, err = b.do(ctx, 3)
	require.EqualError(t, err, "gone")

	// The queued call is answered whatever the wait was.
	c := <-b.in
	time.Sleep(50 * time.Millisecond)
	answer([]batchCall[int, int]{c}, []int{10}, []error{nil})
	require.NoError(t, <-first)
}

// A second write starts beside one in flight only once join calls wait for
// it; a third waits for one of the two to land, and no more than flights
// are ever in flight at once.
func TestPairStartsAWriteBesideOneInFlightOnlyOnceJoinCallsWait(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const join = 4
	started := make(chan int, 10)
	release := make(chan struct{})
	var inFlight, most atomic.Int32
	p := &pair[int, int, string, string]{a: newBatcher[int, int](16, 0), b: newBatcher[string, string](16, 0),
		timeout: time.Minute, flights: 2, join: join,
		flush: func(_ context.Context, as []int, bs []string) ([]int, []error, []string, []error) {
			n := inFlight.Add(1)
			for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
			}
			started <- len(as) + len(bs)
			<-release
			inFlight.Add(-1)
			return make([]int, len(as)), make([]error, len(as)), make([]string, len(bs)), make([]error, len(bs))
		}}
	go p.run(ctx)

	var wg sync.WaitGroup
	call := func(i int) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if i%2 == 0 {
				_, err = p.a.do(ctx, i)
			} else {
				_, err = p.b.do(ctx, "x")
			}
			assert.NoError(t, err)
		}()
	}
	call(0)
	require.Equal(t, 1, <-started, "a lone call is written at once")

	// Fewer than join calls wait for the write in flight.
	for i := 1; i < join; i++ {
		call(i)
	}
	noWriteStarts(t, started, "beside one in flight")
	// The join-th starts the second.
	call(join)
	select {
	case n := <-started:
		require.Equal(t, join, n)
	case <-time.After(10 * time.Second):
		t.Fatal("no second write once join calls waited")
	}
	// With two in flight, even a full batch waits.
	for i := join + 1; i < 3*join; i++ {
		call(i)
	}
	noWriteStarts(t, started, "beside two in flight")
	close(release)
	wg.Wait()
	require.Equal(t, int32(2), most.Load())
}

// With one flight, a write waits for the one in flight however many calls
// wait, and takes them together.
func TestPairWritesOneAtATimeWithOneFlight(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	started := make(chan int, 10)
	release := make(chan struct{}, 10)
	p := &pair[int, int, string, string]{a: newBatcher[int, int](64, 0), b: newBatcher[string, string](64, 0),
		timeout: time.Minute, flights: 1, join: 1,
		flush: func(_ context.Context, as []int, bs []string) ([]int, []error, []string, []error) {
			started <- len(as) + len(bs)
			<-release
			return make([]int, len(as)), make([]error, len(as)), make([]string, len(bs)), make([]error, len(bs))
		}}
	go p.run(ctx)
	first := make(chan error, 1)
	go func() {
		_, err := p.a.do(ctx, 0)
		first <- err
	}()
	require.Equal(t, 1, <-started)
	// The calls behind it are queued here, so that all are queued before
	// the loop is watched taking them up.
	done := make([]chan batchResult[int], 20)
	for i := range done {
		done[i] = make(chan batchResult[int], 1)
		p.a.in <- batchCall[int, int]{req: i + 1, done: done[i]}
	}
	require.Eventually(t, func() bool { return len(p.a.in) == 0 }, 10*time.Second, time.Millisecond,
		"the calls behind the write in flight are taken up")
	noWriteStarts(t, started, "beside the one in flight")
	release <- struct{}{}
	require.NoError(t, <-first)
	require.Equal(t, 20, <-started, "the calls that waited go together")
	release <- struct{}{}
	for _, d := range done {
		require.NoError(t, (<-d).err)
	}
}

// noWriteStarts fails if a write starts within 100 ms.
func noWriteStarts(t *testing.T, started <-chan int, where string) {
	t.Helper()
	select {
	case n := <-started:
		t.Fatalf("a write of %d calls started %s", n, where)
	case <-time.After(100 * time.Millisecond):
	}
}

// A batch holding a linked call (one whose write locks rows beyond its
// own) starts beside a write in flight only if that write holds none.
func TestPairWritesNoTwoBatchesOfLinkedCallsAtOnce(t *testing.T) {
	t.Parallel()
	newPair := func() (*pair[int, int, string, string], chan int, chan struct{}) {
		started, release := make(chan int, 10), make(chan struct{})
		return &pair[int, int, string, string]{a: newBatcher[int, int](16, 0), b: newBatcher[string, string](16, 0),
			timeout: time.Minute, flights: 2, join: 1,
			flush: func(_ context.Context, as []int, bs []string) ([]int, []error, []string, []error) {
				started <- len(as) + len(bs)
				<-release
				return make([]int, len(as)), make([]error, len(as)), make([]string, len(bs)), make([]error, len(bs))
			}}, started, release
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var wg sync.WaitGroup
	call := func(do func(context.Context, int) (int, error)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := do(ctx, 1)
			assert.NoError(t, err)
		}()
	}

	// Linked beside unlinked, either way round.
	p, started, release := newPair()
	go p.run(ctx)
	call(p.a.doLinked)
	require.Equal(t, 1, <-started)
	call(p.a.do)
	require.Equal(t, 1, <-started, "an unlinked call is written beside a linked one")
	close(release)
	wg.Wait()

	// Linked beside linked: the second waits for the first to land.
	p, started, release = newPair()
	go p.run(ctx)
	call(p.a.doLinked)
	require.Equal(t, 1, <-started)
	call(p.a.doLinked)
	noWriteStarts(t, started, "beside a write of a linked call, with a linked call")
	close(release)
	require.Equal(t, 1, <-started, "the linked call goes once the first lands")
	wg.Wait()
}

// A batch's statement is traced under the span of its first call that is
// traced: an untraced call (a lease renewal) ahead of a claim in the batch
// must not leave the claim's statement out of every trace.
func TestPairTracesABatchUnderItsFirstTracedCall(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	started := make(chan trace.Span, 10)
	release := make(chan struct{}, 10)
	p := &pair[int, int, string, string]{a: newBatcher[int, int](64, 0), b: newBatcher[string, string](64, 0),
		timeout: time.Minute, flights: 1, join: 1,
		flush: func(fctx context.Context, as []int, bs []string) ([]int, []error, []string, []error) {
			started <- trace.SpanFromContext(fctx)
			<-release
			return make([]int, len(as)), make([]error, len(as)), make([]string, len(bs)), make([]error, len(bs))
		}}
	go p.run(ctx)
	first := make(chan error, 1)
	go func() {
		_, err := p.a.do(ctx, 0)
		first <- err
	}()
	<-started
	// Queued behind the write in flight, so that both go in the next.
	_, traced := sdktrace.NewTracerProvider().Tracer("test").Start(ctx, "claim")
	defer traced.End()
	renewal, claim := make(chan batchResult[int], 1), make(chan batchResult[string], 1)
	p.a.in <- batchCall[int, int]{req: 1, span: trace.SpanFromContext(untraced(ctx)), done: renewal}
	p.b.in <- batchCall[string, string]{req: "claim", span: traced, done: claim}
	require.Eventually(t, func() bool { return len(p.a.in) == 0 && len(p.b.in) == 0 }, 10*time.Second, time.Millisecond)
	release <- struct{}{}
	require.NoError(t, <-first)
	got := <-started
	release <- struct{}{}
	require.NoError(t, (<-renewal).err)
	require.NoError(t, (<-claim).err)
	require.Equal(t, traced.SpanContext().SpanID(), got.SpanContext().SpanID(),
		"the batch's statement hangs under the claim's span")
}
