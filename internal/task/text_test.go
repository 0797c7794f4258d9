package task_test

import (
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/task"
)

func TestCleanTextMakesTextStorable(t *testing.T) {
	t.Parallel()
	require.Equal(t, "a\uFFFDb\uFFFD", task.CleanText("a\x00b\xff", 100))
	long := task.CleanText(strings.Repeat("é", 100), 51)
	require.True(t, utf8.ValidString(long))
	require.LessOrEqual(t, len(long), 51)
	require.Equal(t, "plain", task.CleanText("plain", 100))
}

func TestStorableJSON(t *testing.T) {
	t.Parallel()
	for _, ok := range []string{`{}`, `{"s":"\ud83d\ude00"}`, `{"s":"\\u0000"}`, `[1,"\u00e9"]`, `null`} {
		require.NoError(t, task.StorableJSON([]byte(ok)), ok)
	}
	for _, bad := range []string{`{"s":"\u0000"}`, `{"s":"a\u0000"}`, `{"\u0000":1}`, `{"s":"\ud800"}`, `{"s":"\udc00x"}`,
		`{"s":"\ud800\u0041"}`, "{\"s\":\"\xff\"}", `{`} {
		require.Error(t, task.StorableJSON([]byte(bad)), bad)
	}
}

// A document refused only for its depth (a handler's result, say) is told
// the bound, not that it is not JSON.
func TestStorableJSONNamesTheNestingBound(t *testing.T) {
	t.Parallel()
	require.NoError(t, task.StorableJSON([]byte(`{"a":`+strings.Repeat("[", task.MaxNesting-1)+strings.Repeat("]", task.MaxNesting-1)+`}`)))
	doc := `{"a":` + strings.Repeat("[", task.MaxNesting) + strings.Repeat("]", task.MaxNesting) + `}`
	err := task.StorableJSON([]byte(doc))
	require.EqualError(t, err, "nests 10001 levels deep; at most 10000 are allowed")
	// Brackets in strings, escaped quotes among them, nest nothing.
	require.EqualError(t, task.StorableJSON([]byte(`[`+strings.Repeat(`"\"[",`, 20000)+`1`)), "not valid JSON")
}
