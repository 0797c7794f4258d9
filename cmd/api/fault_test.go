package main

import (
	"net/http"
	"net/url"
	"strings"
	"syscall"
	"testing"
	"time"

	toxiproxy "github.com/Shopify/toxiproxy/v2"
	"github.com/rs/zerolog"
	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/testenv"
)

// startAPI runs the api binary against dbURL and waits until it is ready.
func startAPI(t *testing.T, dbURL string, env ...string) (*testenv.Process, string) {
	t.Helper()
	addr := testenv.FreeAddr(t)
	p := testenv.Start(t, "api", testenv.Binary(t, "./cmd/api"), append([]string{
		"DATABASE_URL=" + dbURL, "API_ADDR=" + addr, "AUTH_DISABLED=true", "LOG_LEVEL=info", "LOG_FORMAT=text",
		"SHUTDOWN_TIMEOUT=5s"}, env...)...)
	testenv.Eventually(t, 30*time.Second, func() error { return testenv.WantStatus("http://"+addr+"/readyz", http.StatusOK) })
	return p, addr
}

func TestAPIReadinessFollowsAPostgresRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("process-level fault test")
	}
	t.Parallel()
	pg := testenv.StartPG(t)
	dbURL, _ := pg.Migrated(t, "conveyor")
	api, addr := startAPI(t, dbURL)

	pg.Stop(t)
	testenv.Eventually(t, 10*time.Second, func() error {
		return testenv.WantStatus("http://"+addr+"/readyz", http.StatusServiceUnavailable)
	})
	require.NoError(t, testenv.WantStatus("http://"+addr+"/healthz", http.StatusOK))
	pg.Start(t)
	testenv.Eventually(t, 30*time.Second, func() error { return testenv.WantStatus("http://"+addr+"/readyz", http.StatusOK) })
	require.False(t, api.Exited(), api.Output())

	api.Signal(syscall.SIGTERM)
	require.Equal(t, 0, api.Wait(t, 10*time.Second), api.Output())
}

// A database that stops answering (a host gone without closing its
// sockets) must not hold /readyz open: a probe gives up after a second or
// a few, and then reads a timeout instead of the reason. Nor may it hold a
// stopping api long past its shutdown timeout.
func TestAPIAnswersAndStopsInTimeWhenPostgresHangs(t *testing.T) {
	if testing.Short() {
		t.Skip("process-level fault test")
	}
	t.Parallel()
	pg := testenv.StartPG(t)
	dbURL, _ := pg.Migrated(t, "conveyor")
	u, err := url.Parse(dbURL)
	require.NoError(t, err)
	srv := toxiproxy.NewServer(toxiproxy.NewMetricsContainer(nil), zerolog.Nop())
	proxy := toxiproxy.NewProxy(srv, "postgres", "127.0.0.1:0", u.Host)
	require.NoError(t, proxy.Start())
	t.Cleanup(proxy.Stop)
	u.Host = proxy.Listen
	api, addr := startAPI(t, u.String())

	_, err = proxy.Toxics.AddToxicJson(strings.NewReader(`{"name": "hang", "type": "timeout", "stream": "upstream", "attributes": {"timeout": 0}}`))
	require.NoError(t, err)
	client := &http.Client{Timeout: 30 * time.Second}
	start := time.Now()
	resp, err := client.Get("http://" + addr + "/readyz")
	require.NoError(t, err)
	resp.Body.Close()
	took := time.Since(start)
	require.Equal(t, http.StatusServiceUnavailable, resp.StatusCode)
	require.Less(t, took, 3*time.Second, "readyz took %s", took)

	// The healthz of a live process answers at once.
	start = time.Now()
	require.NoError(t, testenv.WantStatus("http://"+addr+"/healthz", http.StatusOK))
	require.Less(t, time.Since(start), time.Second)

	api.Signal(syscall.SIGTERM)
	require.Equal(t, 0, api.Wait(t, 15*time.Second), api.Output())
}
