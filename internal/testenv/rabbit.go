// Package testenv gives tests isolated pieces of the real infrastructure:
// a RabbitMQ vhost of their own on the shared broker, and private server
// instances for tests that stop or cut them.
package testenv

import (
	"crypto/rand"
	"encoding/hex"
	"net/url"
	"os"
	"os/exec"
	"testing"
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

// NewVhost creates a vhost for t on the shared broker, gives guest every
// permission on it, deletes it when t ends, and returns its AMQP URL.
func NewVhost(t testing.TB) string {
	t.Helper()
	b := make([]byte, 5)
	_, _ = rand.Read(b)
	vhost := "conveyor_test_" + hex.EncodeToString(b)
	rabbitmqctl(t, "add_vhost", vhost)
	t.Cleanup(func() { rabbitmqctl(t, "delete_vhost", vhost) })
	rabbitmqctl(t, "set_permissions", "-p", vhost, "guest", ".*", ".*", ".*")
	u, err := url.Parse(AMQPURL())
	if err != nil {
		t.Fatalf("testenv: bad AMQP URL: %v", err)
	}
	u.Path = "/" + vhost
	return u.String()
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
