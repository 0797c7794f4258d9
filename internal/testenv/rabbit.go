// Package testenv gives tests isolated pieces of the real infrastructure:
// a RabbitMQ vhost of their own on the shared broker, and private server
// instances for tests that stop or cut them.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// DefaultAMQPURL is the shared broker unless TEST_AMQP_URL says otherwise.
const DefaultAMQPURL = "amqp://guest:guest@127.0.0.1:5672/"

// AMQPURL is the shared broker's URL (default vhost).
func AMQPURL() string {
	if u := os.Getenv("TEST_AMQP_URL"); u != "" {
		return u
	}
	return DefaultAMQPURL
}

// DefaultManagementURL is the shared broker's HTTP management API unless
// TEST_RABBITMQ_MANAGEMENT_URL says otherwise.
const DefaultManagementURL = "http://guest:guest@127.0.0.1:15672"

// NewVhost creates a vhost for t on the shared broker, gives guest every
// permission on it, deletes it when t ends, and returns its AMQP URL. It
// uses the broker's HTTP management API when it answers (a few
// milliseconds), and rabbitmqctl otherwise (a second or so each call).
func NewVhost(t testing.TB) string {
	t.Helper()
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	vhost := "conveyor_test_" + hex.EncodeToString(b)
	if managementAPI(t, http.MethodPut, "/api/vhosts/"+vhost, "") {
		t.Cleanup(func() { managementAPI(t, http.MethodDelete, "/api/vhosts/"+vhost, "") })
		if !managementAPI(t, http.MethodPut, "/api/permissions/"+vhost+"/guest", `{"configure":".*","write":".*","read":".*"}`) {
			t.Fatalf("testenv: set permissions on %s through the management API", vhost)
		}
	} else {
		rabbitmqctl(t, "add_vhost", vhost)
		t.Cleanup(func() { rabbitmqctl(t, "delete_vhost", vhost) })
		rabbitmqctl(t, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
	}
	u, err := url.Parse(AMQPURL())
	if err != nil {
		t.Fatalf("testenv: bad AMQP URL: %v", err)
	}
	u.Path = "/" + vhost
	return u.String()
}

// managementAPI makes one call to the management API and reports whether
// it succeeded; false when the API does not answer at all.
func managementAPI(t testing.TB, method, path, body string) bool {
	t.Helper()
	base := DefaultManagementURL
	if u := os.Getenv("TEST_RABBITMQ_MANAGEMENT_URL"); u != "" {
		base = u
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, method, base+path, strings.NewReader(body))
	if err != nil {
		t.Fatalf("testenv: %v", err)
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	if resp.StatusCode >= 300 {
		out, _ := io.ReadAll(resp.Body)
		t.Fatalf("testenv: management API %s %s: %s %s", method, path, resp.Status, out)
	}
	return true
}

func rabbitmqctl(t testing.TB, args ...string) {
	t.Helper()
	out, err := exec.Command("rabbitmqctl", append([]string{"-q"}, args...)...).CombinedOutput()
	if err != nil {
		t.Fatalf("testenv: rabbitmqctl %v: %v\n%s", args, err, out)
	}
}

func randomSuffix() string {
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}
