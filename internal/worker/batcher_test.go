package worker

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
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
	// The first flush holds its calls until the queues behind it are full:
	// the next flush then surely takes calls of both kinds.
	deadline := time.Now().Add(10 * time.Second)
	for (len(p.a.in) < cap(p.a.in) || len(p.b.in) < cap(p.b.in)) && time.Now().Before(deadline) {
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
