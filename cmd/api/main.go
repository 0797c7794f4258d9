// Command api serves Conveyor's HTTP API. It stores every submission with its
// first event and its outbox row in one transaction and never talks to
// RabbitMQ. `api migrate` creates the database if it is missing, applies the
// migrations and exits: the only command that creates a database. `api
// bootstrap --org SLUG` makes the org if it is missing and prints a new
// admin key for it.
package main

import (
	"os"

	"github.com/conveyorhq/conveyor/internal/cli"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "migrate" {
		cli.Main("conveyor-migrate", migrate)
	}
	if len(os.Args) > 1 && os.Args[1] == "bootstrap" {
		cli.Main("conveyor-bootstrap", bootstrap)
	}
	cli.Main("conveyor-api", run)
}
