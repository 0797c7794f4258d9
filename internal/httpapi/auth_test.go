package httpapi

import (
	"testing"

	"github.com/google/uuid"
	"github.com/stretchr/testify/require"
)

// The rate limiter keeps a bucket for at most maxBuckets principals, even
// when every one of them has just made a request.
func TestRateLimiterBucketsAreBounded(t *testing.T) {
	t.Parallel()
	l := newLimiters(1000, 10)
	for range maxBuckets + 100 {
		_, ok := l.allow(uuid.New())
		require.True(t, ok)
	}
	require.LessOrEqual(t, l.len(), maxBuckets)
}
