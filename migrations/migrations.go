// Package migrations holds Conveyor's numbered SQL migrations, embedded so
// every binary carries the schema it needs.
package migrations

import "embed"

// FS holds the migration files, named NNN_description.sql.
//
//go:embed *.sql
var FS embed.FS
