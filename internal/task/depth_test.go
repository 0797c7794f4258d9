package task

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDepthCountsNestingOutsideStrings(t *testing.T) {
	t.Parallel()
	for doc, want := range map[string]int{
		`{}`: 1, `{"a":[1,{"b":[]}]}`: 4, `{"s":"[[[{{{"}`: 1, `{"s":"\"[[[","t":[[]]}`: 3, `{"e":"\\","a":[]}`: 2,
	} {
		require.Equal(t, want, depth([]byte(doc)), doc)
	}
}
