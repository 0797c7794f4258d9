// Package ui is Conveyor's web dashboard: a few static files, embedded in
// the API's binary and served at /ui/, that read and act through the same
// /v1 API every client uses (no server-side state, no build step, nothing
// fetched from elsewhere at run time).
//
// A person signs in by pasting an API key: POST /ui/session checks it and
// keeps it in an HttpOnly, SameSite=Strict cookie, which the API accepts in
// place of an Authorization header (see httpapi.SessionCookie), so that the
// browser's EventSource streams are authenticated too.
package ui

import (
	"embed"
	"encoding/json"
	"errors"
	"io/fs"
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/conveyorhq/conveyor/internal/auth"
)

//go:embed static
var files embed.FS

// Config is what the dashboard needs from the API.
type Config struct {
	// Authenticate checks a bearer Authorization header, sent with r: as
	// the API checks its requests' credentials, counting and logging a
	// refusal, within the failed authentications r's address may make and
	// within the principal's rate limit (an error with a RetryAfter()
	// time.Duration method refuses the sign-in for that long).
	Authenticate func(r *http.Request, header string) (auth.Principal, error)
	// Cookie is the name of the session cookie, Header the header a
	// browser's changing request carries (httpapi.SessionCookie, UIHeader).
	Cookie, Header string
}

// Handler serves the dashboard under /ui.
func Handler(cfg Config) http.Handler {
	static, err := fs.Sub(files, "static")
	if err != nil {
		panic(err) // the embedded tree always has static/
	}
	assets := http.StripPrefix("/ui/static/", http.FileServerFS(static))
	shell, err := fs.ReadFile(static, "index.html")
	if err != nil {
		panic(err)
	}
	mux := http.NewServeMux()
	mux.Handle("GET /ui/static/", headers(assets))
	mux.HandleFunc("POST /ui/session", cfg.signIn)
	mux.HandleFunc("POST /ui/logout", cfg.signOut)
	mux.HandleFunc("GET /ui", func(w http.ResponseWriter, r *http.Request) {
		http.Redirect(w, r, "/ui/", http.StatusMovedPermanently)
	})
	// Every page is the one shell; app.js draws the page its path names.
	page := headers(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		w.Header().Set("Cache-Control", "no-cache")
		_, _ = w.Write(shell)
	}))
	for _, p := range []string{"/ui/{$}", "/ui/login", "/ui/tasks", "/ui/tasks/{id}", "/ui/workflows", "/ui/runs/{id}", "/ui/jobs"} {
		mux.Handle("GET "+p, page)
	}
	return mux
}

// headers sets what every dashboard response carries: nothing but the
// dashboard's own files may run, and no other site may frame it.
func headers(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		h := w.Header()
		h.Set("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
		h.Set("X-Content-Type-Options", "nosniff")
		h.Set("Referrer-Policy", "same-origin")
		next.ServeHTTP(w, r)
	})
}

// signIn checks the pasted key and keeps it in the session cookie.
func (cfg Config) signIn(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get(cfg.Header) == "" {
		answer(w, http.StatusForbidden, "sign in from the dashboard's page")
		return
	}
	var in struct {
		Key string `json:"key"`
	}
	if err := json.NewDecoder(http.MaxBytesReader(w, r.Body, 4096)).Decode(&in); err != nil || strings.TrimSpace(in.Key) == "" {
		answer(w, http.StatusBadRequest, "paste an API key")
		return
	}
	key := strings.TrimSpace(in.Key)
	p, err := cfg.Authenticate(r, "Bearer "+key)
	var limited interface{ RetryAfter() time.Duration }
	if errors.As(err, &limited) {
		w.Header().Set("Retry-After", strconv.Itoa(int(math.Ceil(limited.RetryAfter().Seconds()))))
		answer(w, http.StatusTooManyRequests, err.Error())
		return
	}
	if err != nil {
		status := http.StatusUnauthorized
		if auth.ReasonOf(err) == auth.ReasonLookup {
			status = http.StatusServiceUnavailable
		}
		answer(w, status, err.Error())
		return
	}
	http.SetCookie(w, &http.Cookie{Name: cfg.Cookie, Value: key, Path: "/", HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: secure(r)})
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(map[string]string{"name": p.Name, "org": p.OrgSlug, "role": string(p.Role)})
}

// signOut forgets the session.
func (cfg Config) signOut(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get(cfg.Header) == "" {
		answer(w, http.StatusForbidden, "sign out from the dashboard's page")
		return
	}
	http.SetCookie(w, &http.Cookie{Name: cfg.Cookie, Value: "", Path: "/", MaxAge: -1, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: secure(r)})
	w.WriteHeader(http.StatusNoContent)
}

// secure: the dashboard was reached over HTTPS, here or at a proxy.
func secure(r *http.Request) bool {
	return r.TLS != nil || r.Header.Get("X-Forwarded-Proto") == "https"
}

func answer(w http.ResponseWriter, status int, detail string) {
	w.Header().Set("Content-Type", "application/problem+json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(map[string]any{"title": http.StatusText(status), "status": status, "detail": detail})
}
