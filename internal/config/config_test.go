package config_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/rabbitmq"
)

func TestLoadAPINamesTheBadVariable(t *testing.T) {
	// t.Setenv: not parallel.
	tests := []struct{ name, value, wantInError string }{
		{"API_MAX_BODY_BYTES", "12", "API_MAX_BODY_BYTES"},
		{"API_MAX_BODY_BYTES", "lots", "API_MAX_BODY_BYTES"},
		{"LOG_LEVEL", "loud", "LOG_LEVEL"},
		{"LOG_FORMAT", "xml", "LOG_FORMAT"},
		{"API_READ_TIMEOUT", "-1s", "API_READ_TIMEOUT"},
		{"SHUTDOWN_TIMEOUT", "soon", "SHUTDOWN_TIMEOUT"},
		{"TASK_DEFAULT_MAX_ATTEMPTS", "0", "TASK_DEFAULT_MAX_ATTEMPTS"},
		{"DATABASE_MAX_CONNS", "-3", "DATABASE_MAX_CONNS"},
		{"OUTBOX_NOTIFY_DEBOUNCE", "-1ms", "OUTBOX_NOTIFY_DEBOUNCE"},
		{"MIGRATION_LOCK_TIMEOUT", "0", "MIGRATION_LOCK_TIMEOUT"},
		{"MIGRATION_LOCK_TIMEOUT", "500us", "MIGRATION_LOCK_TIMEOUT"},
		{"MIGRATION_LOCK_TIMEOUT", "600h", "MIGRATION_LOCK_TIMEOUT"},
	}
	for _, tt := range tests {
		t.Run(tt.name+"="+tt.value, func(t *testing.T) {
			t.Setenv(tt.name, tt.value)
			_, err := config.Load[config.API]()
			require.ErrorContains(t, err, tt.wantInError)
		})
	}
}

func TestLoadAPIDefaults(t *testing.T) {
	cfg, err := config.Load[config.API]()
	require.NoError(t, err)
	require.Equal(t, ":8080", cfg.Addr)
	require.Equal(t, int64(1<<20), cfg.MaxBodyBytes)
	require.Equal(t, 3, cfg.DefaultMaxAttempts)
	require.Equal(t, "info", cfg.LogLevel)
	require.Equal(t, 5*time.Second, cfg.MigrationLockTimeout)
}

func TestLoadWorkerNamesTheBadVariable(t *testing.T) {
	tests := []struct{ name, value string }{
		{"WORKER_CONCURRENCY", "0"},
		{"WORKER_CONCURRENCY", "many"},
		{"LEASE_DURATION", "0s"},
		{"HEARTBEAT_INTERVAL", "20s"}, // more than half the 30s lease
		{"MAINTENANCE_INTERVAL", "1m"},
		{"RETRY_BACKOFF_BASE", "-1s"},
		{"WORKER_DEAD_AFTER", "1s"},
		{"CRON_CATCH_UP", "10s"}, // within a failover's 15s
		{"AMQP_URL", ""},
		{"AMQP_URL", "http://localhost:5672/"},
		{"AMQP_URL", "amqp://localhost:5672/,"},
		{"AMQP_URL", "amqp://localhost:5672/,localhost:5673"},
		{"AMQP_QUEUE_TYPE", "stream"},
		{"AMQP_QUEUE_TYPE", "Quorum"},
		{"AMQP_MAX_PRIORITY", "-1"},
		{"AMQP_MAX_PRIORITY", "10"},
		{"AMQP_TASKS_PER_MESSAGE", "0"},
	}
	requireLoadNamesTheBadVariable[config.Worker](t, tests)
}

// requireLoadNamesTheBadVariable loads a T with each bad setting and
// requires the error to name its variable.
func requireLoadNamesTheBadVariable[T interface{ Validate() error }](t *testing.T, tests []struct{ name, value string }) {
	t.Helper()
	for _, tt := range tests {
		t.Run(tt.name+"="+tt.value, func(t *testing.T) {
			t.Setenv(tt.name, tt.value)
			_, err := config.Load[T]()
			require.ErrorContains(t, err, tt.name)
		})
	}
}

// A failover makes ticks late by up to LEADER_TTL (the dead leader's lease
// runs out), a MAINTENANCE_INTERVAL (the next election a worker tries) and a
// SCHEDULER_INTERVAL (the new leader's next pass): a catch-up within that
// would count ordinary ticks of a failover as missed.
func TestLoadWorkerRefusesACatchUpWithinAFailover(t *testing.T) {
	t.Setenv("LEADER_TTL", "15s")
	t.Setenv("MAINTENANCE_INTERVAL", "5s")
	t.Setenv("SCHEDULER_INTERVAL", "500ms")
	t.Setenv("CRON_CATCH_UP", "20s")
	_, err := config.Load[config.Worker]()
	require.ErrorContains(t, err, "CRON_CATCH_UP")
	t.Setenv("CRON_CATCH_UP", "21s")
	_, err = config.Load[config.Worker]()
	require.NoError(t, err)
}

func TestLoadWorkerDefaults(t *testing.T) {
	cfg, err := config.Load[config.Worker]()
	require.NoError(t, err)
	require.Equal(t, ":8082", cfg.AdminAddr)
	require.Equal(t, 256, cfg.Concurrency)
	require.Equal(t, 30*time.Second, cfg.LeaseDuration)
	require.Equal(t, 5*time.Second, cfg.HeartbeatInterval)
	require.Equal(t, rabbitmq.Classic, cfg.AMQPQueueType)
	require.Equal(t, rabbitmq.ClassicQueues, cfg.Queues())
}

func TestLoadWorkerTakesQueuesWithoutPriorities(t *testing.T) {
	t.Setenv("AMQP_MAX_PRIORITY", "0")
	cfg, err := config.Load[config.Worker]()
	require.NoError(t, err)
	require.Equal(t, rabbitmq.Queues{Type: rabbitmq.Classic}, cfg.Queues())

	// Quorum queues take no priorities: a maximum set for them is a
	// mistake, not something to ignore.
	t.Setenv("AMQP_QUEUE_TYPE", "quorum")
	_, err = config.Load[config.Worker]()
	require.ErrorContains(t, err, "AMQP_MAX_PRIORITY")
}

func TestLoadWorkerTakesAClusterAndQuorumQueues(t *testing.T) {
	t.Setenv("AMQP_URL", "amqp://guest:guest@10.0.0.1:5672/, amqps://guest:guest@10.0.0.2/conveyor")
	t.Setenv("AMQP_QUEUE_TYPE", "quorum")
	cfg, err := config.Load[config.Worker]()
	require.NoError(t, err)
	require.Equal(t, rabbitmq.Quorum, cfg.AMQPQueueType)
	require.Equal(t, rabbitmq.QuorumQueues, cfg.Queues())
}

func TestLoadRelayNamesTheBadAMQPURL(t *testing.T) {
	for _, value := range []string{"", "amqp://a:5672/,,amqp://b:5672/", "amqp://a:5672/,mqtt://b:1883",
		// Ports out of range: every dial failed, retried for ever.
		"amqp://a:99999/", "amqp://a:0/", "amqp://a:5672/,amqps://b:65536/"} {
		t.Run(value, func(t *testing.T) {
			t.Setenv("AMQP_URL", value)
			_, err := config.Load[config.Relay]()
			require.ErrorContains(t, err, "AMQP_URL")
		})
	}
	t.Setenv("AMQP_URL", "amqp://a:5672/,amqp://b:5672/")
	_, err := config.Load[config.Relay]()
	require.NoError(t, err)
}

func TestLoadRelayNamesTheBadVariable(t *testing.T) {
	tests := []struct{ name, value string }{
		{"RELAY_BATCH_SIZE", "0"},
		{"RELAY_LANES", "0"},
		{"RELAY_LANES", "17"},
		{"RELAY_LANES", "two"},
		{"AMQP_TASKS_PER_MESSAGE", "0"},
		{"AMQP_TASKS_PER_MESSAGE", "1001"},
	}
	requireLoadNamesTheBadVariable[config.Relay](t, tests)
	cfg, err := config.Load[config.Relay]()
	require.NoError(t, err)
	require.Equal(t, 2, cfg.Lanes)
	require.Equal(t, 64, cfg.TasksPerMessage)
}

// A session idle in a transaction is ended after
// DATABASE_IDLE_IN_TRANSACTION_TIMEOUT; a relay's pass is such a session
// while it waits on the broker, so the timeout must outlast that wait.
func TestLoadBoundsTheIdleTransactionTimeout(t *testing.T) {
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{
		{"DATABASE_IDLE_IN_TRANSACTION_TIMEOUT", "500ms"}})
	requireLoadNamesTheBadVariable[config.Relay](t, []struct{ name, value string }{
		{"DATABASE_IDLE_IN_TRANSACTION_TIMEOUT", "25s"}})
	cfg, err := config.Load[config.Relay]()
	require.NoError(t, err)
	require.Equal(t, time.Minute, cfg.DatabaseIdleTxTimeout)
	t.Setenv("DATABASE_IDLE_IN_TRANSACTION_TIMEOUT", "0")
	_, err = config.Load[config.Relay]()
	require.NoError(t, err, "0 ends no session")
	t.Setenv("DATABASE_IDLE_IN_TRANSACTION_TIMEOUT", "4s")
	t.Setenv("RELAY_CONFIRM_TIMEOUT", "1s")
	_, err = config.Load[config.Relay]()
	require.ErrorContains(t, err, "RELAY_CONFIRM_TIMEOUT + 15s")
}

// An admin address set but empty is a mistake, as API_ADDR's is: the
// relay and the worker would serve /healthz, /readyz and /metrics on a
// random port, where no probe finds them.
func TestLoadRefusesAnEmptyAdminAddr(t *testing.T) {
	requireLoadNamesTheBadVariable[config.Relay](t, []struct{ name, value string }{{"RELAY_ADMIN_ADDR", ""}})
	requireLoadNamesTheBadVariable[config.Worker](t, []struct{ name, value string }{{"WORKER_ADMIN_ADDR", ""}})
}

// An address whose port is out of range, or missing, was only refused
// when the process listened: after connecting to the database (the API
// after migrating it), and naming no variable.
func TestLoadRefusesAnAddrWithABadPort(t *testing.T) {
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{
		{"API_ADDR", ":99999"}, {"API_ADDR", "8080"}, {"API_ADDR", "localhost"}, {"API_ADDR", ":-1"}, {"API_ADDR", " :8080"},
	})
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{{"API_ADMIN_ADDR", ":99999"}})
	requireLoadNamesTheBadVariable[config.Relay](t, []struct{ name, value string }{{"RELAY_ADMIN_ADDR", ":65536"}})
	requireLoadNamesTheBadVariable[config.Worker](t, []struct{ name, value string }{{"WORKER_ADMIN_ADDR", "0.0.0.0"}})
	for _, addr := range []string{":8080", "127.0.0.1:0", "[::1]:8080", "localhost:http"} {
		t.Run(addr+" is fine", func(t *testing.T) {
			t.Setenv("API_ADDR", addr)
			_, err := config.Load[config.API]()
			require.NoError(t, err)
		})
	}
}

// A rate limit that is not a number, or infinite, is not one a person
// meant: it must not start an API whose limit is whatever the limiter
// makes of it.
func TestLoadAPIRefusesANonFiniteRateLimit(t *testing.T) {
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{
		{"API_RATE_LIMIT", "NaN"}, {"API_RATE_LIMIT", "Inf"}, {"API_RATE_LIMIT", "+Inf"},
		{"AUTH_FAILURE_LIMIT", "NaN"}, {"AUTH_FAILURE_LIMIT", "-1"},
	})
	// The failure limit is off by default; a limit set needs a burst.
	t.Setenv("AUTH_FAILURE_LIMIT", "10")
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{{"AUTH_FAILURE_BURST", "0"}})
}

// The issuer's URL is only used once a person's token arrives: a malformed
// one must stop the start, not refuse every token later.
func TestLoadAPIRefusesAMalformedOIDCIssuerURL(t *testing.T) {
	t.Setenv("OIDC_AUDIENCE", "conveyor")
	for _, value := range []string{"not a url", "accounts.example.com", "ftp://issuer.example.com", "https://",
		"https://issuer.example.com:99999", "https://:443"} {
		t.Run(value, func(t *testing.T) {
			t.Setenv("OIDC_ISSUER_URL", value)
			_, err := config.Load[config.API]()
			require.ErrorContains(t, err, "OIDC_ISSUER_URL")
		})
	}
	t.Setenv("OIDC_ISSUER_URL", "https://issuer.example.com/realms/acme")
	_, err := config.Load[config.API]()
	require.NoError(t, err)

	// Tokens carry their audience exactly: a padded one refused them all.
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{
		{"OIDC_AUDIENCE", " conveyor"}, {"OIDC_AUDIENCE", "conveyor\n"}, {"OIDC_AUDIENCE", " "},
	})
}

// Every live stream allocates its buffer when it opens: an unbounded
// STREAM_BUFFER starts an API that dies of an out-of-memory fatal error
// (not a recoverable panic) at its first stream.
func TestLoadAPIBoundsStreamBuffer(t *testing.T) {
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{
		{"STREAM_BUFFER", "1000000000000"},
	})
}

// STREAM_MAX_PER_ORG keeps one org from taking every stream of an
// instance by default, and a negative one is a mistake, not "no bound".
func TestLoadAPIStreamMaxPerOrg(t *testing.T) {
	cfg, err := config.Load[config.API]()
	require.NoError(t, err)
	require.Positive(t, cfg.StreamMaxPerOrg)
	require.Less(t, cfg.StreamMaxPerOrg, cfg.StreamMax)
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{
		{"STREAM_MAX_PER_ORG", "-1"},
	})
}

// The CLI and the dashboard's client take a stream silent for a minute for
// dead and open it again: a heartbeat as rare as that would have every
// quiet stream cut and reopened, and a watch given up after its reconnects.
func TestLoadAPIBoundsStreamHeartbeat(t *testing.T) {
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{
		{"STREAM_HEARTBEAT", "31s"},
		{"STREAM_HEARTBEAT", "5m"},
	})
	t.Setenv("STREAM_HEARTBEAT", "30s")
	_, err := config.Load[config.API]()
	require.NoError(t, err)
}

// AUTH_DEV_ORG is the slug of the org every request acts in with
// AUTH_DISABLED: one that is no slug must stop the start with a message
// naming it, not after connecting, with the database's check constraint
// blamed on AUTH_DISABLED.
func TestLoadAPIRefusesADevOrgThatIsNoSlug(t *testing.T) {
	t.Setenv("AUTH_DISABLED", "true")
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{
		{"AUTH_DEV_ORG", "My Org"}, {"AUTH_DEV_ORG", "Dev"}, {"AUTH_DEV_ORG", ""},
	})
	t.Setenv("AUTH_DEV_ORG", "local-dev")
	_, err := config.Load[config.API]()
	require.NoError(t, err)
}

// The trace exporter reads OTEL_TRACES_EXPORTER and the OTLP protocol
// itself, and refused a bad one with "unknown exporter or metrics
// producer" or "invalid OTLP protocol", naming no variable.
func TestLoadNamesTheBadOTELVariable(t *testing.T) {
	requireLoadNamesTheBadVariable[config.Relay](t, []struct{ name, value string }{
		{"OTEL_TRACES_EXPORTER", "jaeger"},
	})
	t.Setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
	requireLoadNamesTheBadVariable[config.Worker](t, []struct{ name, value string }{
		{"OTEL_EXPORTER_OTLP_PROTOCOL", "grcp"},
		{"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http"},
	})
	for _, tt := range [][2]string{
		{"OTEL_TRACES_EXPORTER", "otlp"}, {"OTEL_TRACES_EXPORTER", "console"}, {"OTEL_TRACES_EXPORTER", "none"},
		{"OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"}, {"OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"},
	} {
		t.Run(tt[0]+"="+tt[1]+" is fine", func(t *testing.T) {
			t.Setenv(tt[0], tt[1])
			_, err := config.Load[config.API]()
			require.NoError(t, err)
		})
	}
}

// The scheduler waits SCHEDULER_MIN_INTERVAL after each pass: a minimum
// longer than SCHEDULER_INTERVAL spaces every pass by it, and a
// CRON_CATCH_UP checked against SCHEDULER_INTERVAL alone would have a job
// that skips missed ticks lose ordinary ones.
func TestLoadWorkerRefusesASchedulerMinimumPastItsInterval(t *testing.T) {
	t.Setenv("SCHEDULER_INTERVAL", "500ms")
	t.Setenv("SCHEDULER_MIN_INTERVAL", "2m")
	_, err := config.Load[config.Worker]()
	require.ErrorContains(t, err, "SCHEDULER_MIN_INTERVAL")
	t.Setenv("SCHEDULER_MIN_INTERVAL", "500ms")
	_, err = config.Load[config.Worker]()
	require.NoError(t, err, "a minimum equal to the interval")

	// A failover's delay includes the minimum, waited before the interval.
	t.Setenv("LEADER_TTL", "15s")
	t.Setenv("MAINTENANCE_INTERVAL", "5s")
	t.Setenv("SCHEDULER_INTERVAL", "10s")
	t.Setenv("SCHEDULER_MIN_INTERVAL", "10s")
	t.Setenv("CRON_CATCH_UP", "35s")
	_, err = config.Load[config.Worker]()
	require.ErrorContains(t, err, "CRON_CATCH_UP")
	t.Setenv("CRON_CATCH_UP", "41s")
	_, err = config.Load[config.Worker]()
	require.NoError(t, err)
}

// Durations of a few million hours overflow when doubled or added: the
// interplay checks must still refuse them, not see a negative sum.
func TestLoadInterplayChecksDoNotOverflow(t *testing.T) {
	t.Setenv("WORKER_DEAD_AFTER", "2500000h")
	requireLoadNamesTheBadVariable[config.Worker](t, []struct{ name, value string }{
		{"HEARTBEAT_INTERVAL", "2000000h"}, // doubled, past the largest duration
	})
	t.Setenv("LEADER_TTL", "2000000h")
	t.Setenv("MAINTENANCE_INTERVAL", "1000000h")
	_, err := config.Load[config.Worker]()
	require.ErrorContains(t, err, "CRON_CATCH_UP")
	t.Setenv("RELAY_CONFIRM_TIMEOUT", "2562047h")
	_, err = config.Load[config.Relay]()
	require.ErrorContains(t, err, "DATABASE_IDLE_IN_TRANSACTION_TIMEOUT")
}

// PostgreSQL takes its timeouts in whole milliseconds up to INT_MAX: past
// it every connection failed with the server's parameter named, not the
// variable, and an API_REQUEST_TIMEOUT under 1ms set no statement timeout.
func TestLoadBoundsTheServersTimeouts(t *testing.T) {
	requireLoadNamesTheBadVariable[config.Relay](t, []struct{ name, value string }{
		{"DATABASE_IDLE_IN_TRANSACTION_TIMEOUT", "600h"},
	})
	t.Setenv("API_WRITE_TIMEOUT", "1000h")
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{
		{"API_REQUEST_TIMEOUT", "600h"},
		{"API_REQUEST_TIMEOUT", "500us"},
	})
	t.Setenv("DATABASE_IDLE_IN_TRANSACTION_TIMEOUT", "596h")
	t.Setenv("API_REQUEST_TIMEOUT", "596h")
	_, err := config.Load[config.API]()
	require.NoError(t, err)
}

// JAEGER_UI_URL is the base of every task's trace_url: an empty or
// relative one made links to the API's own /trace/ paths, and a malformed
// one links that lead nowhere, instead of stopping the start.
func TestLoadAPIRefusesAMalformedJaegerUIURL(t *testing.T) {
	requireLoadNamesTheBadVariable[config.API](t, []struct{ name, value string }{
		{"JAEGER_UI_URL", ""}, {"JAEGER_UI_URL", "jaeger:16686"}, {"JAEGER_UI_URL", "::not a url"},
		{"JAEGER_UI_URL", " http://jaeger:16686"}, {"JAEGER_UI_URL", "/jaeger"}, {"JAEGER_UI_URL", "http://jaeger:166860"},
	})
	t.Setenv("JAEGER_UI_URL", "https://jaeger.example.com/")
	_, err := config.Load[config.API]()
	require.NoError(t, err)
}
