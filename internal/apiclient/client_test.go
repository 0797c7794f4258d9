package apiclient_test

import (
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/apiclient"
)

// The API's refusals become *Error: from the problem document when there
// is one, else from the status and a short text body.
func TestErrorsFromAnswers(t *testing.T) {
	t.Parallel()
	for name, tc := range map[string]struct {
		status      int
		contentType string
		header      http.Header
		body        string
		want        apiclient.Error
		text        string
	}{
		"problem": {status: 422, contentType: "application/problem+json",
			body: `{"type":"urn:conveyor:problem:invalid","title":"Unprocessable Entity","status":422,"detail":"priority: must be 0 to 9","field":"priority","instance":"/v1/tasks"}`,
			want: apiclient.Error{Status: 422, Type: "urn:conveyor:problem:invalid", Title: "Unprocessable Entity",
				Detail: "priority: must be 0 to 9", Field: "priority", Instance: "/v1/tasks"},
			text: "priority: must be 0 to 9 (HTTP 422)"},
		"rate limited": {status: 429, contentType: "application/problem+json", header: http.Header{"Retry-After": {"3"}},
			body: `{"title":"Too Many Requests","status":429}`,
			want: apiclient.Error{Status: 429, Title: "Too Many Requests", RetryAfter: 3 * time.Second},
			text: "Too Many Requests (HTTP 429)"},
		"proxy page": {status: 502, contentType: "text/html", body: "<html><body>bad gateway</body></html>",
			want: apiclient.Error{Status: 502, Title: "Bad Gateway"}, text: "Bad Gateway (HTTP 502)"},
		"plain text": {status: 500, contentType: "text/plain", body: "upstream timed out\n",
			want: apiclient.Error{Status: 500, Title: "Internal Server Error", Detail: "upstream timed out"},
			text: "upstream timed out (HTTP 500)"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				for k, v := range tc.header {
					w.Header()[k] = v
				}
				w.Header().Set("Content-Type", tc.contentType)
				w.WriteHeader(tc.status)
				fmt.Fprintf(w, "%s", tc.body)
			}))
			t.Cleanup(srv.Close)
			c, err := apiclient.New(apiclient.Config{URL: srv.URL})
			require.NoError(t, err)

			_, err = c.Task(t.Context(), "x")
			e, ok := errors.AsType[*apiclient.Error](err)
			require.True(t, ok, "%T: %v", err, err)
			require.Equal(t, tc.want, *e)
			require.EqualError(t, err, tc.text)
		})
	}
}

func TestNewRefusesABadURL(t *testing.T) {
	t.Parallel()
	for _, u := range []string{"", "localhost:8080", "ftp://x", "http://"} {
		_, err := apiclient.New(apiclient.Config{URL: u})
		require.Error(t, err, u)
	}
	c, err := apiclient.New(apiclient.Config{URL: "http://localhost:8080/"})
	require.NoError(t, err)
	require.Equal(t, "http://localhost:8080", c.URL())
}
