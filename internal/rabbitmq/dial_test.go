package rabbitmq

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestParseURLs(t *testing.T) {
	t.Parallel()
	tests := []struct {
		list    string
		want    []string
		wantErr string
	}{
		{list: "amqp://guest:guest@localhost:5672/", want: []string{"amqp://guest:guest@localhost:5672/"}},
		{list: "amqp://a:5672/, amqps://b/vh ,amqp://c:5674", want: []string{"amqp://a:5672/", "amqps://b/vh", "amqp://c:5674"}},
		{list: "", wantErr: "empty URL"},
		{list: "amqp://a:5672/,", wantErr: "empty URL"},
		{list: "amqp://a:5672/,http://b:5672/", wantErr: "URL 2 of 2"},
		{list: "a:5672", wantErr: "URL 1 of 1"},
	}
	for _, tt := range tests {
		t.Run(tt.list, func(t *testing.T) {
			got, err := ParseURLs(tt.list)
			if tt.wantErr != "" {
				require.ErrorContains(t, err, tt.wantErr)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tt.want, got)
		})
	}
}

// A secret in a bad URL stays out of the error.
func TestParseURLsHidesTheURL(t *testing.T) {
	t.Parallel()
	for _, list := range []string{"amqp://u:s3cret@a:5672/,http://u:s3cret@b/", "amqp://u:s3cret@a:bad/", "amqp://u:s3cret@[::1/"} {
		_, err := ParseURLs(list)
		require.Error(t, err)
		require.NotContains(t, err.Error(), "s3cret")
	}
}

func TestRotationStartsEachDialAtTheNextNode(t *testing.T) {
	t.Parallel()
	urls := []string{"a", "b", "c"}
	for n, want := range [][]string{{"a", "b", "c"}, {"b", "c", "a"}, {"c", "a", "b"}, {"a", "b", "c"}} {
		require.Equal(t, want, rotation(urls, uint64(n)), "dial %d", n)
	}
	require.Equal(t, []string{"a", "b", "c"}, urls, "the list itself is left alone")
	require.Equal(t, []string{"x"}, rotation([]string{"x"}, 7))
}

// With nothing listening anywhere, dial tries every node and returns the
// last one's error.
func TestDialTriesEveryNode(t *testing.T) {
	t.Parallel()
	_, err := dial("amqp://guest:guest@127.0.0.1:1/,amqp://guest:guest@127.0.0.1:2/", "test")
	require.ErrorContains(t, err, "none of 2 nodes answered")
	require.Regexp(t, `127\.0\.0\.1:[12]`, err.Error())
}
