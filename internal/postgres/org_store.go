package postgres

import (
	"context"
	"errors"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/task"
)

// The admin API's statements: an org's keys, users, roles and memberships.
// Each runs in the caller's scope and names the caller's org besides, so
// both the statement and row-level security keep it inside the org.

const keyColumns = `k.id, k.name, k.role, k.prefix,
	coalesce(array(SELECT r.slug FROM api_key_roles kr JOIN org_roles r ON r.id = kr.role_id
		WHERE kr.key_id = k.id ORDER BY r.slug), '{}'),
	k.created_by, k.created_at, k.expires_at, k.last_used_at, k.revoked_at`

const userColumns = `u.id, u.external_id, coalesce(u.email, ''), u.role,
	coalesce(array(SELECT r.slug FROM org_role_memberships m JOIN org_roles r ON r.id = m.role_id
		WHERE m.user_id = u.id ORDER BY r.slug), '{}'),
	u.created_at`

// sqlRoleIDs maps role slugs to ids; a slug the org lacks has no row.
var sqlRoleIDs = statement("org_roles.ids", `SELECT slug, id FROM org_roles WHERE org_id = $1 AND slug = ANY($2::text[])`)

var sqlKeyInsert = statement("api_keys.insert", `
WITH k AS (
	INSERT INTO api_keys (org_id, name, role, prefix, secret_hash, created_by, expires_at)
	VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING *
), roles AS (
	INSERT INTO api_key_roles (key_id, role_id, org_id) SELECT k.id, unnest($8::uuid[]), $1 FROM k
)
SELECT k.id, k.name, k.role, k.prefix, $9::text[], k.created_by, k.created_at, k.expires_at, k.last_used_at,
	k.revoked_at
FROM k`)

// sqlKeysList is a page of the org's keys, newest first, after the key $2
// (none: from the newest). Keys have random ids, so the page goes on from
// the cursor key's place in (created_at, id) order.
var sqlKeysList = statement("api_keys.list", `SELECT `+keyColumns+` FROM api_keys k WHERE k.org_id = $1
	AND ($2::uuid IS NULL OR (k.created_at, k.id) < (SELECT c.created_at, c.id FROM api_keys c WHERE c.org_id = $1 AND c.id = $2))
	ORDER BY k.created_at DESC, k.id DESC LIMIT $3`)

// sqlKeyRevoke revokes a key and answers it as it now stands: the row the
// update returns, or, when the key was revoked before, the row as it is (a
// data-modifying WITH is not seen by the rest of its statement).
var sqlKeyRevoke = statement("api_keys.revoke", `
WITH upd AS (
	UPDATE api_keys SET revoked_at = now() WHERE org_id = $1 AND id = $2 AND revoked_at IS NULL RETURNING *
)
SELECT `+keyColumns+` FROM (
	SELECT * FROM upd
	UNION ALL
	SELECT * FROM api_keys WHERE org_id = $1 AND id = $2 AND NOT EXISTS (SELECT 1 FROM upd)
) k`)

var sqlUserInsert = statement("users.insert", `
WITH u AS (
	INSERT INTO users (org_id, external_id, email, role) VALUES ($1, $2, nullif($3, ''), $4) RETURNING *
)
SELECT u.id, u.external_id, coalesce(u.email, ''), u.role, '{}'::text[], u.created_at FROM u`)

var sqlUserOfSubject = statement("users.of_subject", `SELECT EXISTS (SELECT 1 FROM users WHERE org_id = $1 AND external_id = $2)`)

// sqlUsersList is a page of the org's users, oldest first, after the user
// whose created_at and id are $2 and $3 (none: from the oldest).
var sqlUsersList = statement("users.list", `SELECT `+userColumns+` FROM users u WHERE u.org_id = $1
	AND ($3::uuid IS NULL OR (u.created_at, u.id) > ($2, $3))
	ORDER BY u.created_at, u.id LIMIT $4`)

// sqlUserCreated is when a user was made: a page of users goes on from the
// place of the last user of the page before.
var sqlUserCreated = statement("users.created", `SELECT created_at FROM users WHERE org_id = $1 AND id = $2`)

var sqlUserGet = statement("users.get", `SELECT `+userColumns+` FROM users u WHERE u.org_id = $1 AND u.id = $2`)

var sqlUserSetRole = statement("users.set_role", `UPDATE users SET role = $3 WHERE org_id = $1 AND id = $2`)

var sqlUserDelete = statement("users.delete", `DELETE FROM users WHERE org_id = $1 AND id = $2`)

var sqlRoleInsert = statement("org_roles.insert", `INSERT INTO org_roles (org_id, slug, name) VALUES ($1, $2, $3)
	RETURNING id, slug, name, created_at`)

var sqlRolesList = statement("org_roles.list", `SELECT id, slug, name, created_at FROM org_roles WHERE org_id = $1
	ORDER BY slug`)

var sqlRoleDelete = statement("org_roles.delete", `DELETE FROM org_roles WHERE org_id = $1 AND slug = $2`)

var sqlMemberAdd = statement("org_role_memberships.add", `
INSERT INTO org_role_memberships (role_id, user_id, org_id)
SELECT r.id, u.id, $1 FROM org_roles r, users u
WHERE r.org_id = $1 AND r.slug = $2 AND u.org_id = $1 AND u.id = $3
ON CONFLICT DO NOTHING`)

var sqlMemberRemove = statement("org_role_memberships.remove", `
DELETE FROM org_role_memberships m USING org_roles r
WHERE m.org_id = $1 AND r.id = m.role_id AND r.org_id = $1 AND r.slug = $2 AND m.user_id = $3`)

var sqlMembersList = statement("org_role_memberships.list", `SELECT `+userColumns+`
FROM users u JOIN org_role_memberships m ON m.user_id = u.id JOIN org_roles r ON r.id = m.role_id
WHERE u.org_id = $1 AND r.org_id = $1 AND r.slug = $2
	AND ($4::uuid IS NULL OR (u.created_at, u.id) > ($3, $4))
ORDER BY u.created_at, u.id LIMIT $5`)

// sqlAdminsLock serialises, per org, the changes that may take away an
// admin, so that two of them (each key revoking the other) cannot both see
// the other's admin left and leave none. The two-key form keeps it apart
// from the adapter's other advisory locks.
var sqlAdminsLock = statement("orgs.admins_lock", `SELECT pg_advisory_xact_lock(1668247155, hashtext($1::uuid::text))`)

// sqlHasAdmin: an admin user, or an admin key that still works.
var sqlHasAdmin = statement("orgs.has_admin", `SELECT
	EXISTS (SELECT 1 FROM api_keys WHERE org_id = $1 AND role = 'admin' AND revoked_at IS NULL
		AND (expires_at IS NULL OR expires_at > now()))
	OR EXISTS (SELECT 1 FROM users WHERE org_id = $1 AND role = 'admin')`)

var sqlRoleExists = statement("org_roles.exists", `SELECT EXISTS (SELECT 1 FROM org_roles WHERE org_id = $1 AND slug = $2)`)

// KeyInput is what a new key is made of.
type KeyInput = auth.KeyInput

// CreateKey makes an API key in the principal's org and returns it with
// its token, which is stored nowhere.
func (s *APIStore) CreateKey(ctx context.Context, p auth.Principal, in auth.KeyInput) (auth.Key, string, error) {
	var key createdKey
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		var err error
		key, err = createKey(ctx, tx, p.OrgID, in, p.Actor())
		return err
	})
	if pgCode(err) == "23503" {
		// A role it names was deleted while the key was written.
		return auth.Key{}, "", task.Invalid("org_roles", "a role it names was deleted meanwhile")
	}
	return key.Key, key.Token, translate(err)
}

type createdKey struct {
	auth.Key
	Token string
}

func createKey(ctx context.Context, tx pgx.Tx, org uuid.UUID, in auth.KeyInput, by any) (createdKey, error) {
	roleIDs, err := roleIDs(ctx, tx, org, in.OrgRoles)
	if err != nil {
		return createdKey{}, err
	}
	nk := auth.GenerateKey()
	k, err := scanKey(tx.QueryRow(ctx, sqlKeyInsert, org, in.Name, string(in.Role), nk.Prefix, nk.Hash, by,
		in.ExpiresAt, roleIDs, in.OrgRoles))
	return createdKey{Key: k, Token: nk.Token}, err
}

// roleIDs returns the ids of the org's roles named by slugs, or an error
// naming one it lacks.
func roleIDs(ctx context.Context, tx pgx.Tx, org uuid.UUID, slugs []string) ([]uuid.UUID, error) {
	if len(slugs) == 0 {
		return []uuid.UUID{}, nil
	}
	rows, err := tx.Query(ctx, sqlRoleIDs, org, slugs)
	if err != nil {
		return nil, err
	}
	ids := map[string]uuid.UUID{}
	var slug string
	var id uuid.UUID
	if _, err := pgx.ForEachRow(rows, []any{&slug, &id}, func() error { ids[slug] = id; return nil }); err != nil {
		return nil, err
	}
	out := make([]uuid.UUID, 0, len(slugs))
	for _, s := range slugs {
		id, ok := ids[s]
		if !ok {
			return nil, task.Invalid("org_roles", "the org has no role %q", s)
		}
		out = append(out, id)
	}
	return out, nil
}

// ListKeys lists the org's keys, revoked ones included, newest first: at
// most limit, those after the key after (uuid.Nil: from the newest).
func (s *APIStore) ListKeys(ctx context.Context, p auth.Principal, after uuid.UUID, limit int) ([]auth.Key, error) {
	var keys []auth.Key
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		if err := cursorRow(ctx, tx, sqlKeyExists, p.OrgID, after, "key"); err != nil {
			return err
		}
		rows, err := tx.Query(ctx, sqlKeysList, p.OrgID, nilUUID(after), limit)
		if err != nil {
			return err
		}
		keys, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (auth.Key, error) { return scanKey(row) })
		return err
	})
	return keys, translate(err)
}

var sqlKeyExists = statement("api_keys.exists", `SELECT EXISTS (SELECT 1 FROM api_keys WHERE org_id = $1 AND id = $2)`)

// cursorRow refuses a cursor whose row is gone (or never was the org's):
// the page would otherwise come back empty, and the listing look complete.
func cursorRow(ctx context.Context, tx pgx.Tx, sql string, org, after uuid.UUID, what string) error {
	if after == uuid.Nil {
		return nil
	}
	var ok bool
	if err := tx.QueryRow(ctx, sql, org, after).Scan(&ok); err != nil {
		return err
	}
	if !ok {
		return task.Invalid("cursor", "names a %s that no longer exists: list again from the first page", what)
	}
	return nil
}

// userCursor is the place, in (created_at, id) order, of the user after
// (uuid.Nil: before the first).
func userCursor(ctx context.Context, tx pgx.Tx, org, after uuid.UUID) (*time.Time, *uuid.UUID, error) {
	if after == uuid.Nil {
		return nil, nil, nil
	}
	var at time.Time
	err := tx.QueryRow(ctx, sqlUserCreated, org, after).Scan(&at)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, nil, task.Invalid("cursor", "names a user that no longer exists: list again from the first page")
	}
	if err != nil {
		return nil, nil, err
	}
	return &at, &after, nil
}

func nilUUID(id uuid.UUID) *uuid.UUID {
	if id == uuid.Nil {
		return nil
	}
	return &id
}

// RevokeKey revokes a key of the org; revoking a revoked key changes
// nothing.
func (s *APIStore) RevokeKey(ctx context.Context, p auth.Principal, id uuid.UUID) (auth.Key, error) {
	var k auth.Key
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		return keepAnAdmin(ctx, tx, p.OrgID, func() error {
			var err error
			k, err = scanKey(tx.QueryRow(ctx, sqlKeyRevoke, p.OrgID, id))
			return notFound(translate(err), "key")
		})
	})
	return k, translate(err)
}

// keepAnAdmin runs change, which may take an admin away from the org, and
// refuses it if it took the last one: an org without an admin can no
// longer make keys, users or roles, and only `api bootstrap`, with the
// database's credentials, gives it one again. An org that had no admin
// before (AUTH_DISABLED's) is let be.
func keepAnAdmin(ctx context.Context, tx pgx.Tx, org uuid.UUID, change func() error) error {
	if _, err := tx.Exec(ctx, sqlAdminsLock, org); err != nil {
		return err
	}
	var before, after bool
	if err := tx.QueryRow(ctx, sqlHasAdmin, org).Scan(&before); err != nil {
		return err
	}
	if err := change(); err != nil {
		return err
	}
	if err := tx.QueryRow(ctx, sqlHasAdmin, org).Scan(&after); err != nil {
		return err
	}
	if before && !after {
		return task.Errorf(task.ErrCodeConflict,
			"this would leave the org without an admin: make another admin key or user first")
	}
	return nil
}

func scanKey(row pgx.Row) (auth.Key, error) {
	var k auth.Key
	var role string
	err := row.Scan(&k.ID, &k.Name, &role, &k.Prefix, &k.OrgRoles, &k.CreatedBy, &k.CreatedAt, &k.ExpiresAt,
		&k.LastUsedAt, &k.RevokedAt)
	k.Role = auth.Role(role)
	return k, err
}

// CreateUser adds a user to the org.
func (s *APIStore) CreateUser(ctx context.Context, p auth.Principal, in auth.UserInput) (auth.User, error) {
	u, err := scanUser(scopedRow(ctx, s.pool, p.Scope(), sqlUserInsert, p.OrgID, in.ExternalID, in.Email, string(in.Role)))
	if task.ErrorCode(translate(err)) != task.ErrCodeConflict {
		return u, translate(err)
	}
	// The subject is unique across orgs, so the user that holds it may be
	// one the caller cannot list: say which, or the admin looks for it in
	// vain among the org's users.
	var ours bool
	if err := scopedRow(ctx, s.pool, p.Scope(), sqlUserOfSubject, p.OrgID, in.ExternalID).Scan(&ours); err != nil {
		return auth.User{}, translate(err)
	}
	if ours {
		return auth.User{}, task.Errorf(task.ErrCodeConflict, "the org already has a user with external_id %q", in.ExternalID)
	}
	return auth.User{}, task.Errorf(task.ErrCodeConflict,
		"external_id %q is a user of another org: a subject of the identity provider can be a user of one org only", in.ExternalID)
}

// ListUsers lists the org's users, oldest first: at most limit, those
// after the user after (uuid.Nil: from the oldest).
func (s *APIStore) ListUsers(ctx context.Context, p auth.Principal, after uuid.UUID, limit int) ([]auth.User, error) {
	var users []auth.User
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		at, id, err := userCursor(ctx, tx, p.OrgID, after)
		if err != nil {
			return err
		}
		rows, err := tx.Query(ctx, sqlUsersList, p.OrgID, at, id, limit)
		if err != nil {
			return err
		}
		users, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (auth.User, error) { return scanUser(row) })
		return err
	})
	return users, translate(err)
}

// SetUserRole changes a user's role.
func (s *APIStore) SetUserRole(ctx context.Context, p auth.Principal, id uuid.UUID, role auth.Role) (auth.User, error) {
	var u auth.User
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		return keepAnAdmin(ctx, tx, p.OrgID, func() error {
			if _, err := tx.Exec(ctx, sqlUserSetRole, p.OrgID, id, string(role)); err != nil {
				return err
			}
			var err error
			u, err = scanUser(tx.QueryRow(ctx, sqlUserGet, p.OrgID, id))
			return err
		})
	})
	return u, notFound(translate(err), "user")
}

// DeleteUser removes a user and their memberships.
func (s *APIStore) DeleteUser(ctx context.Context, p auth.Principal, id uuid.UUID) error {
	return translate(inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		return keepAnAdmin(ctx, tx, p.OrgID, func() error {
			tag, err := tx.Exec(ctx, sqlUserDelete, p.OrgID, id)
			if err == nil && tag.RowsAffected() == 0 {
				err = task.Errorf(task.ErrCodeNotFound, "user not found")
			}
			return err
		})
	}))
}

func scanUser(row pgx.Row) (auth.User, error) {
	var u auth.User
	var role string
	err := row.Scan(&u.ID, &u.ExternalID, &u.Email, &role, &u.OrgRoles, &u.CreatedAt)
	u.Role = auth.Role(role)
	return u, err
}

// CreateRole defines an org role.
func (s *APIStore) CreateRole(ctx context.Context, p auth.Principal, slug, name string) (auth.OrgRole, error) {
	var r auth.OrgRole
	err := scopedRow(ctx, s.pool, p.Scope(), sqlRoleInsert, p.OrgID, slug, name).Scan(&r.ID, &r.Slug, &r.Name, &r.CreatedAt)
	if task.ErrorCode(translate(err)) == task.ErrCodeConflict {
		return auth.OrgRole{}, task.Errorf(task.ErrCodeConflict, "the org already has a role %q", slug)
	}
	return r, translate(err)
}

// ListRoles lists the org's roles by slug.
func (s *APIStore) ListRoles(ctx context.Context, p auth.Principal) ([]auth.OrgRole, error) {
	roles, err := scopedRows(ctx, s.pool, p.Scope(), func(row pgx.CollectableRow) (auth.OrgRole, error) {
		var r auth.OrgRole
		err := row.Scan(&r.ID, &r.Slug, &r.Name, &r.CreatedAt)
		return r, err
	}, sqlRolesList, p.OrgID)
	return roles, translate(err)
}

// DeleteRole removes an org role and its memberships. Tasks that name it
// keep it in their visibility: only admins see them until the role is
// made again.
func (s *APIStore) DeleteRole(ctx context.Context, p auth.Principal, slug string) error {
	return s.deleteOne(ctx, p, "role", sqlRoleDelete, p.OrgID, slug)
}

// AddMember makes a user a member of a role; a member stays one.
func (s *APIStore) AddMember(ctx context.Context, p auth.Principal, slug string, user uuid.UUID) error {
	return s.member(ctx, p, sqlMemberAdd, slug, user)
}

// RemoveMember ends a membership; a non-member stays one.
func (s *APIStore) RemoveMember(ctx context.Context, p auth.Principal, slug string, user uuid.UUID) error {
	return s.member(ctx, p, sqlMemberRemove, slug, user)
}

// member runs a membership change after checking that both the role and
// the user are the org's: either missing is a 404.
func (s *APIStore) member(ctx context.Context, p auth.Principal, sql, slug string, user uuid.UUID) error {
	return translate(inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		if _, err := scanUser(tx.QueryRow(ctx, sqlUserGet, p.OrgID, user)); err != nil {
			return notFound(translate(err), "user")
		}
		if err := roleExists(ctx, tx, p.OrgID, slug); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, sql, p.OrgID, slug, user)
		return err
	}))
}

// ListMembers lists the users of a role, oldest first: at most limit,
// those after the user after (uuid.Nil: from the oldest).
func (s *APIStore) ListMembers(ctx context.Context, p auth.Principal, slug string, after uuid.UUID, limit int) ([]auth.User, error) {
	var users []auth.User
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		if err := roleExists(ctx, tx, p.OrgID, slug); err != nil {
			return err
		}
		at, id, err := userCursor(ctx, tx, p.OrgID, after)
		if err != nil {
			return err
		}
		rows, err := tx.Query(ctx, sqlMembersList, p.OrgID, slug, at, id, limit)
		if err != nil {
			return err
		}
		users, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (auth.User, error) { return scanUser(row) })
		return err
	})
	return users, translate(err)
}

func roleExists(ctx context.Context, tx pgx.Tx, org uuid.UUID, slug string) error {
	var ok bool
	if err := tx.QueryRow(ctx, sqlRoleExists, org, slug).Scan(&ok); err != nil {
		return err
	}
	if !ok {
		return task.Errorf(task.ErrCodeNotFound, "role %q not found", slug)
	}
	return nil
}

func (s *APIStore) deleteOne(ctx context.Context, p auth.Principal, what, sql string, args ...any) error {
	var n int64
	err := inScope(ctx, s.pool, p.Scope(), func(tx pgx.Tx) error {
		tag, err := tx.Exec(ctx, sql, args...)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return translate(err)
	}
	if n == 0 {
		return task.Errorf(task.ErrCodeNotFound, "%s not found", what)
	}
	return nil
}

// missing is the not-found error of the job or workflow (kind) named name;
// a name no job or workflow could have is one too.
func missing(kind, name string) error {
	return task.Errorf(task.ErrCodeNotFound, "%s %q not found", kind, name)
}

// notFound names what was not found in a task.ErrNotFound.
func notFound(err error, what string) error {
	if errors.Is(err, task.ErrNotFound) {
		return task.Errorf(task.ErrCodeNotFound, "%s not found", what)
	}
	return err
}
