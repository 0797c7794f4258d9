package main

import (
	"context"
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/conveyorhq/conveyor/internal/auth"
	"github.com/conveyorhq/conveyor/internal/config"
)

// An org may have only so many task types that no worker serves waiting:
// past the bound a submission naming a new one is refused and writes
// nothing; a type with no PENDING task left frees its place; types some
// worker serves never count, and another org has a bound of its own.
func TestUnservedTypesAreBoundedPerOrg(t *testing.T) {
	t.Parallel()
	b := setup(t, func(c *config.API) { c.MaxUnservedTypes = 2 })
	submit := func(typ string, header ...string) response {
		return b.post(t, "/v1/tasks", fmt.Sprintf(`{"type":%q}`, typ), header...)
	}
	first := submit("typo.one")
	require.Equal(t, http.StatusCreated, first.status, string(first.body))
	require.Equal(t, http.StatusCreated, submit("typo.two").status)
	require.Equal(t, http.StatusOK, submit("typo.two").status, "a type already waiting takes no new place")

	before := b.counts(t)
	refused := submit("typo.three")
	require.Equal(t, http.StatusUnprocessableEntity, refused.status, string(refused.body))
	require.Contains(t, refused.json(t)["detail"], "no worker serves")
	batch := b.post(t, "/v1/tasks/batch", `{"tasks":[{"type":"typo.one"},{"type":"typo.four"}]}`)
	require.Equal(t, http.StatusUnprocessableEntity, batch.status, string(batch.body))
	require.Equal(t, before, b.counts(t), "a refused submission writes nothing")

	// A served type is never counted.
	_, err := b.db.Pool.Exec(context.Background(), `INSERT INTO task_types (name) VALUES ('served')`)
	require.NoError(t, err)
	require.Equal(t, http.StatusCreated, submit("served").status)
	// Another org has its own bound.
	other, _ := b.db.Key(t, "org-b", auth.Writer)
	require.Equal(t, http.StatusCreated, submit("typo.three", "Authorization", "Bearer "+other).status)

	// Cancelling typo.one's only task frees its place.
	id := first.json(t)["id"].(string)
	require.Equal(t, http.StatusOK, b.post(t, "/v1/tasks/"+id+"/cancel", ``).status)
	require.Equal(t, http.StatusCreated, submit("typo.three").status)
}
