package main

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/httpapi"
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
