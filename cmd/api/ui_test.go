package main

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/config"
	"github.com/conveyorhq/conveyor/internal/httpapi"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// The dashboard's session: a pasted key becomes an HttpOnly cookie the API
// takes in place of the Authorization header, and a changing request
// authenticated by it must carry the dashboard's header (no other site's
// page can add one).

func TestDashboardSession(t *testing.T) {
	t.Parallel()
	b := setup(t)

	page := b.do(t, http.MethodGet, "/ui/tasks", "", "", "Authorization", "")
	require.Equal(t, http.StatusOK, page.status)
	require.Contains(t, string(page.body), "/ui/static/app.js")
	require.Contains(t, page.header.Get("Content-Security-Policy"), "default-src 'self'")
	js := b.do(t, http.MethodGet, "/ui/static/app.js", "", "", "Authorization", "")
	require.Equal(t, http.StatusOK, js.status)

	signIn := func(key string, header ...string) response {
		return b.do(t, http.MethodPost, "/ui/session", "application/json", `{"key":"`+key+`"}`,
			append([]string{"Authorization", ""}, header...)...)
	}
	require.Equal(t, http.StatusForbidden, signIn(b.token).status, "no sign-in without the dashboard's header")
	require.Equal(t, http.StatusUnauthorized, signIn("cvk_nope", httpapi.UIHeader, "1").status)
	ok := signIn(b.token, httpapi.UIHeader, "1")
	require.Equal(t, http.StatusOK, ok.status, string(ok.body))
	cookie := ok.header.Get("Set-Cookie")
	require.Contains(t, cookie, httpapi.SessionCookie+"=")
	require.Contains(t, cookie, "HttpOnly")
	require.Contains(t, cookie, "SameSite=Strict")
	session := strings.SplitN(cookie, ";", 2)[0]

	// The cookie reads; it changes only with the header.
	require.Equal(t, http.StatusOK, b.do(t, http.MethodGet, "/v1/whoami", "", "", "Authorization", "", "Cookie", session).status)
	submit := `{"type":"ui.session","payload":{}}`
	forged := b.do(t, http.MethodPost, "/v1/tasks", "application/json", submit, "Authorization", "", "Cookie", session)
	require.Equal(t, http.StatusForbidden, forged.status, string(forged.body))
	require.Equal(t, http.StatusCreated,
		b.do(t, http.MethodPost, "/v1/tasks", "application/json", submit, "Authorization", "", "Cookie", session, httpapi.UIHeader, "1").status)

	out := b.do(t, http.MethodPost, "/ui/logout", "", "", "Authorization", "", "Cookie", session, httpapi.UIHeader, "1")
	require.Equal(t, http.StatusNoContent, out.status)
	require.Contains(t, out.header.Get("Set-Cookie"), "Max-Age=0")
	require.Equal(t, http.StatusUnauthorized, b.do(t, http.MethodGet, "/v1/whoami", "", "", "Authorization", "", "Cookie", "conveyor_session=cvk_bad").status)
}

// A sign-in refused by the dashboard is a refused authentication like any
// other (README: "Refused authentications are logged without the secret
// and counted in conveyor_auth_failures_total{reason}"): pasting keys into
// the sign-in form must not be a way to try them unseen.
func TestDashboardSignInRefusalsAreCountedAndLogged(t *testing.T) {
	t.Parallel()
	var cfg config.API
	first := setup(t, capture(&cfg))
	var logs testenv.SyncBuffer
	cfg.LogLevel = "debug"
	b := first.another(t, cfg, &logs)

	revoked := b.post(t, "/v1/keys", `{"name":"revoked","role":"reader"}`).json(t)
	require.Equal(t, http.StatusOK, b.do(t, http.MethodDelete, "/v1/keys/"+revoked["id"].(string), "", "").status)
	attempts := map[string]string{auth.ReasonUnknownKey: unknownKey(), auth.ReasonRevoked: revoked["secret"].(string)}
	for reason, key := range attempts {
		resp := b.do(t, http.MethodPost, "/ui/session", "application/json", `{"key":"`+key+`"}`,
			"Authorization", "", httpapi.UIHeader, "1")
		require.Equal(t, http.StatusUnauthorized, resp.status, "%s: %s", reason, resp.body)
	}

	metrics := string(b.get(t, "/metrics").body)
	logged := logs.String()
	for reason, key := range attempts {
		series := fmt.Sprintf("conveyor_auth_failures_total{reason=%q}", reason)
		require.Equal(t, "1", metricValue(metrics, series), "a refused sign-in is not counted: %s", series)
		require.Contains(t, logged, fmt.Sprintf(`"reason":%q`, reason), "a refused sign-in is not logged")
		for _, secret := range secretsOf("Bearer " + key) {
			requireAbsent(t, logged, secret, "the pasted key is in the log")
		}
	}
}
