// Package config holds the typed configuration of each binary, read once from
// the environment at start-up. Constructors elsewhere take these structs (or
// parts of them) and never read the environment themselves.
package config

import (
	"context"
	"fmt"
	"math"
	"net"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/task"
)

// Common is what every binary reads.
type Common struct {
	DatabaseURL      string `envconfig:"DATABASE_URL" default:"postgres://postgres@localhost:5432/conveyor?sslmode=disable"`
	DatabaseMaxConns int32  `envconfig:"DATABASE_MAX_CONNS" default:"0"`
	// DatabaseIdleTxTimeout ends, on the server, a session left idle in a
	// transaction for longer (0: never): a process frozen or cut off
	// without its socket closing (a paused VM, a host that vanished) would
	// otherwise hold its transaction's row locks until TCP keepalive gives
	// up, which takes hours by default — a relay's locked outbox rows, a
	// worker's tasks.
	DatabaseIdleTxTimeout time.Duration `envconfig:"DATABASE_IDLE_IN_TRANSACTION_TIMEOUT" default:"1m"`
	LogLevel              string        `envconfig:"LOG_LEVEL" default:"info"`
	LogFormat             string        `envconfig:"LOG_FORMAT" default:"json"`
	ShutdownTimeout       time.Duration `envconfig:"SHUTDOWN_TIMEOUT" default:"30s"`

	// MigrationLockTimeout is the longest a migration waits for a table's
	// lock before it is rolled back and tried again later: every statement
	// on the table queues behind the waiting migration (see
	// postgres.MigrateConfig). The relay, which never migrates, reads it
	// with the rest.
	MigrationLockTimeout time.Duration `envconfig:"MIGRATION_LOCK_TIMEOUT" default:"5s"`

	// OTLPEndpoint and OTLPTracesEndpoint only decide whether traces are
	// exported; the exporter itself reads every OTEL_* variable.
	OTLPEndpoint       string `envconfig:"OTEL_EXPORTER_OTLP_ENDPOINT"`
	OTLPTracesEndpoint string `envconfig:"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"`
	TracesExporter     string `envconfig:"OTEL_TRACES_EXPORTER"`
	ServiceName        string `envconfig:"OTEL_SERVICE_NAME"`
	// OTLPProtocol and OTLPTracesProtocol are only checked here (the
	// traces' own wins): the exporter refused a bad one naming neither.
	OTLPProtocol       string `envconfig:"OTEL_EXPORTER_OTLP_PROTOCOL"`
	OTLPTracesProtocol string `envconfig:"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"`
}

// Validate checks what envconfig's parsing cannot.
func (c Common) Validate() error {
	if c.DatabaseURL == "" {
		return fmt.Errorf("DATABASE_URL: must not be empty")
	}
	if c.DatabaseMaxConns < 0 {
		return fmt.Errorf("DATABASE_MAX_CONNS: must not be negative, got %d", c.DatabaseMaxConns)
	}
	if c.DatabaseIdleTxTimeout != 0 && (c.DatabaseIdleTxTimeout < time.Second || c.DatabaseIdleTxTimeout > maxServerTimeout) {
		return fmt.Errorf("DATABASE_IDLE_IN_TRANSACTION_TIMEOUT: must be 0 (never) or between 1s and %s, got %s", maxServerTimeout, c.DatabaseIdleTxTimeout)
	}
	// PostgreSQL's lock_timeout is in whole milliseconds: under one would
	// be 0, no timeout at all.
	if c.MigrationLockTimeout < time.Millisecond || c.MigrationLockTimeout > maxServerTimeout {
		return fmt.Errorf("MIGRATION_LOCK_TIMEOUT: must be between 1ms and %s, got %s", maxServerTimeout, c.MigrationLockTimeout)
	}
	if err := oneOf("LOG_LEVEL", strings.ToLower(c.LogLevel), "debug", "info", "warn", "error"); err != nil {
		return err
	}
	if err := oneOf("LOG_FORMAT", strings.ToLower(c.LogFormat), "json", "text"); err != nil {
		return err
	}
	if err := positive("SHUTDOWN_TIMEOUT", c.ShutdownTimeout); err != nil {
		return err
	}
	return c.validTracing()
}

// validTracing checks what the trace exporter reads, when traces are
// exported: which exporter (as go.opentelemetry.io/contrib's autoexport
// knows them) and, for OTLP, which protocol.
func (c Common) validTracing() error {
	if !c.ExportTraces() {
		return nil
	}
	if c.TracesExporter != "" {
		if err := oneOf("OTEL_TRACES_EXPORTER", c.TracesExporter, "otlp", "console", "none"); err != nil {
			return err
		}
	}
	if c.TracesExporter != "" && c.TracesExporter != "otlp" {
		return nil
	}
	name, proto := "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", c.OTLPTracesProtocol
	if proto == "" {
		name, proto = "OTEL_EXPORTER_OTLP_PROTOCOL", c.OTLPProtocol
	}
	if proto == "" {
		return nil
	}
	return oneOf(name, proto, "grpc", "http/protobuf")
}

// ExportTraces reports whether an OTLP (or other) trace exporter was asked for.
func (c Common) ExportTraces() bool {
	if c.TracesExporter == "none" {
		return false
	}
	return c.OTLPEndpoint != "" || c.OTLPTracesEndpoint != "" || c.TracesExporter != ""
}

// API configures cmd/api.
type API struct {
	Common
	Addr               string        `envconfig:"API_ADDR" default:":8080"`
	JaegerUIURL        string        `envconfig:"JAEGER_UI_URL" default:"http://localhost:16686"`
	MaxBodyBytes       int64         `envconfig:"API_MAX_BODY_BYTES" default:"1048576"`
	DefaultMaxAttempts int           `envconfig:"TASK_DEFAULT_MAX_ATTEMPTS" default:"3"`
	ReadHeaderTimeout  time.Duration `envconfig:"API_READ_HEADER_TIMEOUT" default:"5s"`
	ReadTimeout        time.Duration `envconfig:"API_READ_TIMEOUT" default:"30s"`
	WriteTimeout       time.Duration `envconfig:"API_WRITE_TIMEOUT" default:"30s"`
	IdleTimeout        time.Duration `envconfig:"API_IDLE_TIMEOUT" default:"120s"`
	// AdminAddr, when set, serves /metrics (with /healthz, /readyz and
	// Go's profiles) on an address of its own, and API_ADDR no longer
	// serves /metrics: the API's port faces clients, and metrics name
	// every org's task types.
	AdminAddr string `envconfig:"API_ADMIN_ADDR"`
	// NotifyDebounce bounds how often the API wakes the relays with NOTIFY.
	NotifyDebounce time.Duration `envconfig:"OUTBOX_NOTIFY_DEBOUNCE" default:"2ms"`
	// RequestTimeout bounds a request's work (and each of its statements,
	// on the server): past it the request answers 503.
	RequestTimeout time.Duration `envconfig:"API_REQUEST_TIMEOUT" default:"10s"`
	// TrustTraceContext continues the trace of a caller's traceparent;
	// off, every request starts its own trace, linked to the caller's.
	TrustTraceContext bool `envconfig:"API_TRUST_TRACE_CONTEXT" default:"false"`

	// OIDCIssuerURL and OIDCAudience accept people's tokens (JWTs) of one
	// OpenID Connect issuer; unset, only API keys are accepted.
	OIDCIssuerURL string `envconfig:"OIDC_ISSUER_URL"`
	OIDCAudience  string `envconfig:"OIDC_AUDIENCE"`
	// AuthCacheTTL is how long a looked-up key or user is trusted: a
	// revoked key is refused by every instance within it.
	AuthCacheTTL time.Duration `envconfig:"AUTH_CACHE_TTL" default:"500ms"`
	// RateLimit is the requests per second each key or user may make,
	// with bursts of RateBurst; 0 turns the limit off.
	RateLimit float64 `envconfig:"API_RATE_LIMIT" default:"1000"`
	RateBurst int     `envconfig:"API_RATE_BURST" default:"2000"`
	// AuthFailureLimit is the failed authentications a second each client
	// address may make, with bursts of AuthFailureBurst: past it the
	// address is refused before its credentials are looked up (keys this
	// instance has found before still pass). 0, the default, turns the
	// limit off: behind a proxy every client has the proxy's address, and
	// one client's flood would refuse the others' people and new keys.
	AuthFailureLimit float64 `envconfig:"AUTH_FAILURE_LIMIT" default:"0"`
	AuthFailureBurst int     `envconfig:"AUTH_FAILURE_BURST" default:"100"`
	// MaxUnservedTypes bounds how many task types that no worker serves
	// an org may have tasks waiting for; 0: no bound.
	MaxUnservedTypes int `envconfig:"API_ORG_MAX_UNSERVED_TYPES" default:"100"`
	// AuthDisabled lets every request in as an admin of the org DevOrg:
	// for a developer's machine only, and loudly warned about.
	AuthDisabled bool   `envconfig:"AUTH_DISABLED" default:"false"`
	DevOrg       string `envconfig:"AUTH_DEV_ORG" default:"dev"`

	// StreamHeartbeat is how often an idle live stream sends a comment to
	// keep proxies from closing it (and checks the caller's credentials).
	StreamHeartbeat time.Duration `envconfig:"STREAM_HEARTBEAT" default:"15s"`
	// StreamMax bounds the live streams one instance serves at once.
	StreamMax int `envconfig:"STREAM_MAX" default:"10000"`
	// StreamMaxPerOrg bounds the live streams one org holds on one
	// instance, so that one org (one busy key) cannot take all of
	// STREAM_MAX from the others; 0: no bound.
	StreamMaxPerOrg int `envconfig:"STREAM_MAX_PER_ORG" default:"1000"`
	// StreamBuffer is how many events a stream may fall behind before it
	// is closed (its client resumes with Last-Event-ID).
	StreamBuffer int `envconfig:"STREAM_BUFFER" default:"1024"`
	// StreamGapTimeout bounds how long a hole in the event ids (a
	// transaction that has not committed yet) may hold the streams.
	StreamGapTimeout time.Duration `envconfig:"STREAM_GAP_TIMEOUT" default:"10s"`
}

// Validate checks the API's configuration.
func (c API) Validate() error {
	if err := c.Common.Validate(); err != nil {
		return err
	}
	if err := validAddr("API_ADDR", c.Addr); err != nil {
		return err
	}
	if c.AdminAddr != "" {
		if err := validAddr("API_ADMIN_ADDR", c.AdminAddr); err != nil {
			return err
		}
	}
	if c.MaxBodyBytes < 1024 {
		return fmt.Errorf("API_MAX_BODY_BYTES: must be at least 1024, got %d", c.MaxBodyBytes)
	}
	if c.DefaultMaxAttempts < 1 || c.DefaultMaxAttempts > 100 {
		return fmt.Errorf("TASK_DEFAULT_MAX_ATTEMPTS: must be between 1 and 100, got %d", c.DefaultMaxAttempts)
	}
	for name, d := range map[string]time.Duration{
		"API_READ_HEADER_TIMEOUT": c.ReadHeaderTimeout, "API_READ_TIMEOUT": c.ReadTimeout,
		"API_WRITE_TIMEOUT": c.WriteTimeout, "API_IDLE_TIMEOUT": c.IdleTimeout,
		"API_REQUEST_TIMEOUT": c.RequestTimeout, "STREAM_HEARTBEAT": c.StreamHeartbeat,
		"STREAM_GAP_TIMEOUT": c.StreamGapTimeout,
	} {
		if err := positive(name, d); err != nil {
			return err
		}
	}
	// A client takes a stream silent for a minute for dead (apiclient's
	// StreamIdleTimeout), and proxies often cut one idle that long.
	if c.StreamHeartbeat > maxStreamHeartbeat {
		return fmt.Errorf("STREAM_HEARTBEAT: must be at most %s (clients take a stream silent for a minute for dead), got %s",
			maxStreamHeartbeat, c.StreamHeartbeat)
	}
	// It is each statement's timeout on the server too, in whole
	// milliseconds: under one would be 0, no timeout at all.
	if c.RequestTimeout < time.Millisecond || c.RequestTimeout > maxServerTimeout {
		return fmt.Errorf("API_REQUEST_TIMEOUT: must be between 1ms and %s, got %s", maxServerTimeout, c.RequestTimeout)
	}
	if c.RequestTimeout >= c.WriteTimeout {
		return fmt.Errorf("API_REQUEST_TIMEOUT: must be shorter than API_WRITE_TIMEOUT (%s), got %s", c.WriteTimeout, c.RequestTimeout)
	}
	if (c.OIDCIssuerURL == "") != (c.OIDCAudience == "") {
		return fmt.Errorf("OIDC_ISSUER_URL and OIDC_AUDIENCE: set both or neither")
	}
	// The base of every task's trace link: a relative or malformed one
	// would send people to the API's own paths, or nowhere.
	if !httpURL(c.JaegerUIURL) {
		return fmt.Errorf("JAEGER_UI_URL: must be Jaeger's http(s) URL, such as http://jaeger.example.com:16686, got %q", c.JaegerUIURL)
	}
	// Tokens name their audience exactly: one padded with white space
	// (a quoted value in a manifest) refused every person's token.
	if c.OIDCAudience != strings.TrimSpace(c.OIDCAudience) || (c.OIDCIssuerURL != "" && strings.TrimSpace(c.OIDCAudience) == "") {
		return fmt.Errorf("OIDC_AUDIENCE: must be the audience tokens carry, without surrounding white space, got %q", c.OIDCAudience)
	}
	if c.OIDCIssuerURL != "" {
		if !httpURL(c.OIDCIssuerURL) {
			return fmt.Errorf("OIDC_ISSUER_URL: must be the issuer's http(s) URL, such as https://issuer.example.com, got %q", c.OIDCIssuerURL)
		}
	}
	if c.AuthCacheTTL <= 0 || c.AuthCacheTTL > time.Second {
		return fmt.Errorf("AUTH_CACHE_TTL: must be more than 0 and at most 1s (a revoked key must be refused within a second), got %s", c.AuthCacheTTL)
	}
	if c.RateLimit < 0 || math.IsNaN(c.RateLimit) || math.IsInf(c.RateLimit, 0) || c.RateBurst < 1 {
		return fmt.Errorf("API_RATE_LIMIT and API_RATE_BURST: the limit must be a finite number, not negative, and the burst at least 1, got %v and %d", c.RateLimit, c.RateBurst)
	}
	if c.AuthFailureLimit < 0 || math.IsNaN(c.AuthFailureLimit) || math.IsInf(c.AuthFailureLimit, 0) || (c.AuthFailureLimit > 0 && c.AuthFailureBurst < 1) {
		return fmt.Errorf("AUTH_FAILURE_LIMIT and AUTH_FAILURE_BURST: the limit must be a finite number, not negative, and the burst of a limit at least 1, got %v and %d", c.AuthFailureLimit, c.AuthFailureBurst)
	}
	if c.AuthDisabled && !regexp.MustCompile(task.SlugPattern).MatchString(c.DevOrg) {
		return fmt.Errorf("AUTH_DEV_ORG: must be an org's slug (%s), got %q", task.SlugPattern, c.DevOrg)
	}
	if c.MaxUnservedTypes < 0 {
		return fmt.Errorf("API_ORG_MAX_UNSERVED_TYPES: must not be negative, got %d", c.MaxUnservedTypes)
	}
	if c.NotifyDebounce < 0 {
		return fmt.Errorf("OUTBOX_NOTIFY_DEBOUNCE: must not be negative, got %s", c.NotifyDebounce)
	}
	if c.StreamMax < 1 || c.StreamBuffer < 16 {
		return fmt.Errorf("STREAM_MAX and STREAM_BUFFER: must be at least 1 and 16, got %d and %d", c.StreamMax, c.StreamBuffer)
	}
	if c.StreamMaxPerOrg < 0 {
		return fmt.Errorf("STREAM_MAX_PER_ORG: must not be negative, got %d", c.StreamMaxPerOrg)
	}
	// Every stream allocates its whole buffer when it opens.
	if c.StreamBuffer > maxStreamBuffer {
		return fmt.Errorf("STREAM_BUFFER: must be at most %d, got %d", maxStreamBuffer, c.StreamBuffer)
	}
	return nil
}

// maxServerTimeout is the longest timeout PostgreSQL takes
// (statement_timeout, idle_in_transaction_session_timeout: INT_MAX
// milliseconds); a longer one fails every connection.
const maxServerTimeout = math.MaxInt32 * time.Millisecond

// saturatingSum adds durations, stopping at the largest one: a sum that
// overflowed would be negative and pass every "longer than" check.
func saturatingSum(ds ...time.Duration) time.Duration {
	var sum time.Duration
	for _, d := range ds {
		if d > math.MaxInt64-sum {
			return math.MaxInt64
		}
		sum += d
	}
	return sum
}

// maxStreamBuffer bounds STREAM_BUFFER: 512 KiB of a stream's buffer.
const maxStreamBuffer = 65536

// maxStreamHeartbeat bounds STREAM_HEARTBEAT: half the silence after which
// a client opens a stream again.
const maxStreamHeartbeat = 30 * time.Second

// validAddr checks an address to listen on: a port out of range or
// missing was found only when listening, after the database was
// connected to (and, for the API, migrated), in a message that did not
// name the variable.
func validAddr(name, addr string) error {
	if addr == "" {
		return fmt.Errorf("%s: must not be empty", name)
	}
	_, port, err := net.SplitHostPort(addr)
	if err == nil && addr != strings.TrimSpace(addr) {
		err = fmt.Errorf("surrounding white space")
	}
	if err == nil {
		_, err = net.DefaultResolver.LookupPort(context.Background(), "tcp", port)
	}
	if err != nil {
		return fmt.Errorf("%s: must be [host]:port, such as :8080 or 127.0.0.1:8080, got %q", name, addr)
	}
	return nil
}

// httpURL reports whether v is an absolute http(s) URL with a host and, if
// it names one, a port in range.
func httpURL(v string) bool {
	u, err := url.Parse(v)
	if err != nil || (u.Scheme != "https" && u.Scheme != "http") || u.Hostname() == "" {
		return false
	}
	if p := u.Port(); p != "" {
		n, err := strconv.Atoi(p)
		return err == nil && n >= 1 && n <= 65535
	}
	return true
}

func oneOf(name, v string, allowed ...string) error {
	for _, a := range allowed {
		if v == a {
			return nil
		}
	}
	return fmt.Errorf("%s: must be one of %s, got %q", name, strings.Join(allowed, ", "), v)
}

func positive(name string, d time.Duration) error {
	if d <= 0 {
		return fmt.Errorf("%s: must be a positive duration, got %s", name, d)
	}
	return nil
}

// validAMQPURL checks AMQP_URL: one AMQP URL or a comma-separated list.
func validAMQPURL(list string) error {
	if list == "" {
		return fmt.Errorf("AMQP_URL: must not be empty")
	}
	urls, err := rabbitmq.ParseURLs(list)
	if err != nil {
		return fmt.Errorf("AMQP_URL: %w", err)
	}
	// The AMQP parser takes any number for a port: one out of range
	// failed every dial, and the relays and workers retried for ever.
	for i, u := range urls {
		if uri, err := amqp.ParseURI(u); err == nil && (uri.Port < 1 || uri.Port > 65535) {
			return fmt.Errorf("AMQP_URL: URL %d of %d: port %d out of range (1-65535)", i+1, len(urls), uri.Port)
		}
	}
	return nil
}
