package worker

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestRetryDelayDoublesWithJitterUpToTheCap(t *testing.T) {
	t.Parallel()
	base, limit := time.Second, 10*time.Second
	for _, tc := range []struct {
		attempt int
		full    time.Duration
	}{
		{1, time.Second}, {2, 2 * time.Second}, {3, 4 * time.Second}, {4, 8 * time.Second},
		{5, 10 * time.Second}, {50, 10 * time.Second},
	} {
		seen := map[time.Duration]bool{}
		for range 200 {
			d := retryDelay(tc.attempt, base, limit)
			require.GreaterOrEqual(t, d, tc.full/2, "attempt %d", tc.attempt)
			require.LessOrEqual(t, d, tc.full, "attempt %d", tc.attempt)
			seen[d] = true
		}
		require.Greater(t, len(seen), 100, "attempt %d: jittered", tc.attempt)
	}
}
