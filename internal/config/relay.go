package config

import (
	"fmt"
	"time"
)

// Relay configures cmd/relay.
type Relay struct {
	Common
	// AMQPURL is one AMQP URL, or those of a cluster's nodes separated by
	// commas: each connection tries them in turn, each time starting from
	// the next one.
	AMQPURL   string `envconfig:"AMQP_URL" default:"amqp://guest:guest@localhost:5672/"`
	AdminAddr string `envconfig:"RELAY_ADMIN_ADDR" default:":8081"`
	// BatchSize is the most rows one transaction locks and publishes.
	BatchSize int `envconfig:"RELAY_BATCH_SIZE" default:"500"`
	// TasksPerMessage is the most tasks of one type and priority the relay
	// packs into one message; 1 packs none. Workers read it too.
	TasksPerMessage int `envconfig:"AMQP_TASKS_PER_MESSAGE" default:"64"`
	// Lanes is how many batches the relay keeps in flight at once, each on
	// its own broker connection: while one lane waits for its confirms,
	// the next locks and publishes the following batch.
	Lanes int `envconfig:"RELAY_LANES" default:"2"`
	// PollInterval is the fallback when no NOTIFY arrives.
	PollInterval time.Duration `envconfig:"RELAY_POLL_INTERVAL" default:"1s"`
	// ConfirmTimeout bounds the wait for a batch's publisher confirms.
	ConfirmTimeout time.Duration `envconfig:"RELAY_CONFIRM_TIMEOUT" default:"10s"`
	// RetryBackoffBase and RetryBackoffMax space the tries of a row whose
	// publication failed: base doubled per attempt, capped.
	RetryBackoffBase time.Duration `envconfig:"RELAY_RETRY_BACKOFF_BASE" default:"1s"`
	RetryBackoffMax  time.Duration `envconfig:"RELAY_RETRY_BACKOFF_MAX" default:"1m"`
	// ReconnectBackoffMax caps the wait between reconnects to a lost broker
	// or database.
	ReconnectBackoffMax time.Duration `envconfig:"RELAY_RECONNECT_BACKOFF_MAX" default:"5s"`
	// StatsInterval is how often the outbox depth and age are measured.
	StatsInterval time.Duration `envconfig:"RELAY_STATS_INTERVAL" default:"5s"`
}

// Validate checks the relay's configuration.
func (c Relay) Validate() error {
	if err := c.Common.Validate(); err != nil {
		return err
	}
	if err := validAMQPURL(c.AMQPURL); err != nil {
		return err
	}
	if err := validAddr("RELAY_ADMIN_ADDR", c.AdminAddr); err != nil {
		return err
	}
	if c.BatchSize < 1 || c.BatchSize > 10000 {
		return fmt.Errorf("RELAY_BATCH_SIZE: must be between 1 and 10000, got %d", c.BatchSize)
	}
	if c.Lanes < 1 || c.Lanes > 16 {
		return fmt.Errorf("RELAY_LANES: must be between 1 and 16, got %d", c.Lanes)
	}
	for name, d := range map[string]time.Duration{
		"RELAY_POLL_INTERVAL": c.PollInterval, "RELAY_CONFIRM_TIMEOUT": c.ConfirmTimeout,
		"RELAY_RETRY_BACKOFF_BASE": c.RetryBackoffBase, "RELAY_RETRY_BACKOFF_MAX": c.RetryBackoffMax,
		"RELAY_RECONNECT_BACKOFF_MAX": c.ReconnectBackoffMax, "RELAY_STATS_INTERVAL": c.StatsInterval,
	} {
		if err := positive(name, d); err != nil {
			return err
		}
	}
	if err := validTasksPerMessage(c.TasksPerMessage); err != nil {
		return err
	}
	// A pass holds its transaction open while it publishes (a socket
	// write may take up to 15 s on a blocked connection) and waits for the
	// confirms: the server must not end it meanwhile.
	if least := saturatingSum(c.ConfirmTimeout, relayPublishWrite); c.DatabaseIdleTxTimeout != 0 && c.DatabaseIdleTxTimeout <= least {
		return fmt.Errorf("DATABASE_IDLE_IN_TRANSACTION_TIMEOUT: must be longer than a relay pass may wait on the broker, "+
			"RELAY_CONFIRM_TIMEOUT + 15s (%s), got %s", least, c.DatabaseIdleTxTimeout)
	}
	return nil
}

// relayPublishWrite is the longest a publish's socket write may take (the
// broker adapter's write deadline).
const relayPublishWrite = 15 * time.Second

// validTasksPerMessage checks AMQP_TASKS_PER_MESSAGE.
func validTasksPerMessage(n int) error {
	if n < 1 || n > 1000 {
		return fmt.Errorf("AMQP_TASKS_PER_MESSAGE: must be between 1 (no packing) and 1000, got %d", n)
	}
	return nil
}
