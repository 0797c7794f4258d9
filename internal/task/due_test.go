package task

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestSubmissionWhenDue(t *testing.T) {
	d := Defaults{MaxAttempts: 3}
	in := func(runAt *time.Time, delay string) SubmitInput {
		return SubmitInput{Type: "demo.noop", RunAt: runAt, Delay: delay}
	}
	now := newSubmissionOrFail(t, in(nil, ""), d)
	require.Nil(t, now.RunAt)
	require.Zero(t, now.Delay)

	later := newSubmissionOrFail(t, in(nil, "1h30m"), d)
	require.Equal(t, 90*time.Minute, later.Delay)
	require.NotEqual(t, now.RequestHash, later.RequestHash, "an idempotency key binds the delay too")
	require.Equal(t, now.InputHash, later.InputHash, "the input is the same: deduplication ignores when")

	at := time.Now().Add(48 * time.Hour).Truncate(time.Second).In(time.FixedZone("x", 3600))
	sub := newSubmissionOrFail(t, in(&at, ""), d)
	require.Equal(t, at.UTC(), *sub.RunAt)

	far := time.Now().Add(400 * 24 * time.Hour)
	for name, bad := range map[string]SubmitInput{
		"both":           in(&at, "1s"),
		"not a duration": in(nil, "soon"),
		"negative":       in(nil, "-1s"),
		"too far":        in(nil, "9000h"),
		"run_at too far": in(&far, ""),
		"a bare number":  in(nil, "90"),
	} {
		_, err := NewSubmission(bad, d, "")
		require.Error(t, err, name)
		require.Equal(t, ErrCodeInvalid, ErrorCode(err), name)
	}
}

func newSubmissionOrFail(t *testing.T, in SubmitInput, d Defaults) Submission {
	t.Helper()
	s, err := NewSubmission(in, d, "")
	require.NoError(t, err)
	return s
}
