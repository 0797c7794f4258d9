package testdb

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/postgres"
	"github.com/conveyorhq/conveyor/internal/task"
)

// Key makes an API key in the org with the slug (making the org, and the
// org roles, when missing) and returns its token and the principal it
// authenticates as.
func (db *DB) Key(t testing.TB, org string, role auth.Role, orgRoles ...string) (string, auth.Principal) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := postgres.NewDirectory(db.Pool)
	orgID, err := dir.EnsureOrg(ctx, org)
	if err != nil {
		t.Fatalf("testdb: org %s: %v", org, err)
	}
	admin := auth.Principal{Kind: auth.KindDev, Name: "testdb", OrgID: orgID, OrgSlug: org, Role: auth.Admin}
	store := postgres.NewAPIStore(db.Pool, nil)
	for _, r := range orgRoles {
		if _, err := store.CreateRole(ctx, admin, r, r); err != nil && task.ErrorCode(err) != task.ErrCodeConflict {
			t.Fatalf("testdb: role %s: %v", r, err)
		}
	}
	name := "test-" + string(role)
	if len(orgRoles) > 0 {
		name += "-" + strings.Join(orgRoles, "-")
	}
	k, token, err := store.CreateKey(ctx, admin, auth.KeyInput{Name: name, Role: role, OrgRoles: orgRoles})
	if err != nil {
		t.Fatalf("testdb: key: %v", err)
	}
	rec, err := dir.KeyByPrefix(ctx, k.Prefix)
	if err != nil {
		t.Fatalf("testdb: read key back: %v", err)
	}
	return token, rec.Principal
}

// Admin is Key for an admin of the org "test".
func (db *DB) Admin(t testing.TB) (string, auth.Principal) {
	t.Helper()
	return db.Key(t, "test", auth.Admin)
}

// Org returns the id of the org with the slug, making it when missing: for
// tests that write task rows themselves.
func (db *DB) Org(t testing.TB, slug string) uuid.UUID {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	id, err := postgres.NewDirectory(db.Pool).EnsureOrg(ctx, slug)
	if err != nil {
		t.Fatalf("testdb: org %s: %v", slug, err)
	}
	return id
}
