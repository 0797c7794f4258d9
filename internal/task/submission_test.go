package task_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/task"
)

func TestInputHashIgnoresKeyOrderAndWhitespace(t *testing.T) {
	t.Parallel()
	a, err := task.InputHash("demo.sleep", json.RawMessage(`{"steps":3,"step_ms":100,"nested":{"b":1,"a":[1,2]}}`))
	require.NoError(t, err)
	b, err := task.InputHash("demo.sleep", json.RawMessage("{ \"nested\" : {\"a\":[1, 2],\"b\":1.0},\n \"step_ms\":100, \"steps\":3 }"))
	require.NoError(t, err)
	require.Equal(t, a, b)
	require.Len(t, a, 64)

	other, err := task.InputHash("demo.other", json.RawMessage(`{"steps":3,"step_ms":100,"nested":{"b":1,"a":[1,2]}}`))
	require.NoError(t, err)
	require.NotEqual(t, a, other, "the type is part of the hash")

	changed, err := task.InputHash("demo.sleep", json.RawMessage(`{"steps":4,"step_ms":100,"nested":{"b":1,"a":[1,2]}}`))
	require.NoError(t, err)
	require.NotEqual(t, a, changed)
}

func TestNewSubmission(t *testing.T) {
	t.Parallel()
	intp := func(n int) *int { return &n }
	boolp := func(b bool) *bool { return &b }
	defaults := task.Defaults{MaxAttempts: 3}

	tests := []struct {
		name      string
		in        task.SubmitInput
		wantField string
		check     func(t *testing.T, s task.Submission)
	}{
		{name: "defaults", in: task.SubmitInput{Type: "demo.sleep"}, check: func(t *testing.T, s task.Submission) {
			require.Equal(t, task.DefaultPriority, s.Priority)
			require.Equal(t, 3, s.MaxAttempts)
			require.True(t, s.Dedupe)
			require.JSONEq(t, `{}`, string(s.Payload))
			require.JSONEq(t, `{}`, string(s.Metadata))
			require.Empty(t, s.Visibility)
			require.Len(t, s.InputHash, 64)
		}},
		{name: "all set", in: task.SubmitInput{Type: "a", Payload: json.RawMessage(`{"x":1}`), Priority: intp(9),
			MaxAttempts: intp(100), Dedupe: boolp(false), IdempotencyKey: "k-1", Metadata: json.RawMessage(`{"m":true}`)},
			check: func(t *testing.T, s task.Submission) {
				require.Equal(t, 9, s.Priority)
				require.Equal(t, 100, s.MaxAttempts)
				require.False(t, s.Dedupe)
				require.Equal(t, "k-1", s.IdempotencyKey)
			}},
		{name: "missing type", in: task.SubmitInput{}, wantField: "type"},
		{name: "visibility not a slug", in: task.SubmitInput{Type: "a", Visibility: []string{"Finance"}}, wantField: "visibility"},
		{name: "visibility too long", in: task.SubmitInput{Type: "a", Visibility: make([]string, task.MaxVisibility+1)}, wantField: "visibility"},
		{name: "uppercase type", in: task.SubmitInput{Type: "Demo"}, wantField: "type"},
		{name: "type starting with dot", in: task.SubmitInput{Type: ".demo"}, wantField: "type"},
		{name: "type too long", in: task.SubmitInput{Type: strings.Repeat("a", 129)}, wantField: "type"},
		{name: "longest type", in: task.SubmitInput{Type: strings.Repeat("a", 128)}},
		{name: "payload array", in: task.SubmitInput{Type: "a", Payload: json.RawMessage(`[1]`)}, wantField: "payload"},
		{name: "payload string", in: task.SubmitInput{Type: "a", Payload: json.RawMessage(`"x"`)}, wantField: "payload"},
		{name: "payload number too large", in: task.SubmitInput{Type: "a", Payload: json.RawMessage(`{"a":[1,{"n":1e400}]}`)}, wantField: "payload"},
		{name: "payload number too small", in: task.SubmitInput{Type: "a", Payload: json.RawMessage(`{"n":-18e307}`)}, wantField: "payload"},
		{name: "payload number too long", in: task.SubmitInput{Type: "a", Payload: json.RawMessage(`{"n":1` + strings.Repeat("0", 309) + `}`)}, wantField: "payload"},
		{name: "payload numbers in range", in: task.SubmitInput{Type: "a", Payload: json.RawMessage(
			`{"max":1.7976931348623157e308,"tiny":1e-400,"exact":9007199254740993,"long":1` + strings.Repeat("0", 308) + `,"s":"1e400","e\"":-1E+308}`)}},
		{name: "metadata number", in: task.SubmitInput{Type: "a", Metadata: json.RawMessage(`1`)}, wantField: "metadata"},
		{name: "priority too high", in: task.SubmitInput{Type: "a", Priority: intp(10)}, wantField: "priority"},
		{name: "priority negative", in: task.SubmitInput{Type: "a", Priority: intp(-1)}, wantField: "priority"},
		{name: "max_attempts zero", in: task.SubmitInput{Type: "a", MaxAttempts: intp(0)}, wantField: "max_attempts"},
		{name: "max_attempts huge", in: task.SubmitInput{Type: "a", MaxAttempts: intp(1 << 30)}, wantField: "max_attempts"},
		{name: "key with newline", in: task.SubmitInput{Type: "a", IdempotencyKey: "a\nb"}, wantField: "idempotency_key"},
		{name: "key too long", in: task.SubmitInput{Type: "a", IdempotencyKey: strings.Repeat("k", 256)}, wantField: "idempotency_key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			s, err := task.NewSubmission(tt.in, defaults, "")
			if tt.wantField != "" {
				var e *task.Error
				require.ErrorAs(t, err, &e)
				require.Equal(t, task.ErrCodeInvalid, e.Code)
				require.Equal(t, tt.wantField, e.Field)
				return
			}
			require.NoError(t, err)
			if tt.check != nil {
				tt.check(t, s)
			}
		})
	}
}

// TestVisibilityIsPartOfTheInput: a restricted task is never the duplicate
// of the same payload open to all (deduplication would hand it to people
// outside its roles), and the order and repeats of roles do not matter.
func TestVisibilityIsPartOfTheInput(t *testing.T) {
	open, err := task.NewSubmission(task.SubmitInput{Type: "a", Payload: json.RawMessage(`{"x":1}`)}, task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	restricted, err := task.NewSubmission(task.SubmitInput{Type: "a", Payload: json.RawMessage(`{"x":1}`),
		Visibility: []string{"ops", "finance", "ops"}}, task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	same, err := task.NewSubmission(task.SubmitInput{Type: "a", Payload: json.RawMessage(`{"x":1}`),
		Visibility: []string{"finance", "ops"}}, task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	require.Equal(t, []string{"finance", "ops"}, restricted.Visibility)
	require.NotEqual(t, open.InputHash, restricted.InputHash)
	require.Equal(t, restricted.InputHash, same.InputHash)
	require.Equal(t, restricted.RequestHash, same.RequestHash)
}

// A request that leaves max_attempts out hashes the same whatever default
// fills it in, and unlike one that states a value; its defaulted hash is
// the one earlier versions recorded.
func TestRequestHashKeepsMaxAttemptsAsSent(t *testing.T) {
	t.Parallel()
	in := task.SubmitInput{Type: "demo.sleep", Payload: json.RawMessage(`{"n":1}`), IdempotencyKey: "k"}
	three, err := task.NewSubmission(in, task.Defaults{MaxAttempts: 3}, "")
	require.NoError(t, err)
	five, err := task.NewSubmission(in, task.Defaults{MaxAttempts: 5}, "")
	require.NoError(t, err)
	require.Equal(t, three.RequestHash, five.RequestHash)
	require.NotEqual(t, three.DefaultedRequestHash, five.DefaultedRequestHash)

	in.MaxAttempts = new(3)
	stated, err := task.NewSubmission(in, task.Defaults{MaxAttempts: 5}, "")
	require.NoError(t, err)
	require.NotEqual(t, three.RequestHash, stated.RequestHash)
	require.Equal(t, three.DefaultedRequestHash, stated.RequestHash)
}

func TestNewSubmissionPrefixesBatchFields(t *testing.T) {
	t.Parallel()
	_, err := task.NewSubmission(task.SubmitInput{Type: "BAD"}, task.Defaults{MaxAttempts: 1}, "tasks[7].")
	var e *task.Error
	require.ErrorAs(t, err, &e)
	require.Equal(t, "tasks[7].type", e.Field)
}

func TestStatusRules(t *testing.T) {
	t.Parallel()
	for _, s := range task.Statuses {
		require.True(t, s.Valid())
		require.Equal(t, !s.Terminal(), task.CanCancel(s), s)
	}
	require.False(t, task.Status("DONE").Valid())
	require.True(t, task.CanRetry(task.StatusFailed))
	require.True(t, task.CanRetry(task.StatusCancelled))
	require.False(t, task.CanRetry(task.StatusCompleted))
	require.False(t, task.CanRetry(task.StatusPending))
}
