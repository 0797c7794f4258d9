package main

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
)

// Hostile input: every answer is a clear 4xx problem, nothing is written,
// and the API keeps serving everyone else.
func TestHostileInputIsRefusedCleanly(t *testing.T) {
	t.Parallel()
	b := setup(t)
	deep := func(n int) string {
		return `{"type":"demo.sleep","payload":{"a":` + strings.Repeat("[", n) + strings.Repeat("]", n) + `}}`
	}
	tests := []struct {
		name, path, body string
		header           []string
		status           int
		mention          string
	}{
		{"nesting past any sane depth", "/v1/tasks", deep(100_000), nil, 400, "malformed"},
		{"nesting deeper than allowed", "/v1/tasks", deep(200), nil, 422, "levels deep"},
		{"invalid UTF-8 in type", "/v1/tasks", "{\"type\":\"demo.\xff\"}", nil, 422, "type"},
		{"invalid UTF-8 in payload", "/v1/tasks", "{\"type\":\"a\",\"payload\":{\"s\":\"\xc3\x28\"}}", nil, 422, "UTF-8"},
		{"invalid UTF-8 in idempotency key", "/v1/tasks", `{"type":"a"}`, []string{"Idempotency-Key", "k\xff"}, 422, "printable ASCII"},
		{"SQL in the type", "/v1/tasks", `{"type":"a'; DROP TABLE tasks; --"}`, nil, 422, "type"},
		{"huge max_attempts", "/v1/tasks", `{"type":"a","max_attempts":1e18}`, nil, 422, "max_attempts"},
		{"negative max_attempts", "/v1/tasks", `{"type":"a","max_attempts":-5}`, nil, 422, "max_attempts"},
		{"huge number in payload", "/v1/tasks", `{"type":"a","payload":{"n":1e400}}`, nil, 422, "payload"},
		{"huge priority as string", "/v1/tasks", `{"type":"a","priority":"99999999999999999999"}`, nil, 422, "priority"},
		{"metadata not an object", "/v1/tasks", `{"type":"a","metadata":"'; DROP TABLE tasks; --"}`, nil, 422, "metadata"},
	}
	before := b.counts(t)
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp := b.do(t, http.MethodPost, tt.path, "application/json", tt.body, tt.header...)
			require.Equal(t, tt.status, resp.status, string(resp.body))
			require.Equal(t, "application/problem+json", resp.header.Get("Content-Type"))
			require.Contains(t, resp.json(t)["detail"], tt.mention)
			require.Equal(t, before, b.counts(t), "refused input writes nothing")
		})
	}
	for _, path := range []string{
		"/v1/tasks?type=a'%20OR%201=1", "/v1/tasks?status=PENDING'%20OR%20'1'='1", "/v1/tasks?limit=-1",
		"/v1/tasks?limit=99999999999999999999", "/v1/tasks?cursor=%27%3B--", "/v1/tasks?type=%ff",
	} {
		resp := b.get(t, path)
		require.True(t, resp.status == 200 || (resp.status >= 400 && resp.status < 500), "%s: %d %s", path, resp.status, resp.body)
		if resp.status == 200 {
			require.Empty(t, resp.json(t)["tasks"], "%s matches nothing", path)
		}
	}
	require.Equal(t, before, b.counts(t))

	// SQL metacharacters in the data are data: stored and given back as sent.
	sqlish := `'; DROP TABLE tasks; -- \" OR 1=1 /* */`
	resp := b.post(t, "/v1/tasks", fmt.Sprintf(`{"type":"demo.sleep","payload":{"q":%q},"metadata":{"m":%q}}`, sqlish, sqlish),
		"Idempotency-Key", "x'; DELETE FROM outbox; --")
	require.Equal(t, http.StatusCreated, resp.status, string(resp.body))
	got := resp.json(t)
	require.Equal(t, sqlish, got["payload"].(map[string]any)["q"])
	require.Equal(t, sqlish, got["metadata"].(map[string]any)["m"])
}

// Slow clients hold no handler: a client that never finishes its headers is
// cut off after the read-header timeout, and others are served meanwhile.
func TestSlowClientsDoNotStarveOthers(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.ReadHeaderTimeout, c.ReadTimeout = 500*time.Millisecond, time.Second })
	addr := strings.TrimPrefix(b.base, "http://")
	var wg sync.WaitGroup
	closed := make(chan time.Duration, 50)
	for range 50 {
		conn, err := net.Dial("tcp", addr)
		require.NoError(t, err)
		t.Cleanup(func() { _ = conn.Close() })
		_, err = conn.Write([]byte("POST /v1/tasks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"))
		require.NoError(t, err)
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, _ = bufio.NewReader(conn).ReadString('\n') // the server's 408 or its close
			closed <- time.Since(start)
		}()
	}
	for i := range 20 {
		resp := b.post(t, "/v1/tasks", fmt.Sprintf(`{"type":"demo.sleep","payload":{"served":%d}}`, i))
		require.Equal(t, http.StatusCreated, resp.status)
	}
	wg.Wait()
	close(closed)
	for d := range closed {
		require.Less(t, d, 5*time.Second, "slow connections are cut by the server, not by the test")
	}
}
