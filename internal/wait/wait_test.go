package wait_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/wait"
)

func TestSleepEndsWithItsContext(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	require.False(t, wait.Sleep(ctx, time.Hour))
	require.True(t, wait.Sleep(context.Background(), time.Millisecond))
}

func TestBackoffGrowsToItsCap(t *testing.T) {
	t.Parallel()
	b := wait.Backoff(10*time.Millisecond, 80*time.Millisecond)
	var last time.Duration
	for range 20 {
		last = b.NextBackOff()
		require.Positive(t, last, "never gives up")
		require.LessOrEqual(t, last, 80*time.Millisecond*3/2, "capped, give or take the jitter")
	}
	require.GreaterOrEqual(t, last, 40*time.Millisecond)
	b.Reset()
	require.LessOrEqual(t, b.NextBackOff(), 15*time.Millisecond)
}
