package testenv

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"encoding/base64"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/go-jose/go-jose/v4"
)

// Issuer is an OpenID Connect issuer served by httptest, with RSA keys made
// in the test. It is safe for concurrent use.
type Issuer struct {
	// URL is the issuer identifier: the "iss" of its tokens and the base of
	// its discovery document.
	URL string

	mu  sync.Mutex
	key jose.JSONWebKey // the current private signing key, KeyID set
}

// NewIssuer starts an issuer on loopback, closed when t ends. It serves
// /.well-known/openid-configuration and its JWKS at /jwks.
func NewIssuer(t testing.TB) *Issuer {
	t.Helper()
	i := &Issuer{}
	i.Rotate(t)
	mux := http.NewServeMux()
	mux.HandleFunc("GET /.well-known/openid-configuration", func(w http.ResponseWriter, r *http.Request) {
		writeJSON(w, map[string]any{
			"issuer":                                i.URL,
			"jwks_uri":                              i.URL + "/jwks",
			"id_token_signing_alg_values_supported": []string{string(jose.RS256)},
			"response_types_supported":              []string{"id_token"},
			"subject_types_supported":               []string{"public"},
		})
	})
	mux.HandleFunc("GET /jwks", func(w http.ResponseWriter, r *http.Request) {
		i.mu.Lock()
		pub := i.key.Public()
		i.mu.Unlock()
		writeJSON(w, jose.JSONWebKeySet{Keys: []jose.JSONWebKey{pub}})
	})
	// The server starts only once URL is set, so handlers read it unraced.
	srv := httptest.NewUnstartedServer(mux)
	i.URL = "http://" + srv.Listener.Addr().String()
	srv.Start()
	t.Cleanup(srv.Close)
	return i
}

// Token returns a JWT signed with the issuer's current key (RS256, its kid
// in the header). It sets iss to URL, iat to now and exp to an hour from
// now unless claims has them; callers give sub, aud, email and the like.
// A time.Time claim is written as seconds since the epoch, as JWTs want.
func (i *Issuer) Token(t testing.TB, claims map[string]any) string {
	t.Helper()
	now := time.Now()
	all := map[string]any{"iss": i.URL, "iat": now, "exp": now.Add(time.Hour)}
	for k, v := range claims {
		all[k] = v
	}
	for k, v := range all {
		if tm, ok := v.(time.Time); ok {
			all[k] = tm.Unix()
		}
	}
	payload, err := json.Marshal(all)
	if err != nil {
		t.Fatalf("testenv: token claims: %v", err)
	}

	i.mu.Lock()
	key := i.key
	i.mu.Unlock()
	signer, err := jose.NewSigner(jose.SigningKey{Algorithm: jose.RS256, Key: key},
		(&jose.SignerOptions{}).WithType("JWT"))
	if err != nil {
		t.Fatalf("testenv: signer: %v", err)
	}
	sig, err := signer.Sign(payload)
	if err != nil {
		t.Fatalf("testenv: sign: %v", err)
	}
	raw, err := sig.CompactSerialize()
	if err != nil {
		t.Fatalf("testenv: serialize token: %v", err)
	}
	return raw
}

// Rotate makes a new current key. From then on the JWKS has only the new
// key, so tokens signed before fail once a verifier fetches the keys again.
func (i *Issuer) Rotate(t testing.TB) {
	t.Helper()
	priv, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatalf("testenv: rsa key: %v", err)
	}
	key := jose.JSONWebKey{Key: priv, Algorithm: string(jose.RS256), Use: "sig"}
	// The thumbprint makes a kid unique to the key, so no two issuers in a
	// test share one by chance.
	thumb, err := key.Thumbprint(crypto.SHA256)
	if err != nil {
		t.Fatalf("testenv: key thumbprint: %v", err)
	}
	key.KeyID = base64.RawURLEncoding.EncodeToString(thumb)

	i.mu.Lock()
	i.key = key
	i.mu.Unlock()
}

func writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(v)
}
