package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
)

// An expiry the API could never write back in JSON (a year past 9999 once
// in UTC or the server's zone) is refused, instead of making a key whose
// answer, secret and all, is lost and whose org's key listing breaks.
func TestKeyExpiryPastWhatJSONCanWriteIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, at := range []string{"9999-12-31T23:59:59-01:00", "9999-12-31T23:59:59Z"} {
		resp := b.post(t, "/v1/keys", `{"name":"forever","role":"reader","expires_at":"`+at+`"}`)
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s: %s", at, resp.body)
		require.Equal(t, "expires_at", resp.json(t)["field"], string(resp.body))
	}
	far := b.post(t, "/v1/keys", `{"name":"far","role":"reader","expires_at":"9000-01-01T00:00:00+14:00"}`)
	require.Equal(t, http.StatusCreated, far.status, string(far.body))
	require.NotEmpty(t, far.json(t)["secret"])

	list := b.get(t, "/v1/keys")
	require.Equal(t, http.StatusOK, list.status)
	var keys struct {
		Keys []map[string]any `json:"keys"`
	}
	require.NoError(t, json.Unmarshal(list.body, &keys), "the listing is JSON: %q", list.body)
	require.Len(t, keys.Keys, 2, "the admin key and far")
}

// A user's external_id is matched as the identity provider sends its
// subject: one that is blank, or has white space at either end, names a
// user no sign-in could ever find, and is refused rather than made.
func TestAUserSubjectNoSignInCouldMatchIsRefused(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for _, sub := range []string{"   ", " auth0|123", "auth0|123\t", "\n"} {
		body, err := json.Marshal(map[string]string{"external_id": sub, "role": "reader"})
		require.NoError(t, err)
		resp := b.post(t, "/v1/users", string(body))
		require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%q: %s", sub, resp.body)
		require.Equal(t, "external_id", resp.json(t)["field"], string(resp.body))
	}
	require.Zero(t, b.rowCount(t, "users", "true"), "nothing written")
	made := b.post(t, "/v1/users", `{"external_id":"auth0|123 456","role":"reader"}`)
	require.Equal(t, http.StatusCreated, made.status, "white space inside a subject is the provider's: %s", made.body)
}

// No change through the API leaves an org without an admin (an admin user,
// or an admin key neither revoked nor expired): it could then make no
// key, user or role again without the database's credentials.
func TestTheLastAdminCannotBeTakenAway(t *testing.T) {
	t.Parallel()
	b := setup(t)
	var keys struct {
		Keys []struct {
			ID string `json:"id"`
		} `json:"keys"`
	}
	require.NoError(t, json.Unmarshal(b.get(t, "/v1/keys").body, &keys))
	require.Len(t, keys.Keys, 1)
	own := keys.Keys[0].ID

	lastRefused := func(resp response) {
		t.Helper()
		require.Equal(t, http.StatusConflict, resp.status, string(resp.body))
		require.Contains(t, resp.json(t)["detail"], "without an admin")
	}
	lastRefused(b.do(t, http.MethodDelete, "/v1/keys/"+own, "", ""))
	require.Equal(t, http.StatusOK, b.get(t, "/v1/whoami").status, "the key was not revoked")

	user := b.post(t, "/v1/users", `{"external_id":"last-admin|1","role":"admin"}`)
	require.Equal(t, http.StatusCreated, user.status, string(user.body))
	userID := user.json(t)["id"].(string)
	demote := func(role string) response {
		return b.do(t, http.MethodPatch, "/v1/users/"+userID, "application/json", `{"role":"`+role+`"}`)
	}
	require.Equal(t, http.StatusOK, demote("reader").status, "the key is an admin still")
	require.Equal(t, http.StatusOK, demote("admin").status)

	second := b.post(t, "/v1/keys", `{"name":"second","role":"admin"}`)
	require.Equal(t, http.StatusCreated, second.status, string(second.body))
	b.token = second.json(t)["secret"].(string)
	secondID := second.json(t)["id"].(string)
	require.Equal(t, http.StatusOK, b.do(t, http.MethodDelete, "/v1/keys/"+own, "", "").status, "the user and second are admins")
	require.Equal(t, http.StatusNoContent, b.do(t, http.MethodDelete, "/v1/users/"+userID, "", "").status, "second is one")

	// An admin key that expired is no admin.
	expired := b.post(t, "/v1/keys", `{"name":"expired","role":"admin"}`)
	require.Equal(t, http.StatusCreated, expired.status, string(expired.body))
	_, err := b.db.Pool.Exec(t.Context(), `UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE id = $1`,
		expired.json(t)["id"])
	require.NoError(t, err)
	lastRefused(b.do(t, http.MethodDelete, "/v1/keys/"+secondID, "", ""))

	reader := b.post(t, "/v1/keys", `{"name":"reader","role":"reader"}`)
	require.Equal(t, http.StatusCreated, reader.status, string(reader.body))
	require.Equal(t, http.StatusOK, b.do(t, http.MethodDelete, "/v1/keys/"+reader.json(t)["id"].(string), "", "").status,
		"a key that is no admin is revoked as before")
	other := b.post(t, "/v1/users", `{"external_id":"last-admin|2","role":"writer"}`)
	require.Equal(t, http.StatusCreated, other.status, string(other.body))
	require.Equal(t, http.StatusNoContent, b.do(t, http.MethodDelete, "/v1/users/"+other.json(t)["id"].(string), "", "").status)
}

// Two admin keys revoking each other at once leave one of them: the
// second change to commit sees the first.
func TestAdminKeysRevokingEachOtherLeaveOne(t *testing.T) {
	t.Parallel()
	b := setup(t)
	for round := range 10 {
		tokens, ids := [2]string{}, [2]string{}
		for i := range tokens {
			k := b.post(t, "/v1/keys", fmt.Sprintf(`{"name":"pair-%d-%d","role":"admin"}`, round, i))
			require.Equal(t, http.StatusCreated, k.status, string(k.body))
			tokens[i], ids[i] = k.json(t)["secret"].(string), k.json(t)["id"].(string)
		}
		// The bundle's own key steps aside, so that the pair are the org's
		// only admins.
		_, err := b.db.Pool.Exec(t.Context(), `UPDATE api_keys SET revoked_at = now()
			WHERE role = 'admin' AND revoked_at IS NULL AND NOT (id = ANY($1::uuid[]))`, ids[:])
		require.NoError(t, err)
		var wg sync.WaitGroup
		statuses := [2]int{}
		for i := range tokens {
			wg.Go(func() {
				statuses[i] = b.do(t, http.MethodDelete, "/v1/keys/"+ids[1-i], "", "",
					"Authorization", "Bearer "+tokens[i]).status
			})
		}
		wg.Wait()
		var active int
		require.NoError(t, b.db.Pool.QueryRow(t.Context(), `SELECT count(*) FROM api_keys
			WHERE role = 'admin' AND revoked_at IS NULL`).Scan(&active))
		require.Equal(t, 1, active, "round %d: answers %v", round, statuses)
		b.token = tokens[0]
		if statuses[1] == http.StatusOK {
			b.token = tokens[1]
		}
	}
}

// A subject is a user of one org only (external_id is unique across
// orgs): the conflict says whether the user that holds it is the org's,
// which the admin can then find among its users, or another org's.
func TestAUserConflictSaysWhoseUserHoldsTheSubject(t *testing.T) {
	t.Parallel()
	b := setup(t)
	otherAdmin, _ := b.db.Key(t, "other", auth.Admin)
	made := b.do(t, http.MethodPost, "/v1/users", "application/json", `{"external_id":"shared|1","role":"reader"}`,
		"Authorization", "Bearer "+otherAdmin)
	require.Equal(t, http.StatusCreated, made.status, string(made.body))

	theirs := b.post(t, "/v1/users", `{"external_id":"shared|1","role":"reader"}`)
	require.Equal(t, http.StatusConflict, theirs.status, string(theirs.body))
	require.Contains(t, theirs.json(t)["detail"], "another org")

	require.Equal(t, http.StatusCreated, b.post(t, "/v1/users", `{"external_id":"mine|1","role":"reader"}`).status)
	ours := b.post(t, "/v1/users", `{"external_id":"mine|1","role":"reader"}`)
	require.Equal(t, http.StatusConflict, ours.status, string(ours.body))
	require.Contains(t, ours.json(t)["detail"], "the org already has")
}

// The key, user and member listings page like the task listing: limit and
// cursor in, next_cursor out, every row once across the pages; a cursor
// this API did not return, or one whose user is gone, is a 422 on cursor.
func TestAdminListingsPage(t *testing.T) {
	t.Parallel()
	b := setup(t)
	walk := func(path, field string) []string {
		t.Helper()
		var ids []string
		cursor := ""
		for range 20 {
			resp := b.get(t, path+"?limit=2&cursor="+cursor)
			require.Equal(t, http.StatusOK, resp.status, string(resp.body))
			var page struct {
				Items      []map[string]any
				NextCursor string `json:"next_cursor"`
			}
			raw := map[string]json.RawMessage{}
			require.NoError(t, json.Unmarshal(resp.body, &raw))
			require.NoError(t, json.Unmarshal(raw[field], &page.Items))
			_ = json.Unmarshal(raw["next_cursor"], &page.NextCursor)
			require.LessOrEqual(t, len(page.Items), 2, "%s: %s", path, resp.body)
			for _, it := range page.Items {
				ids = append(ids, it["id"].(string))
			}
			if page.NextCursor == "" {
				return ids
			}
			cursor = page.NextCursor
		}
		t.Fatalf("%s: no last page", path)
		return nil
	}

	for i := range 4 {
		require.Equal(t, http.StatusCreated, b.post(t, "/v1/keys", fmt.Sprintf(`{"name":"k%d","role":"reader"}`, i)).status)
	}
	keys := walk("/v1/keys", "keys")
	require.Len(t, keys, 5, "the admin key and four: %v", keys)
	require.ElementsMatch(t, keys, uniq(keys))

	require.Equal(t, http.StatusCreated, b.post(t, "/v1/roles", `{"slug":"ops"}`).status)
	var users []string
	for i := range 5 {
		u := b.post(t, "/v1/users", fmt.Sprintf(`{"external_id":"paging|%d","role":"reader"}`, i))
		require.Equal(t, http.StatusCreated, u.status, string(u.body))
		users = append(users, u.json(t)["id"].(string))
		if i < 3 {
			require.Equal(t, http.StatusNoContent, b.do(t, http.MethodPut, "/v1/roles/ops/members/"+users[i], "", "").status)
		}
	}
	require.Equal(t, users, walk("/v1/users", "users"), "oldest first, each once")
	require.Equal(t, users[:3], walk("/v1/roles/ops/members", "members"))

	first := b.get(t, "/v1/users?limit=2")
	cursor := first.json(t)["next_cursor"].(string)
	require.Equal(t, http.StatusNoContent, b.do(t, http.MethodDelete, "/v1/users/"+users[1], "", "").status)
	for _, path := range []string{"/v1/keys", "/v1/users", "/v1/roles/ops/members"} {
		for _, q := range []string{"?cursor=not-ours!", "?cursor=" + cursor, "?limit=0", "?limit=501"} {
			if q == "?cursor="+cursor && path == "/v1/keys" {
				continue
			}
			resp := b.get(t, path+q)
			require.Equal(t, http.StatusUnprocessableEntity, resp.status, "%s%s: %s", path, q, resp.body)
			want := "cursor"
			if q[1] == 'l' {
				want = "limit"
			}
			require.Equal(t, want, resp.json(t)["field"], "%s%s", path, q)
		}
	}
}

func uniq(s []string) []string {
	seen := map[string]bool{}
	var out []string
	for _, v := range s {
		if !seen[v] {
			seen[v] = true
			out = append(out, v)
		}
	}
	return out
}
