package auth

import (
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base32"
	"strings"
)

// An API key reads cvk_<prefix>_<secret>: the prefix (cvk_ and 16
// characters) is stored and shown, and finds the key; the secret is 256
// random bits, kept only as the SHA-256 of the whole key.
const keyMark = "cvk_"

var keyEncoding = base32.NewEncoding("abcdefghijklmnopqrstuvwxyz234567").WithPadding(base32.NoPadding)

// NewKey is a freshly made API key.
type NewKey struct {
	// Token is the whole key, shown to its creator once.
	Token string
	// Prefix is the key's visible, stored part.
	Prefix string
	// Hash is what is stored of the token.
	Hash []byte
}

// GenerateKey makes a new API key.
func GenerateKey() NewKey {
	var id [10]byte
	var secret [32]byte
	// crypto/rand.Read never fails.
	_, _ = rand.Read(id[:])
	_, _ = rand.Read(secret[:])
	prefix := keyMark + keyEncoding.EncodeToString(id[:])
	token := prefix + "_" + keyEncoding.EncodeToString(secret[:])
	return NewKey{Token: token, Prefix: prefix, Hash: HashKey(token)}
}

// KeyPrefix returns the prefix of a token that has the form of an API key.
func KeyPrefix(token string) (string, bool) {
	if !strings.HasPrefix(token, keyMark) {
		return "", false
	}
	id, secret, ok := strings.Cut(token[len(keyMark):], "_")
	if !ok || len(id) != 16 || len(secret) != 52 {
		return "", false
	}
	if _, err := keyEncoding.DecodeString(id); err != nil {
		// Not a prefix GenerateKey makes (bytes PostgreSQL would not even
		// take as text).
		return "", false
	}
	return keyMark + id, true
}

// HashKey is the stored form of a key.
func HashKey(token string) []byte {
	sum := sha256.Sum256([]byte(token))
	return sum[:]
}

// keyMatches compares a token with a stored hash in constant time.
func keyMatches(token string, hash []byte) bool {
	return subtle.ConstantTimeCompare(HashKey(token), hash) == 1
}
