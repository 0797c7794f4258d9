package postgres

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/conveyorhq/conveyor/internal/auth"
)

// The directory's statements find principals across orgs, before any org
// is known: they run as the pool's own user, never for a caller.

var sqlKeyByPrefix = statement("api_keys.by_prefix", `
SELECT k.id, k.name, k.role, o.id, o.slug, k.secret_hash, k.expires_at, k.revoked_at,
	coalesce(array(SELECT r.slug FROM api_key_roles kr JOIN org_roles r ON r.id = kr.role_id
		WHERE kr.key_id = k.id ORDER BY r.slug), '{}')
FROM api_keys k JOIN orgs o ON o.id = k.org_id
WHERE k.prefix = $1`)

var sqlUserBySubject = statement("users.by_subject", `
SELECT u.id, coalesce(u.email, u.external_id), u.role, o.id, o.slug,
	coalesce(array(SELECT r.slug FROM org_role_memberships m JOIN org_roles r ON r.id = m.role_id
		WHERE m.user_id = u.id ORDER BY r.slug), '{}')
FROM users u JOIN orgs o ON o.id = u.org_id
WHERE u.external_id = $1`)

var sqlTouchKeys = statement("api_keys.touch", `UPDATE api_keys SET last_used_at = now()
	WHERE id = ANY($1::uuid[]) AND (last_used_at IS NULL OR last_used_at < now() - interval '1 second')`)

var sqlEnsureOrg = statement("orgs.ensure", `
WITH ins AS (
	INSERT INTO orgs (slug, name) VALUES ($1, $2) ON CONFLICT (slug) DO NOTHING RETURNING id
)
SELECT id FROM ins UNION ALL SELECT id FROM orgs WHERE slug = $1`)

// Directory is the auth.Directory of the database, and what `api
// bootstrap` writes with.
type Directory struct {
	pool *pgxpool.Pool
}

// NewDirectory returns the directory over pool, whose user must not be
// limited by row-level security (the pool the migrations run on).
func NewDirectory(pool *pgxpool.Pool) *Directory { return &Directory{pool: pool} }

// KeyByPrefix returns the API key with the prefix, revoked or not.
func (d *Directory) KeyByPrefix(ctx context.Context, prefix string) (auth.Record, error) {
	var r auth.Record
	var role string
	err := d.pool.QueryRow(ctx, sqlKeyByPrefix, prefix).Scan(&r.ID, &r.Name, &role, &r.OrgID, &r.OrgSlug,
		&r.SecretHash, &r.ExpiresAt, &r.RevokedAt, &r.OrgRoles)
	if errors.Is(err, pgx.ErrNoRows) {
		return auth.Record{}, auth.ErrNotFound
	}
	r.Kind, r.Role = auth.KindKey, auth.Role(role)
	return r, err
}

// UserBySubject returns the user whose identity provider subject it is.
func (d *Directory) UserBySubject(ctx context.Context, subject string) (auth.Record, error) {
	if strings.ContainsRune(subject, 0) || !utf8.ValidString(subject) {
		// Not text PostgreSQL takes, so no user's external_id: asking
		// would fail the lookup.
		return auth.Record{}, auth.ErrNotFound
	}
	var r auth.Record
	var role string
	err := d.pool.QueryRow(ctx, sqlUserBySubject, subject).Scan(&r.ID, &r.Name, &role, &r.OrgID, &r.OrgSlug, &r.OrgRoles)
	if errors.Is(err, pgx.ErrNoRows) {
		return auth.Record{}, auth.ErrNotFound
	}
	r.Kind, r.Role = auth.KindUser, auth.Role(role)
	return r, err
}

// TouchKeys records that the keys were just used; a key written less than
// a second ago is left alone, so many instances write each key about once
// a second at most.
func (d *Directory) TouchKeys(ctx context.Context, ids []uuid.UUID) error {
	_, err := d.pool.Exec(ctx, sqlTouchKeys, ids)
	return err
}

// EnsureOrg makes the org with the slug if it is missing, and returns its
// id.
func (d *Directory) EnsureOrg(ctx context.Context, slug string) (uuid.UUID, error) {
	org, err := ensureOrg(ctx, d.pool, slug)
	return org, translate(err)
}

// ensureOrg runs sqlEnsureOrg, and again when it answers no row: its
// insert then waited for another transaction's insert of the slug, which
// committed after the statement's snapshot was taken, so its own SELECT
// cannot see that row. A second statement has a snapshot that does.
func ensureOrg(ctx context.Context, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, slug string) (uuid.UUID, error) {
	var org uuid.UUID
	err := q.QueryRow(ctx, sqlEnsureOrg, slug, slug).Scan(&org)
	if errors.Is(err, pgx.ErrNoRows) {
		err = q.QueryRow(ctx, sqlEnsureOrg, slug, slug).Scan(&org)
	}
	return org, err
}

// Bootstrap makes the org with the slug if it is missing, and a new admin
// key named name for it, whose token it returns.
func (d *Directory) Bootstrap(ctx context.Context, slug, name string) (string, error) {
	var token string
	err := pgx.BeginFunc(ctx, d.pool, func(tx pgx.Tx) error {
		org, err := ensureOrg(ctx, tx, slug)
		if err != nil {
			return fmt.Errorf("org %q: %w", slug, translate(err))
		}
		if _, err := tx.Exec(ctx, sqlSetScope, scopeArgs(auth.Scope{OrgID: org, SeeAll: true})...); err != nil {
			return err
		}
		key, err := createKey(ctx, tx, org, KeyInput{Name: name, Role: auth.Admin},
			map[string]any{"kind": "bootstrap"})
		token = key.Token
		return err
	})
	return token, err
}
