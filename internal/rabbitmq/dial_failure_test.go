package rabbitmq_test

import (
	"net/url"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/rabbitmq"
	"github.com/conveyorhq/conveyor/internal/testenv"
)

// A dial the broker answers but refuses says what it refused, and one
// that never reaches the broker says that: the operator is sent to the
// credentials, the vhost, TLS or the network, whichever failed.
func TestDialSaysWhatFailed(t *testing.T) {
	if testing.Short() {
		t.Skip("needs RabbitMQ")
	}
	t.Parallel()
	base, err := url.Parse(testenv.NewVhost(t))
	require.NoError(t, err)
	with := func(change func(u *url.URL)) string {
		u := *base
		change(&u)
		return u.String()
	}
	tests := []struct {
		name, url, want, not string
	}{
		{
			name: "wrong password",
			url:  with(func(u *url.URL) { u.User = url.UserPassword(u.User.Username(), "not-the-password") }),
			want: "refused the login", not: "unreachable",
		},
		{
			name: "missing vhost",
			url:  with(func(u *url.URL) { u.Path += "_missing" }),
			want: "refused the vhost", not: "unreachable",
		},
		{
			name: "TLS to a plain port",
			url:  with(func(u *url.URL) { u.Scheme = "amqps" }),
			want: "TLS handshake failed", not: "unreachable",
		},
		{
			name: "nothing listening",
			url:  "amqp://guest:guest@127.0.0.1:1/",
			want: "broker unreachable",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			_, err := rabbitmq.DialPublisher(tt.url, 1, "test", 1)
			require.ErrorContains(t, err, tt.want)
			if tt.not != "" {
				require.NotContains(t, err.Error(), tt.not)
			}
			require.NotContains(t, err.Error(), "not-the-password")
		})
	}
}
