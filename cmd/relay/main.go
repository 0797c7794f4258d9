// Command relay publishes committed outbox rows to RabbitMQ with publisher
// confirms, then deletes them. Any number of relays may run at once.
package main

import "github.com/conveyorhq/conveyor/internal/cli"

const usage = `usage: relay [healthcheck URL]

With no argument, relay publishes the outbox's rows from PostgreSQL to
RabbitMQ until SIGINT or SIGTERM, and serves /healthz, /readyz and
/metrics on RELAY_ADMIN_ADDR (default :8081).

  healthcheck URL  exit 0 if URL answers 200 (a container's healthcheck)

Everything else is configured by environment variables (DATABASE_URL,
AMQP_URL, RELAY_ADMIN_ADDR, …): see "Configuration" in README.md.
`

func main() { cli.Service("conveyor-relay", usage, run) }
