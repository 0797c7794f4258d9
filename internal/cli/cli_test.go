package cli

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestHealthcheckExitCodes(t *testing.T) {
	t.Parallel()
	ready := true
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		if !ready {
			w.WriteHeader(http.StatusServiceUnavailable)
		}
	}))
	t.Cleanup(srv.Close)
	require.Equal(t, 0, healthcheck([]string{srv.URL}, io.Discard, io.Discard))
	ready = false
	require.Equal(t, 1, healthcheck([]string{srv.URL}, io.Discard, io.Discard))
	require.Equal(t, 2, healthcheck(nil, io.Discard, io.Discard), "usage")
	require.Equal(t, 1, healthcheck([]string{"http://127.0.0.1:1/readyz"}, io.Discard, io.Discard))
}

// `healthcheck -h` prints its usage, as the services' -h does, rather than
// trying to GET "-h"; extra arguments and a URL that is not http(s) are a
// wrong call (2), not an unhealthy service (1).
func TestHealthcheckArguments(t *testing.T) {
	t.Parallel()
	for _, h := range []string{"-h", "-help", "--help", "help"} {
		var stdout, stderr bytes.Buffer
		require.Equal(t, 0, healthcheck([]string{h}, &stdout, &stderr), h)
		require.Contains(t, stdout.String(), "usage: healthcheck URL", h)
		require.Empty(t, stderr.String(), h)
	}
	for _, args := range [][]string{
		{"http://127.0.0.1:1/readyz", "http://127.0.0.1:1/healthz"},
		{"-h", "http://127.0.0.1:1/readyz"},
		{"localhost:8080/readyz"},
		{"127.0.0.1:8080"},
		{"/readyz"},
		{"ftp://127.0.0.1/readyz"},
	} {
		var stdout, stderr bytes.Buffer
		require.Equal(t, 2, healthcheck(args, &stdout, &stderr), "%q", args)
		require.Contains(t, stderr.String(), "usage: healthcheck URL", "%q", args)
		require.Empty(t, stdout.String(), "%q", args)
	}
}
