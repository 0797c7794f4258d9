package worker

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestBatcherGroupsConcurrentCallsAndAnswersEach(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var mu sync.Mutex
	var sizes []int
	release := make(chan struct{})
	b := newBatcher(8, time.Minute, func(_ context.Context, reqs []int) ([]int, []error) {
		<-release
		mu.Lock()
		sizes = append(sizes, len(reqs))
		mu.Unlock()
		res, errs := make([]int, len(reqs)), make([]error, len(reqs))
		for i, r := range reqs {
			res[i] = r * 10
			if r%5 == 0 {
				errs[i] = errors.New("five")
			}
		}
		return res, errs
	})
	go b.run(ctx)

	const calls = 20
	var wg sync.WaitGroup
	got := make([]int, calls)
	gotErr := make([]error, calls)
	for i := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[i], gotErr[i] = b.do(ctx, i)
		}()
	}
	// The first flush holds its calls until the queue behind it is full:
	// the next batch then surely takes more than one call.
	deadline := time.Now().Add(10 * time.Second)
	for len(b.in) < cap(b.in) && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	close(release)
	wg.Wait()
	total := 0
	for _, s := range sizes {
		require.LessOrEqual(t, s, 8)
		total += s
	}
	require.Equal(t, calls, total)
	require.Less(t, len(sizes), calls, "calls made together share batches")
	for i := range calls {
		require.Equal(t, i*10, got[i])
		require.Equal(t, i%5 == 0, gotErr[i] != nil)
	}
}
