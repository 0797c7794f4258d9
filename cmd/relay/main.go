// Command relay publishes committed outbox rows to RabbitMQ with publisher
// confirms, then deletes them. Any number of relays may run at once.
package main

import "github.com/conveyorhq/conveyor/internal/cli"

func main() { cli.Main("conveyor-relay", run) }
