package conveyor

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestHandleRejectsInvalidTypes(t *testing.T) {
	t.Parallel()
	fn := func(context.Context, Task, Reporter) (any, error) { return nil, nil }
	for _, bad := range []string{"", "Upper", "-lead", "has space", string(make([]byte, 129))} {
		require.Panics(t, func() { Handle(bad, fn) }, "type %q", bad)
	}
	require.Panics(t, func() { Handle("ok", nil) })
	require.Equal(t, "images.resize_v2-x", Handle("images.resize_v2-x", fn).Type)
}
