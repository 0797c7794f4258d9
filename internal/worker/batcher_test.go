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
	p := &pair[int, int, string, string]{a: newBatcher[int, int](8), b: newBatcher[string, string](4), timeout: time.Minute,
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
