package postgres

import (
	"context"
	"errors"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/auth"
)

// TenantRole is the database role the API's org-scoped statements run as:
// row-level security limits it to the rows of the org, and the tasks, set
// for the transaction (migrations/003_orgs.sql).
const TenantRole = "conveyor_tenant"

// sqlSetScope opens a caller's transaction: the tenant role and its scope,
// all undone when the transaction ends.
var sqlSetScope = statement("scope.set", `SELECT set_config('role', '`+TenantRole+`', true),
	set_config('conveyor.org_id', $1, true), set_config('conveyor.roles', $2, true),
	set_config('conveyor.see_all', $3, true)`)

func scopeArgs(sc auth.Scope) []any {
	seeAll := "off"
	if sc.SeeAll {
		seeAll = "on"
	}
	return []any{sc.OrgID.String(), strings.Join(sc.Roles, ","), seeAll}
}

// inScope runs fn in a transaction of the caller's scope.
func inScope(ctx context.Context, pool *pgxpool.Pool, sc auth.Scope, fn func(pgx.Tx) error) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlSetScope, scopeArgs(sc)...); err != nil {
			return err
		}
		return fn(tx)
	})
}

// scopedRow runs one statement in the caller's scope, in one round trip:
// the scope and the statement are pipelined, and run in the one implicit
// transaction a pipeline is.
func scopedRow(ctx context.Context, pool *pgxpool.Pool, sc auth.Scope, sql string, args ...any) pgx.Row {
	b := &pgx.Batch{}
	b.Queue(sqlSetScope, scopeArgs(sc)...)
	b.Queue(sql, args...)
	return batchRow{pool.SendBatch(ctx, b)}
}

type batchRow struct{ br pgx.BatchResults }

func (r batchRow) Scan(dest ...any) error {
	_, err := r.br.Exec()
	if err == nil {
		err = r.br.QueryRow().Scan(dest...)
	}
	return errors.Join(err, r.br.Close())
}

// scopedRows runs one query in the caller's scope, in one round trip, and
// collects its rows with fn.
func scopedRows[T any](ctx context.Context, pool *pgxpool.Pool, sc auth.Scope, fn pgx.RowToFunc[T], sql string, args ...any) ([]T, error) {
	b := &pgx.Batch{}
	b.Queue(sqlSetScope, scopeArgs(sc)...)
	b.Queue(sql, args...)
	br := pool.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		return nil, errors.Join(err, br.Close())
	}
	rows, err := br.Query()
	if err != nil {
		return nil, errors.Join(err, br.Close())
	}
	out, err := pgx.CollectRows(rows, fn)
	return out, errors.Join(err, br.Close())
}
