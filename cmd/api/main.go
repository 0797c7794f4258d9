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

const usage = `usage: api [migrate | bootstrap --org SLUG [--name NAME] | healthcheck URL]

With no argument, api serves Conveyor's HTTP API, the dashboard (/ui/) and
its metrics on API_ADDR (default :8080; the metrics on API_ADMIN_ADDR
instead, when set) until SIGINT or SIGTERM.

  migrate          create the database named in DATABASE_URL if it is
                   missing, apply the migrations, and exit
  bootstrap        make the org SLUG if it is missing and print a new admin
                   key for it, alone on stdout
  healthcheck URL  exit 0 if URL answers 200 (a container's healthcheck)

Everything else is configured by environment variables (DATABASE_URL,
API_ADDR, …): see "Configuration" in README.md.
`

func main() {
	if len(os.Args) > 1 && (os.Args[1] == "migrate" || os.Args[1] == "bootstrap") {
		f, code, done := commandArgs(os.Args[1], os.Args[2:], os.Stdout, os.Stderr)
		if done {
			os.Exit(code)
		}
		if os.Args[1] == "migrate" {
			cli.Main("conveyor-migrate", migrate)
		}
		cli.Main("conveyor-bootstrap", bootstrap(f))
	}
	cli.Service("conveyor-api", usage, run)
}
