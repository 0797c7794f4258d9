package cli

import (
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
	require.Equal(t, 0, healthcheck([]string{srv.URL}))
	ready = false
	require.Equal(t, 1, healthcheck([]string{srv.URL}))
	require.Equal(t, 2, healthcheck(nil), "usage")
	require.Equal(t, 1, healthcheck([]string{"http://127.0.0.1:1/readyz"}))
}
